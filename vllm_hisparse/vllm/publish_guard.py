"""Which host pages the host index may hand to a hit (prefix caching, docs/design/prefix-caching.md
section 3.3). A hit reads a shared host page in place of the GPU block vLLM's cache gives it for
that hash, so the two must hold the same bytes. A request's host copy of a page equals the GPU
block it wrote (its own computation) or read (a hit's block, copied at its first step); another
block with the same hash may hold other bytes: a duplicate computed by another request in the same
step, or a recompute after an eviction (prefill is not batch-invariant in bf16 on the GPU).

So each published page keeps its *source*: that block and its generation (bumped every time the
KV manager hashes the block for a computation, so a reused block never passes for its old self).
A page is published only from a block that is cached under its hash (``publishable``), and shared
only while the block vLLM's lookup returns for the hash is still that source (``valid``; the
connector drops an entry that fails). A donation moves a source to its copy (``moved``: the same
bytes). Refusals lose sharing, never exactness. Scheduler process, one per block pool (the spill
ledger holds it).
"""
from __future__ import annotations

from vllm.v1.core.kv_cache_utils import get_block_hash


class PublishGuard:
    def __init__(self, block_pool):
        self.pool = block_pool
        self._gen: dict[int, int] = {}        # block id -> computations hashed into it
        self._read: dict[str, dict[int, tuple]] = {}   # req -> {page: (block, gen)} its copy's
        self._source: dict[bytes, tuple] = {}           # published hash -> (block, gen)
        self._source_of: dict[int, bytes] = {}          # source block id -> its hash
        self.dropped = 0                      # index entries whose source went (counted)

    # ---- the KV manager's events ----------------------------------------------------------------
    def computed(self, request_id: str, page: int, block) -> None:
        """The request hashed ``block`` (its page ``page``) for its own computation."""
        self._gen[block.block_id] = self._gen.get(block.block_id, 0) + 1
        self._read.setdefault(request_id, {})[page] = (block, self._gen[block.block_id])

    def hit(self, request_id: str, page: int, block) -> None:
        """The request's page ``page`` is a prefix-cache hit on ``block`` (its host copy, if not
        shared, is copied from that block's bytes: itself or its floor copy)."""
        self._read.setdefault(request_id, {})[page] = (block, self._gen.get(block.block_id, 0))

    def moved(self, src, dst) -> None:
        """A donation moved ``src``'s hash to ``dst``, a copy of it."""
        h = self._source_of.pop(src.block_id, None)
        if h is not None:
            self._source[h] = (dst, self._gen.get(dst.block_id, 0))
            self._source_of[dst.block_id] = h

    def drop(self, request_id: str) -> None:
        self._read.pop(request_id, None)

    # ---- the connector's questions --------------------------------------------------------------
    def publishable(self, request_id: str, page: int, block_hash) -> bool:
        """Whether the request's host copy of ``page`` may be indexed under ``block_hash``: the
        block it came from is still that computation's and cached under that hash; recorded as
        the entry's source."""
        rec = self._read.get(request_id, {}).get(page)
        if rec is None or not self._same(rec, block_hash) or not \
                self.pool.cached_block_hash_to_block.contain(rec[0].block_hash, rec[0].block_id):
            return False
        old = self._source.pop(block_hash, None)
        if old is not None:
            self._source_of.pop(old[0].block_id, None)
        self._source[block_hash] = rec
        self._source_of[rec[0].block_id] = block_hash
        return True

    def valid(self, block_hash) -> bool:
        """Whether a hit on ``block_hash`` now reads the published copy's source block."""
        rec = self._source.get(block_hash)
        ok = rec is not None and self._same(rec, block_hash) and \
            self.pool.cached_block_hash_to_block.get_one_block(rec[0].block_hash) is rec[0]
        if not ok:
            self.forget(block_hash)
        return ok

    def forget(self, block_hash) -> None:
        rec = self._source.pop(block_hash, None)
        if rec is not None:
            self._source_of.pop(rec[0].block_id, None)
            self.dropped += 1

    def prune(self, index) -> None:
        """Forget sources of hashes the host index no longer holds (evicted, swapped, reset),
        once they outnumber its entries: bounded by the index."""
        if len(self._source) > 2 * len(index) + 1024:
            for h in [h for h in self._source if h not in index]:
                self._source_of.pop(self._source.pop(h)[0].block_id, None)

    def _same(self, rec, block_hash) -> bool:
        blk, gen = rec
        return (blk.block_hash is not None and self._gen.get(blk.block_id, 0) == gen
                and get_block_hash(blk.block_hash) == block_hash)
