"""HostPageTable: the host pool's page ids, owned by the scheduler (one per engine), shared between
requests by block hash (docs/design/prefix-caching.md section 3.3).

A page id names one page of every host layer of the worker's ``HostKVPool`` (the same id on every
tensor-parallel rank: the scheduler hands the same list to each through the step's metadata).
``ref[page]`` counts its holders: each live request whose page list holds it, and the ``index``
(block hash -> page) once its host copy is complete (published). A page only the index holds is
*cache-only*: kept in LRU order and the only kind ``take`` evicts, so a page a live request reads
is never freed. A page held by a request and published is read-only from then on: a request
about to write pages (a preempted one resumed from an earlier start) makes them private first
(``make_writable``: a page others read is swapped for a fresh one, a page only the index shares
with it is unpublished).

Every method runs in the scheduler process; no vLLM, no torch (block hashes are opaque keys).
"""
from __future__ import annotations

from collections import OrderedDict


class HostPageTable:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))   # pop() hands out 0, 1, ...
        self.ref = [0] * num_pages
        self.index: dict[object, int] = {}          # block hash -> page (host copy complete)
        self._hash_of: dict[int, object] = {}       # page -> its hash in ``index``
        self._lru: OrderedDict[int, None] = OrderedDict()   # cache-only pages, oldest first
        self.publish_enabled = True                 # False: nothing is published (tests' control)

    # ---- counts ------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def evictable(self) -> int:
        return len(self._lru)

    @property
    def used(self) -> int:
        """Pages not on the free list: held by a live request or by the index."""
        return self.num_pages - len(self._free)

    def can_take(self, n: int) -> bool:
        return n <= len(self._free) + len(self._lru)

    # ---- requests ----------------------------------------------------------------------------
    def lookup(self, hashes) -> list[int]:
        """The pages of the leading ``hashes`` that ``index`` holds (stops at the first missing)."""
        out = []
        for h in hashes:
            page = self.index.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def can_acquire(self, shared: list[int], fresh: int) -> bool:
        """Whether ``acquire(shared, fresh)`` succeeds: the shared pages it holds stop being
        evictable."""
        return fresh <= len(self._free) + len(self._lru) - sum(p in self._lru for p in shared)

    def acquire(self, shared: list[int], fresh: int) -> list[int]:
        """A request's page list: ``shared`` (from ``lookup``, one more holder each) then
        ``fresh`` pages of its own (evicting cache-only pages as needed). All or nothing."""
        if not self.can_acquire(shared, fresh):
            raise RuntimeError(f"HostPageTable: {fresh} fresh pages needed, {self.free} free and "
                               f"{self.evictable} evictable of {self.num_pages}; check "
                               f"can_acquire")
        for page in shared:
            self._hold(page)
        return list(shared) + self.take(fresh)

    def take(self, n: int) -> list[int]:
        """``n`` fresh pages (ref 1), cache-only pages evicted oldest first when none is free."""
        assert self.can_take(n), (n, self.free, self.evictable)
        out = []
        for _ in range(n):
            if not self._free:
                self._evict_one()
            page = self._free.pop()
            self.ref[page] = 1
            out.append(page)
        return out

    def release(self, pages: list[int]) -> None:
        """A request gives its pages back: unheld ones go to the free list, published ones whose
        last request holder this was become cache-only (most recently used)."""
        for page in pages:
            self.ref[page] -= 1
            assert self.ref[page] >= 0, page
            if self.ref[page] == 0:
                self._free.append(page)
            elif self.ref[page] == 1 and page in self._hash_of:
                self._lru[page] = None

    def writable_cost(self, pages: list[int], first: int) -> int:
        """Fresh pages ``make_writable(pages, first)`` needs: one per page others read."""
        return sum(1 for page in pages[first:] if self._others(page) > 0)

    def make_writable(self, pages: list[int], first: int) -> None:
        """The request holding ``pages`` writes pages ``[first, len)`` again (a resumed request
        recomputing from an earlier start): each page another request reads is swapped (in
        place) for a fresh one; each one only the index shares with it is unpublished. Check
        ``can_take(writable_cost(...))`` first."""
        for i in range(first, len(pages)):
            page = pages[i]
            if self._others(page) > 0:
                self.ref[page] -= 1               # others hold it: stays >= 1, never freed here
                if self.ref[page] == 1 and page in self._hash_of:
                    self._lru[page] = None
                pages[i] = self.take(1)[0]
            elif page in self._hash_of:
                self._unpublish(page)

    # ---- the index ---------------------------------------------------------------------------
    def publish(self, block_hash, page: int) -> bool:
        """``page`` (held by a request) holds the complete host copy of ``block_hash``: index it,
        unless the hash is indexed already (another copy) or the page is. True if indexed."""
        if not self.publish_enabled or block_hash in self.index or page in self._hash_of:
            return False
        assert self.ref[page] >= 1, page
        self.index[block_hash] = page
        self._hash_of[page] = block_hash
        self.ref[page] += 1
        return True

    def forget(self, block_hash) -> bool:
        """Drop ``block_hash``'s entry (the GPU block a hit would read is no longer the one its
        host copy came from); the page stays with the requests that hold it. True if indexed."""
        page = self.index.get(block_hash)
        if page is None:
            return False
        self._unpublish(page)
        return True

    def reset(self) -> int:
        """Drop every index entry (the prefix cache was reset); returns how many."""
        n = len(self.index)
        for page in list(self._hash_of):
            self._unpublish(page)
        return n

    # ---- internals ---------------------------------------------------------------------------
    def _others(self, page: int) -> int:
        """Request holders of ``page`` besides the caller (who holds it once)."""
        return self.ref[page] - 1 - (1 if page in self._hash_of else 0)

    def _hold(self, page: int) -> None:
        self._lru.pop(page, None)
        self.ref[page] += 1

    def _unpublish(self, page: int) -> None:
        del self.index[self._hash_of.pop(page)]
        self._lru.pop(page, None)
        self.ref[page] -= 1
        if self.ref[page] == 0:
            self._free.append(page)

    def _evict_one(self) -> None:
        page, _ = self._lru.popitem(last=False)
        del self.index[self._hash_of.pop(page)]
        self.ref[page] = 0
        self._free.append(page)
