"""The scheduler connector's host pages (docs/design/prefix-caching.md section 3.3): which host
page ids each host-backed request holds, shared by block hash through the engine's
``HostPageTable`` (core/host_pages.py). A base of ``connector_scheduler.ConnectorScheduler``, which
owns the state (``host_pages``, ``_pages``, ``_shared_upto``, ``_published``, ``_requests``,
``_hit``, ``_reserved``) and calls these at admission, resumption, each step's metadata and reset.

* admission: the leading full pages of the request's prefix-cache hit that the index holds are
  shared (read-only for it: ``shared_upto``), the rest of its life's pages are fresh;
* publishing: each step, the complete host pages of running host-backed requests are indexed, each
  with the GPU block its bytes came from; a hit shares a page only while vLLM's lookup returns that
  block (vllm/publish_guard.py), else the entry is dropped;
* resumption (or a retried allocation) from a start below pages it holds: those become private
  (``HostPageTable.make_writable``), else the request waits;
* ``reset_cache``: the index is dropped (vLLM's ``reset_prefix_cache(reset_connector=True)``).
Every method runs in the scheduler process.
"""
from __future__ import annotations

from vllm_hisparse.core.residency import is_sparse_at


class HostPageAdmission:
    def _shareable(self, request, hit_tokens: int) -> list[int]:
        """Host pages the index holds for the leading full pages of the request's hit."""
        hashes = _hashes(request)
        hashes = hashes[:min(hit_tokens // self.cfg.page_size, len(hashes))]
        guard = self._shared.guard if self._shared is not None else None
        if guard is not None:                 # each page's source still the block the hit reads
            n = 0
            while n < len(hashes) and hashes[n] in self.host_pages.index and guard.valid(hashes[n]):
                n += 1
            if n < len(hashes) and hashes[n] in self.host_pages.index:
                self.host_pages.forget(hashes[n])           # its source went: unpublished
            hashes = hashes[:n]
        return self.host_pages.lookup(hashes)

    def _host_fits(self, need: int, shared: list[int]) -> bool:
        """``need`` pages of a life, ``shared`` of them the index's: the host pool holds the
        fresh ones (free or evictable pages); a GPU dense pool (private, admit_pages) holds all."""
        if self._bound != "host" and self._reserved_total + need > self.admit_pages:
            return False
        return self.host_pages.can_acquire(shared, need - len(shared))

    def _take_pages(self, rid: str, need: int, shared: list[int]) -> None:
        self._reserved[rid] = need
        self._reserved_total += need
        if need:
            self._pages[rid] = self.host_pages.acquire(shared, need - len(shared))
            self._shared_upto[rid] = self._published[rid] = len(shared)

    def _writable_from(self, rid: str, start: int) -> bool:
        """A request admitted before (resumed after a preemption, or its allocation failed) starts
        at ``start``: its host pages from there on are written again, so they are made private
        (HostPageTable.make_writable); False (it waits) while the pool lacks the fresh pages."""
        pages = self._pages.get(rid)
        if not pages:
            return True
        first = start // self.cfg.page_size
        if not self.host_pages.can_take(self.host_pages.writable_cost(pages, first)):
            return False
        self.host_pages.make_writable(pages, first)
        self._shared_upto[rid] = min(self._shared_upto[rid], first)
        self._published[rid] = min(self._published[rid], first)
        return True

    def _publish(self, cached, skip: list[str]) -> None:
        """Index the full pages of running host-backed requests (scheduled_cached_reqs, neither
        resumed nor moving into the host tier now: ``skip``) whose host copy is complete: the
        pages below num_computed_tokens, written by steps before this one (sparse at that context:
        switch-copied or written through); readers run in later steps (stream order)."""
        P = self.cfg.page_size
        for i, rid in enumerate(cached.req_ids):
            pages = self._pages.get(rid)
            if (not pages or rid in cached.resumed_req_ids or rid in skip
                    or rid in self._hostless):
                continue
            n = cached.num_computed_tokens[i]         # the request's, before this step
            if not is_sparse_at(self.cfg, self._prompt[rid], n):
                continue
            hashes = _hashes(self._requests[rid])
            end = min(n // P, len(hashes), len(pages))
            guard = self._shared.guard if self._shared is not None else None
            for p in range(self._published[rid], end):
                # only a copy equal to the one GPU block a hit reads (vllm/publish_guard.py)
                if hashes[p] in self.host_pages.index:
                    continue
                if guard is None or guard.publishable(rid, p, hashes[p]):
                    self.host_pages.publish(hashes[p], pages[p])
            self._published[rid] = max(self._published[rid], end)
        if self._shared is not None and self._shared.guard is not None:
            self._shared.guard.prune(self.host_pages.index)

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True): drop the host index (pages only it
        holds go back to the free list; pages live requests hold stay theirs)."""
        self.host_pages.reset()
        return True


def _hashes(request) -> list:
    """vLLM's Request.block_hashes (page p's hash; empty with prefix caching off). The connector's
    tests pass stand-ins without it: they share nothing."""
    return getattr(request, "block_hashes", ())
