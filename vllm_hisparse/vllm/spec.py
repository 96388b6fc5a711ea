"""HiSparseSpec and HiSparseManager: the bounded KV-cache spec of hisparse layers (scheduler side).

A request's GPU blocks are its logical pages. During the prompt's prefill all of them are held
(dense prefill reads them); afterwards the manager gives back pages ``[S, processed // page)``
(``core.residency.freed_pages``: complete pages, already written through to the host pool) and
keeps blocks ``[0, S)`` as the hot slots plus the newest page, so the scheduler sees the rest as
free. The worker must never read a freed block; it uses the same rule to know which ones.

With ``resident_first`` a request keeps every block after its prompt (*resident*) until the free
blocks fall below the reserve R at a ``remove_skipped_blocks`` call (or below what a waiting
request needs, when the connector asks before admitting it: ``SpillLedger.make_room``); then the
manager takes just the missing blocks, from the request with the most surplus first
(``core.residency.spill_order``), oldest pages first: the request keeps a window of its ``keep``
newest complete pages beyond the floor (*partial*; keep 0 = the floor), keep only shrinks. Each
new keep goes to a ``SpillLedger`` that the scheduler-side connector ships to the worker in the
step's metadata (docs/vllm-integration.md, "Residency states"; the ledger: vllm/spill_ledger.py).

A *host-less* request (admitted when the host pool or the indexer rows had no room for it:
core/residency.py ``hostless_fits``) has no host copy: the manager never frees any of its blocks
and never spills it, in either mode. The connector names it in the ledger's ``hostless`` before
vLLM allocates its first block.

With vLLM's prefix caching on (docs/design/prefix-caching.md, steps 1 and 2a) a request's first
``floor_blocks`` blocks F are private (*floor copy-on-write*, rule F of section 3.1): prefix-cache
hits among them are copied into fresh blocks with vLLM's own CoW (``_apply_cow``: the copy runs on
the worker before the step's forward). F = 1 in resident mode: block 0 of a live request, the
worker's identity of its batch rows (vllm/request_rows.py), is never shared. F = S with the host
tier: blocks [0, S) are the request's hot slots, which RESOLVE and the give-back inserts overwrite
from the first step the request has pages given back (``residency.freed_pages`` non-empty, as the
worker counts: ``_slots_written``). A request whose context can never reach ``min_context`` (the
connector names it in the ledger's ``never_sparse`` before vLLM allocates it) never writes its
slots, so its floor is block 0 alone, as in resident mode, plus any hit block below S that is
the own computed slot of a live request that may turn sparse (``_slot_owner``: that owner will
overwrite it). The blocks among them that the request computed itself were
hashed by ``cache_blocks``; at the end of that step's scheduling (``take_pending_cow_copies``,
after every allocation and prefix-cache lookup of the step) each hashed one is *donated*: its
cache entries move to a fresh block (``move_block_hashes``) that a copy queued for this step's
forward fills, and which then lies free, cached and evictable; with no free block its entries
are dropped instead (a lost hit, never a wrong one). Counted in ``donation``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.deployment import Deployment
from vllm_hisparse.core.residency import freed_pages, spill_order
from vllm_hisparse.ops.fp8 import FP8

from .compat import FullAttentionManager, FullAttentionSpec
from .publish_guard import PublishGuard
from .spill_ledger import ledger_of


@dataclass(frozen=True, kw_only=True)
class HiSparseSpec(FullAttentionSpec):
    # the engine's deployment (core/deployment.py; frozen, so the spec still hashes and pickles):
    # the KV manager gets no vLLM config, so its sizes travel here
    deployment: Deployment | None = None

    def __post_init__(self):
        super().__post_init__()
        # vLLM types an fp8 cache (--kv-cache-dtype fp8) uint8; hisparse's kernels read e4m3
        # values (ops/fp8.py), so vLLM views the layer caches as that (the same bytes), and every
        # hisparse tier has one dtype (backend.py refuses the other 1-byte caches)
        if self.dtype == torch.uint8:
            object.__setattr__(self, "dtype", FP8)

    @property
    def cfg(self) -> HiSparseConfig:
        return self.deployment.cfg

    @classmethod
    def merge(cls, specs):
        # FullAttentionSpec.merge rebuilds cls(...) from a fixed field list and drops ours.
        merged = super().merge(specs)
        assert len({s.deployment for s in specs}) == 1, "one hisparse deployment per KV group"
        return replace(merged, deployment=specs[0].deployment)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """Steady-state GPU bytes of one request: S hot blocks + the newest page (hisparse mode);
        the full length in resident mode or when no request can turn sparse (max_model_len below
        min_context). (The prompt's own prefill is still fully resident.)"""
        dep = self.deployment
        full = super().max_memory_usage_bytes(vllm_config)
        if not dep.cfg.host_tier or not dep.sparse_possible:
            return full
        return min(full, (dep.num_slots + 1) * self.page_size_bytes)


class HiSparseManager(FullAttentionManager):
    # F: a request's blocks [0, F) are never shared through the prefix cache (copied at a hit).
    # None: 1 in resident mode (block 0 is the worker's identity of a request), S with the host
    # tier (its hot slots) but 1 for a request that never turns sparse (``_floor_hits``); a number
    # here (a test's control) overrides all of them
    floor_blocks: int | None = None
    donate = True           # False: a test's control (slots overwritten while still cached)

    def __init__(self, kv_cache_spec: HiSparseSpec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.hs_cfg = kv_cache_spec.cfg
        dep = kv_cache_spec.deployment
        if type(self).floor_blocks is None:
            self.floor_blocks = (dep.num_slots if self.hs_cfg.host_tier and dep.sparse_possible
                                 else 1)
        self._floor_cow: dict[str, list[tuple[int, object]]] = {}   # req -> [(index, hit block)]
        # block id -> the live request that may turn sparse whose own computed, hashed slot it
        # is (it overwrites it once it has pages given back): a never-sparse hit copies these
        self._slot_owner: dict[int, str] = {}
        self._cached_this_step: set = set()     # hashes of blocks first computed in this step
        self._given_back_now: set[int] = set()  # ids of blocks given back in this step
        self._scheduled: dict[str, tuple[int, int]] = {}   # this step: req -> (start, prompt)
        self._donated: set[str] = set()         # requests whose slots may be overwritten now
        self._ledger = None                             # resident_first's spills
        # the pool's ledger: its host-less requests (both modes)
        self._shared = ledger_of(self.block_pool) if self.hs_cfg.host_tier else None
        # hashed slot blocks moved / dropped (the connector reports the ledger's: /metrics)
        self.donation = (self._shared.donation if self._shared is not None
                         else {"donated": 0, "dropped": 0})
        if self._shared is not None:
            self._shared.guard = PublishGuard(self.block_pool)
        self._seen: dict[str, tuple[int, int]] = {}     # req -> (processed tokens, prompt)
        self._keep: dict[str, int] = {}                 # spilled req -> keep (residency.freed_pages)
        if self.hs_cfg.resident_first and self.hs_cfg.host_tier:
            self._ledger = ledger_of(self.block_pool)
            if self._ledger.bound:
                raise ValueError("hisparse: resident_first=true needs all hisparse layers in one "
                                 "KV cache group; use resident_first=false for this model")
            self._ledger.bound = True
            self._ledger._manager = weakref.ref(self)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return
        # host-less: every block kept, never spilled (not in _seen); the reserve is still checked
        hostless = self._shared is not None and request_id in self._shared.hostless
        if self._ledger is None:                      # the floor right after the prompt
            if not hostless:
                self._free(request_id, processed_computed_tokens, num_prompt_tokens, 0)
            return
        if not hostless:
            self._seen[request_id] = (processed_computed_tokens, num_prompt_tokens)
            # its own window slides first (what it gives back anyway), then the reserve
            self._free(request_id, processed_computed_tokens, num_prompt_tokens,
                       self._keep.get(request_id))
        self.spill_until(self._ledger.reserve)

    def _free(self, request_id: str, processed: int, num_prompt: int, keep: int | None) -> None:
        lo, hi = freed_pages(self.hs_cfg, processed, num_prompt, keep)
        if hi > lo:
            # the worker's plan of this step may still read them (core/give_back.py): no copy
            # queued for this step may write one (_copy_dst)
            self._given_back_now.update(
                b.block_id for b in self.req_to_blocks.get(request_id, ())[lo:hi]
                if not b.is_null)
            # Walks [lo, hi) backwards and stops at the first block freed by an earlier call: the
            # freed pages are always one range [S, hi) that only grows.
            self._remove_blocks_in_range(request_id, lo, hi)

    def surplus(self, request_id: str) -> int:
        """Complete pages beyond the floor the request holds (what it can give back): none
        before its prompt is processed and its context reached min_context; then its kept
        window, all of it while resident (O(1): called per request under pressure)."""
        processed, prompt = self._seen[request_id]
        S = self.hs_cfg.num_slots
        if freed_pages(self.hs_cfg, processed, prompt, 0)[1] <= S:
            return 0
        held = min(processed // self.hs_cfg.page_size, len(self.req_to_blocks.get(request_id, ())))
        return max(0, held - freed_pages(self.hs_cfg, processed, prompt,
                                         self._keep.get(request_id))[1])

    def spill_until(self, reserve: int | None) -> None:
        """Take blocks from requests with surplus, most surplus first, oldest pages first, until
        the pool's free blocks reach ``reserve`` (None: every surplus at once). Only the
        shortfall is taken, then the free blocks are re-counted: a block shared through the prefix
        cache does not come free with one request's pages."""
        while True:
            free = self.block_pool.get_num_free_blocks()
            if reserve is not None and free >= reserve:
                return
            sur = {r: self.surplus(r) for r in self._seen}
            want = reserve if reserve is not None else free + self.block_pool.num_gpu_blocks
            order = spill_order(sur, free, want)
            if not order:
                return
            rid = order[0]
            keep = 0 if reserve is None else max(0, sur[rid] - (reserve - free))
            self._keep[rid] = keep
            self._ledger.spilled[rid] = keep
            self._free(rid, *self._seen[rid], keep)

    # ---- floor copy-on-write (prefix caching; docs/design/prefix-caching.md section 3.1) --------
    def _never_sparse(self, request_id: str) -> bool:
        """The request's context never reaches min_context (the connector's ``never_sparse``):
        its hot slots are never written. A class-level F (a test's control) overrides it."""
        return (type(self).floor_blocks is None and self._shared is not None
                and request_id in self._shared.never_sparse)

    def _floor_hits(self, request_id: str, hits, tail: int | None = None) -> list[int]:
        """Indices of the hit blocks ``hits`` (the request's first blocks) that the floor copies:
        those < F (vLLM's partial-hit CoW already copies its ``tail`` block: not twice). A request
        that never turns sparse copies block 0 (its identity on the worker) and, below S, only a
        block that a live request that may turn sparse computed as its own slot (it will
        overwrite it: ``_slot_owner``); it shares the rest, as stock vLLM does."""
        if self._never_sparse(request_id):
            S = self.hs_cfg.num_slots
            return [i for i, b in enumerate(hits[:S]) if not b.is_null and i != tail
                    and (i == 0 or b.block_id in self._slot_owner)]
        return [i for i, b in enumerate(hits[:self.floor_blocks])
                if not b.is_null and i != tail]

    def floor_copies(self, request, hit_blocks: int) -> int:
        """Fresh blocks the floor will take when ``request`` is allocated with a prefix-cache hit
        of its first ``hit_blocks`` blocks (looked up as vLLM's hit does; the connector's
        admission count, ``admission_blocks``)."""
        hashes = list(getattr(request, "block_hashes", ()) or ())[:hit_blocks]
        hits = []
        for h in hashes:
            found = self.block_pool.get_cached_block(h, [self.kv_cache_group_id])
            if not found:
                break
            hits.append(found[0])
        return len(self._floor_hits(request.request_id, hits))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        n = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap)
        if request_id in self.num_cached_block or not new_computed_blocks:
            return n                                 # running: no new hits
        if any(b.block_hash in self._cached_this_step for b in new_computed_blocks):
            # a hit on blocks this very step computes: the floor's copy and the worker's Quest
            # rebuild (core/sparse_runtime.py) run before the step's layers and would read them
            # unwritten; too many blocks defers the request to the next step (vLLM's Mamba
            # manager defers its same-step hits so)
            return self.block_pool.num_gpu_blocks + 1
        # one fresh block per hit block the floor copies (a partial-hit tail is counted by vLLM
        # already; its partial state is recorded only in add_local_computed_blocks)
        tail = (num_local_computed_tokens // self.block_size if self._has_partial_local_hit(
            new_computed_blocks, num_local_computed_tokens) else None)
        k = len(self._floor_hits(request_id, new_computed_blocks, tail))
        if k and self._given_back_now:
            # the copies must not land on blocks given back in this step (_copy_dst), which vLLM
            # counts free: with fewer than k others (less the evictable hits touched before the
            # copies) the request waits a step; else vLLM's check of n + k stands as it is
            pool, gb = self.block_pool, self._given_back_now
            others = (pool.get_num_free_blocks()
                      - sum(pool.blocks[i].ref_cnt == 0 for i in gb)
                      - sum(b.ref_cnt == 0 and not b.is_null and b.block_id not in gb
                            for b in new_computed_blocks))
            if others < k:
                return self.block_pool.num_gpu_blocks + 1
        return n + k

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks,
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        super().add_local_computed_blocks(request_id, new_computed_blocks,
                                          num_local_computed_tokens, num_external_computed_tokens)
        blocks = self.req_to_blocks[request_id]
        if self._shared is not None:
            for i, blk in enumerate(new_computed_blocks):
                self._shared.guard.hit(request_id, len(blocks) - len(new_computed_blocks) + i, blk)
        tail = self._partial_hit_reqs.get(request_id, (None,))[0]
        todo = [(i, blocks[i]) for i in self._floor_hits(request_id, blocks, tail)]
        if todo:
            self._floor_cow[request_id] = todo

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        """The floor's hit blocks are replaced by fresh copies first (reserved by
        get_num_blocks_to_allocate), as vLLM's partial-hit path does; they stay below
        ``num_cached_block``, so ``cache_blocks`` never re-hashes them: the cache keeps the
        source. Both endpoints stay retained until the scheduler queued the copy
        (``Scheduler._free_cow_retained_blocks``)."""
        cow_blocks = []
        for i, src in self._floor_cow.pop(request_id, ()):
            cow = self._copy_dst()
            assert cow is not None, "reserved by get_num_blocks_to_allocate"
            self._apply_cow(request_id, i, src, cow)
            if self._record_new_block_ids:
                self.new_block_ids.append(cow.block_id)
            cow_blocks.append(cow)
        return cow_blocks + super().allocate_new_blocks(request_id, num_tokens,
                                                        num_tokens_main_model)

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None):
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens, retention_interval=retention_interval)
        after = self.num_cached_block.get(rid, 0)
        # (called once per scheduled request and step, caching on): the worker's start this step
        self._scheduled[rid] = (getattr(request, "num_computed_tokens", 0),
                                request.num_prompt_tokens)
        for i, b in enumerate(self.req_to_blocks[rid][before:after], before):
            if b.block_hash is None:
                continue
            if rid in self._donated and i < self.hs_cfg.num_slots and self.donate:
                # hashed after its slots were first overwritten (a hash known a step late):
                # its bytes may be another page's already
                self.block_pool.evict_blocks({b.block_id})
                self.donation["dropped"] += 1
                continue
            self._cached_this_step.add(b.block_hash)
            if self._shared is not None:
                self._shared.guard.computed(rid, i, b)
                if i < self.hs_cfg.num_slots and rid not in self._shared.never_sparse:
                    self._slot_owner[b.block_id] = rid

    def new_step_starts(self) -> None:
        super().new_step_starts()
        self._cached_this_step.clear()
        self._given_back_now.clear()

    # ---- donation of hashed hot slots (docs/design/prefix-caching.md, step 2a) -----------------
    def _slots_written(self, request_id: str, start: int, prompt: int) -> bool:
        """Whether the worker may overwrite the request's hot slots in this step (at start
        tokens): it has pages given back, by the worker's own rule (its keep: 0 without
        resident_first, the manager's last spill with it; a host-less request keeps all)."""
        if self._shared is not None and request_id in self._shared.hostless:
            return False
        keep = self._keep.get(request_id) if self._ledger is not None else 0
        lo, hi = freed_pages(self.hs_cfg, start, prompt, keep)
        return hi > lo

    def _copy_dst(self):
        """A free block for a copy queued in this step (None: none): never one given back in this
        step, which the worker's plan still reads after vLLM's copies ran (those popped on the
        way go back, uncached: a lost hit)."""
        pool, skipped, dst = self.block_pool, [], None
        while pool.get_num_free_blocks() > 0:
            blk = pool.get_new_blocks(1)[0]
            if blk.block_id not in self._given_back_now:
                dst = blk
                break
            skipped.append(blk)
        if skipped:
            pool.free_blocks(skipped)
        return dst

    def _donate(self, request_id: str) -> None:
        """Move the cache entries of the request's hashed blocks [0, S) to fresh blocks, filled by
        copies that run before this step's forward (both endpoints retained until the scheduler
        queued them: ``Scheduler._free_cow_retained_blocks`` frees them, so the copy ends up a
        free, cached block), or drop the entries when no block is free."""
        self._donated.add(request_id)
        if not self.donate:
            return
        for blk in self.req_to_blocks.get(request_id, ())[:self.hs_cfg.num_slots]:
            if blk.is_null or blk.block_hash is None:
                continue
            dst = self._copy_dst()
            if dst is None:
                self.block_pool.evict_blocks({blk.block_id})
                self.donation["dropped"] += 1
                continue
            self.block_pool.move_block_hashes(blk, dst)
            if self._shared is not None:
                self._shared.guard.moved(blk, dst)
            blk.ref_cnt += 1
            self._pending_cow_copies.append((blk, dst))
            self.donation["donated"] += 1

    def take_pending_cow_copies(self):
        """Once per step, after every allocation and lookup (KVCacheManager.take_kv_cache_block_
        copies): the requests whose slots this step's forward may overwrite first donate theirs,
        so no hit, in this step or later, reads an overwritten slot."""
        if self.hs_cfg.host_tier:
            for rid, (start, prompt) in self._scheduled.items():
                if rid not in self._donated and rid in self.req_to_blocks and \
                        self._slots_written(rid, start, prompt):
                    self._donate(rid)
        self._scheduled.clear()
        return super().take_pending_cow_copies()

    def pop_blocks_for_free(self, request_id: str):         # free() and vLLM's batched frees
        # A preempted request gives every block back and restarts resident, here and on the
        # worker (SparseRuntime.add on its resumption); a spill recorded for it this step is void.
        self._floor_cow.pop(request_id, None)
        self._scheduled.pop(request_id, None)
        for b in self.req_to_blocks.get(request_id, ())[:self.hs_cfg.num_slots]:
            if self._slot_owner.get(b.block_id) == request_id:
                del self._slot_owner[b.block_id]
        self._donated.discard(request_id)
        if self._shared is not None:
            self._shared.guard.drop(request_id)
        self._seen.pop(request_id, None)
        self._keep.pop(request_id, None)
        if self._ledger is not None:
            self._ledger.spilled.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)
