"""Which live request each batch row belongs to, in one worker process.

The attention metadata's batch rows carry no request ids; the KV connector learns each request's
first GPU block from the scheduler (block 0 is a hot slot, never freed while the request lives),
so a batch row maps to its request through ``block_table[row, 0]``. One ``RequestRows`` per
worker object (vllm/worker.py), written by the connector's worker half, read by the planners.
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
        if any(i is None for i in ids):
            bad = [b for b, i in zip(first_blocks, ids) if i is None]
            raise RuntimeError(f"hisparse: batch rows with first blocks {bad} have no request")
        return ids
