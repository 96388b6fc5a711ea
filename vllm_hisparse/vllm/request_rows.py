"""Which live request each batch row belongs to, in one worker process.

The attention metadata's batch rows carry no request ids; the KV connector learns each request's
first GPU block from the scheduler (block 0 is a hot slot, never freed while the request lives),
so a batch row maps to its request through ``block_table[row, 0]``. One ``RequestRows`` per
worker object (vllm/worker.py), written by the connector's worker half, read by the planners.

With vLLM's prefix caching on, two live requests could share a cached block 0; the KV manager
copies a hit block 0 into a fresh block (vllm/spec.py, floor copy-on-write) so that they never do.
A batch whose rows still share a first block is refused (``ids_of`` raises: its rows' requests
cannot be told apart). ``bind`` on a block another request holds takes it over: the holder was
preempted (vLLM freed its blocks; the worker hears of it only at its resumption, which binds it
again), the one way a live binding's block goes to another request.
"""
from __future__ import annotations


class RequestRows:
    """Request id <-> first GPU block, both ways (worker process)."""

    def __init__(self):
        self.block_to_req: dict[int, str] = {}
        self.req_to_block: dict[str, int] = {}

    def bind(self, req_id: str, first_block: int) -> None:
        """A new or resumed request starts at ``first_block`` (connector, bind_connector_metadata)."""
        self.unbind(req_id)
        holder = self.block_to_req.get(first_block)
        if holder is not None:                     # preempted (see the module's docstring)
            del self.req_to_block[holder]
        self.req_to_block[req_id] = first_block
        self.block_to_req[first_block] = req_id

    def unbind(self, req_id: str) -> None:
        """A dropped request no longer owns its first block."""
        old = self.req_to_block.pop(req_id, None)
        if old is not None and self.block_to_req.get(old) == req_id:
            del self.block_to_req[old]

    def ids_of(self, first_blocks: list[int]) -> list[str] | None:
        """Request ids of the batch rows (first_blocks: (B,) block 0 of each row); None for a dummy
        batch (profiling, warm-up, graph capture) in which no row belongs to a live request."""
        ids = [self.block_to_req.get(b) for b in first_blocks]
        if all(i is None for i in ids):
            return None
        real = [b for b in first_blocks if b >= 0]
        if len(set(real)) < len(real):
            dup = sorted({b for b in real if real.count(b) > 1})
            raise RuntimeError(f"hisparse: batch rows share first blocks {dup}: two live requests "
                               f"on one block 0 (a prefix-cache hit the KV manager did not copy: "
                               f"vllm/spec.py floor copy-on-write)")
        if any(i is None for i in ids):
            bad = [b for b, i in zip(first_blocks, ids) if i is None]
            raise RuntimeError(f"hisparse: batch rows with first blocks {bad} have no request")
        return ids
