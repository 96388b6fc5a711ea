"""The scheduler half of the GQA path's KV connector (vllm/connector.py forwards to it): the host
KV pool's request lifecycle, in the scheduler process (engine core).

  * admission: a request that may be sparse at some step of its life (core/residency.py: its
    prompt + max_tokens reaches min_context, so a short prompt that may generate past it too)
    reserves an indexer row (core/indexers) and the host pages of its whole life (prompt +
    max_tokens) before it is scheduled; when the host (or dense) pool cannot hold it, it runs
    *host-less* (config ``hostless``, default "sparse") if vLLM's GPU blocks hold its whole life
    beside the host-less requests admitted before and every host-backed one at its floor
    (core/residency.py ``hostless_fits``) and an indexer row is free: it takes the row and no
    host page, is sparse as in resident mode (its pages read from its GPU blocks) and never
    spilled (the KV manager reads ``SpillLedger.hostless``); "dense" (opt-in) admits it without
    a row, dense like a request that never could be sparse, also when the rows are full; else it
    *waits* (``None`` from ``get_num_new_matched_tokens``) until finished requests give them
    back; when room frees up, a host-less request still decoding moves into the host tier
    (``_move_to_host``);
  * ``build_connector_meta`` ships each newly scheduled (or resumed) request's prompt length and
    first GPU block to the worker (and which of them run host-less), and (resident_first) the
    requests the KV manager took blocks from in this step with their new ``keep`` (vllm/spec.py
    ``SpillLedger``), which the worker applies before the step's forward;
  * finish: a request holding host pages or an indexer row frees its GPU blocks only after the
    worker has dropped it (delayed free, ``request_finished`` -> True, the worker reports it
    through ``get_finished``), so no new request is admitted onto what the worker still holds (a
    "sparse" host-less one holds a row); a request that never could be sparse, or runs host-less
    with "dense", holds nothing of the kind and frees them at once, as in stock vLLM (-> False;
    the worker drops it unreported: vLLM asserts that every id it reports is still a live
    request).
Every method runs in the scheduler process.
"""
from __future__ import annotations

from typing import Any

from vllm_hisparse.core.deployment import Deployment
from vllm_hisparse.core.capacity import hisparse_blocks
from vllm_hisparse.core.host_pages import HostPageTable
from vllm_hisparse.core.residency import hostless_fits, may_turn_sparse

from . import metrics
from .compat import init_logger
from .connector_metadata import HiSparseConnectorMetadata
from .host_page_admission import HostPageAdmission
from .spill_ledger import ledger_of

logger = init_logger(__name__)


def check_prefill_fits(cfg, max_model_len: int, num_gpu_blocks: int) -> int:
    """The startup check of ``bind_gpu_block_pool``: one max_model_len prompt holds all its blocks
    during its own prefill, so they must fit the GPU KV cache's blocks. Returns the usable blocks
    (vLLM's null block excluded)."""
    need = -(-max_model_len // cfg.page_size) + 1
    have = num_gpu_blocks - 1                                    # block 0 is vLLM's null block
    if have < need:
        raise ValueError(
            f"hisparse: the GPU KV cache holds {have} blocks of {cfg.page_size} tokens, but "
            f"a max_model_len={max_model_len} prompt needs {need} during its own prefill; "
            f"lower --max-model-len or raise --gpu-memory-utilization")
    return have


class ConnectorScheduler(HostPageAdmission):
    def __init__(self, vllm_config, dep: Deployment):
        self._vllm_config = vllm_config
        # every size from the engine's one deployment (core/deployment.py), as the worker's pools
        self.dep = dep
        self.cfg = dep.cfg
        # pages of each rank's host pool (0 where no request can be sparse); admission counts
        # admit_pages: a sparse request takes as many pages in the host pool as in the dense pool
        self.capacity = dep.host_pages
        self.admit_pages = dep.admit_pages
        self._bound = dep.admit_bound
        self._pool_reason = "host_pool" if self._bound == "host" else "dense_pool"
        self.max_model_len = dep.limits.max_model_len
        self.max_num_seqs = dep.limits.max_num_seqs
        # indexer rows on the worker: one per long request admitted at once
        self.indexer_rows = dep.indexer_rows
        self._rows_held: set[str] = set()
        self._reserved: dict[str, int] = {}
        self._reserved_total = 0
        self._prompt: dict[str, int] = {}
        self._sent: set[str] = set()
        self._finishing: list[str] = []        # finished, blocks freed once the worker reports
        self._freed: list[str] = []            # finished, blocks freed at once (never sparse)
        self._waiting_logged: set[str] = set()
        self._waiting: dict[str, str] = {}     # req -> what it waits for (metrics.WAIT_REASONS)
        self._sched_report: dict | None = None
        self._ledger = None                    # resident_first: the KV manager's spills
        self._shared = None                    # the pool's ledger: its ``hostless`` set
        self._gpu_blocks = 0                   # usable GPU blocks (0: not bound, none host-less)
        self._hostless: dict[str, int] = {}    # host-less req -> GPU blocks of its whole life
        self._moved = 0                        # host-less requests moved into the host tier
        self._watermark_blocks = 0
        # host page ids, shared by block hash (docs/design/prefix-caching.md section 3.3): each
        # host-backed request's list, its shared prefix, the pages it has published so far
        self.host_pages = HostPageTable(self.capacity if self.cfg.host_tier else 0)
        self._pages: dict[str, list[int]] = {}
        self._shared_upto: dict[str, int] = {}
        self._published: dict[str, int] = {}
        self._requests: dict[str, Any] = {}    # vLLM's Request (block_hashes, num_computed_tokens)
        self._hit: dict[str, int] = {}         # prefix-cache hit tokens at admission
        # speculative decoding's draft tokens: a step may compute up to this many beyond the
        # request's max_tokens (vLLM bounds them by max_model_len only)
        self._spec_tokens = dep.limits.spec_tokens
        self._log_room()

    def _log_room(self) -> None:
        """One startup line: how many requests of max_model_len tokens admission lets run at once
        (``Deployment.room_line``, which ``hisparse calc`` prints too; bench/serving.py reads it
        for --concurrency cap)."""
        note = self.dep.idle_rows_note()
        if note:
            logger.warning(note)
        logger.info("%s", self.dep.room_line())

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        """Startup check: a prompt is fully resident during its own prefill, so one max_model_len
        prompt must fit in the GPU blocks (else it would wait forever); vLLM's own check only sees
        the bounded steady-state footprint of HiSparseSpec. resident_first: the reserve R of free
        blocks the KV manager keeps by spilling (docs/vllm-integration.md, "Residency states")."""
        if not self.cfg.host_tier:
            return
        have = check_prefill_fits(self.cfg, self.max_model_len, gpu_block_pool.num_gpu_blocks)
        self._shared = ledger_of(gpu_block_pool)
        self._watermark_blocks = int(self._vllm_config.scheduler_config.watermark
                                     * gpu_block_pool.num_gpu_blocks)
        if self.cfg.resident_first:
            self._ledger = self._shared
            self._ledger.reserve = self.spill_reserve()
        self._gpu_blocks = have
        if self.dep.sparse_possible and self.cfg.hostless != "wait":
            logger.info("hisparse: two tiers: host pool %d pages (%s) for host-backed requests; "
                        "beyond them, requests run host-less (requests_hostless: %s, never "
                        "spilled) while the GPU's %d blocks hold their whole lives",
                        self.admit_pages, self._bound, self._hostless_kind(), have)

    def spill_reserve(self) -> int:
        """R, kept free at every KV-manager call: every block one step's allocations of running
        requests can take (its batched tokens plus a partial block per request) and vLLM's
        watermark. A waiting request's own blocks are made free when it is admitted
        (``admission_blocks``, from get_num_new_matched_tokens, before vLLM checks them)."""
        sc, page = self._vllm_config.scheduler_config, self.cfg.page_size
        return (-(-sc.max_num_batched_tokens // page) + sc.max_num_seqs
                + self._watermark_blocks)

    def admission_blocks(self, request, hit_tokens: int = 0) -> int:
        """Free blocks a waiting request (new, or preempted: prompt and output so far) needs when
        vLLM allocates it: its whole sequence (scheduler_reserve_full_isl, vLLM's default, checks
        it fits before anything is allocated; else its first chunk; the hit's blocks counted as
        if all were evictable), vLLM's watermark, one block of slack (the copy of a partial
        prefix-cache hit) and the fresh blocks the floor copy-on-write takes for a hit of
        ``hit_tokens`` (vllm/spec.py ``floor_copies``: up to S, block 0 alone for a request that
        never turns sparse)."""
        sc, page = self._vllm_config.scheduler_config, self.cfg.page_size
        n = min(request.num_tokens, self.max_model_len)
        if not getattr(sc, "scheduler_reserve_full_isl", True):
            n = min(n, sc.max_num_batched_tokens)
        copies = (self._ledger.floor_copies(request, hit_tokens // page)
                  if hit_tokens >= page and self._ledger is not None else 0)
        return -(-n // page) + self._watermark_blocks + 1 + copies

    def _make_room(self, request, hit_tokens: int = 0) -> None:
        """resident_first: the KV manager spills until this admitted request's blocks are free,
        before vLLM's checks in this same step (running requests were scheduled already)."""
        if self._ledger is not None:
            self._ledger.make_room(self.admission_blocks(request, hit_tokens))

    def _max_tokens(self, request) -> int:
        """The tokens the request may generate: its max_tokens (unset: max_model_len), within
        max_model_len (its context never exceeds it)."""
        max_tokens = getattr(request, "max_tokens", None) or self.max_model_len
        return min(max_tokens, self.max_model_len - request.num_prompt_tokens)

    def _most_tokens(self, request) -> int:
        """Tokens past the prompt its context may reach: max_tokens plus speculative decoding's
        draft tokens (a step computes them, and vLLM bounds them by max_model_len only), within
        max_model_len."""
        return min(self._max_tokens(request) + self._spec_tokens,
                   self.max_model_len - request.num_prompt_tokens)

    def _may_be_sparse(self, request) -> bool:
        """Sparse at some step of its life: a long prompt, or a short one whose prompt +
        max_tokens (+ draft tokens) reaches min_context (it turns sparse when its context does;
        with max_model_len < min_context none does)."""
        return may_turn_sparse(self.cfg, request.num_prompt_tokens, self._most_tokens(request))

    def _never_sparse(self, request) -> bool:
        """Provably dense for its whole life (not ``_may_be_sparse``). The KV manager then shares
        a prefix-cache hit's blocks but block 0 (vllm/spec.py ``_floor_hits``): nothing writes its
        hot slots."""
        return not self._may_be_sparse(request)

    def _pages_needed(self, request) -> int:
        if not self.cfg.host_tier or not self._may_be_sparse(request):
            return 0
        return self._life_blocks(request)        # a host page for each GPU block of its life

    def _life_blocks(self, request) -> int:
        """GPU blocks of the request's whole life (prompt + max_tokens + draft tokens, within
        max_model_len: a step's drafts may reach a page past max_tokens, whose host page the
        worker then needs)."""
        n = request.num_prompt_tokens + self._most_tokens(request)
        return -(-n // self.cfg.page_size)

    def _hostless_kind(self) -> str:
        return ("dense, resident" if self.cfg.hostless == "dense" else
                "sparse as resident mode, its pages in its GPU blocks")

    def _hostless_fits(self, request, rows_full: bool) -> bool:
        """A request the host pool (or, ``rows_full``, the indexer rows) cannot take may run
        host-less (core/residency.py ``hostless_fits``): "sparse" (the default) takes a row, so
        not when the rows are full; "dense" takes none; "wait" never; never before the GPU block
        pool is bound. The host-backed requests (rows not held by a host-less one) count at
        their floor, capacity.hisparse_blocks."""
        mode = self.cfg.hostless
        if mode == "wait" or (mode == "sparse" and rows_full) or not self._gpu_blocks:
            return False
        P = self.cfg.page_size
        floor = hisparse_blocks(self.max_model_len, P,
                                -(-self.dep.num_slots * self.dep.unit_tokens // P))
        backed = len(self._rows_held - self._hostless.keys())
        return hostless_fits(self._gpu_blocks, self.spill_reserve(), sum(self._hostless.values()),
                             backed, floor, self._life_blocks(request))

    def _wait_or_hostless(self, request, reason: str, why: str):
        """The host pool or the rows are full (``why``: which, for the log): the request runs
        host-less if the GPU holds it whole (0: admitted; "sparse": it takes an indexer row),
        else it waits (None)."""
        rid = request.request_id
        if self._hostless_fits(request, reason == "quest_rows"):
            self._hostless[rid] = self._life_blocks(request)
            if self.cfg.hostless == "sparse":
                self._rows_held.add(rid)
            self._shared.hostless.add(rid)
            self._waiting_logged.discard(rid)
            self._waiting.pop(rid, None)
            logger.info("hisparse: %s; request %s runs host-less (%s: %d GPU blocks, never "
                        "spilled; requests_hostless=%d)", why, rid, self._hostless_kind(),
                        self._hostless[rid], len(self._hostless))
            self._make_room(request, self._hit.get(rid, 0))
            return 0, False
        self._waiting[rid] = reason
        if rid not in self._waiting_logged:
            self._waiting_logged.add(rid)
            logger.warning("hisparse: %s, and it cannot run host-less (hostless=%s; %d "
                           "host-less requests); request %s waits", why, self.cfg.hostless,
                           len(self._hostless), rid)
        return None, False

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Admission (see the module docstring); num_computed_tokens: the prefix-cache hit, the
        request's first step's start if its allocation stands (else vLLM asks again)."""
        rid = request.request_id
        self._prompt[rid] = request.num_prompt_tokens
        self._requests[rid] = request
        if self._shared is not None:          # the KV manager's floor for it (before vLLM allocates)
            if self._never_sparse(request):
                self._shared.never_sparse.add(rid)
            else:
                self._shared.never_sparse.discard(rid)
        if rid in self._reserved or rid in self._hostless:   # resumed, or its allocation failed
            if not self._writable_from(rid, num_computed_tokens):
                self._waiting[rid] = self._pool_reason
                return None, False
            self._waiting.pop(rid, None)
            self._make_room(request, num_computed_tokens)
            return 0, False
        need = self._pages_needed(request)
        shared = self._shareable(request, num_computed_tokens) if need else []
        self._hit[rid] = num_computed_tokens      # (a host-less one shares when it moves)
        sparse = self._may_be_sparse(request)
        if sparse and len(self._rows_held) >= self.indexer_rows:
            return self._wait_or_hostless(
                request, "quest_rows",
                f"indexer rows full (quest_rows={self.indexer_rows} long requests at once)")
        if not self._host_fits(need, shared):
            return self._wait_or_hostless(
                request, self._pool_reason,
                f"{self._bound} pool full ({self._reserved_total} of {self.admit_pages} pages "
                f"reserved, {self.host_pages.used} in use, {self.host_pages.evictable} of them "
                f"cache-only; request needs {need}, {len(shared)} shared)")
        self._waiting_logged.discard(rid)
        self._waiting.pop(rid, None)
        if sparse:
            self._rows_held.add(rid)
        self._take_pages(rid, need, shared)
        self._make_room(request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output) -> HiSparseConnectorMetadata:
        md = HiSparseConnectorMetadata(finished=self._finishing, freed=self._freed)
        self._finishing, self._freed = [], []
        if self._ledger is not None:          # after every allocation of the step
            md.spilled = self._ledger.take()
        for r in scheduler_output.scheduled_new_reqs:
            md.new[r.req_id] = (self._prompt.get(r.req_id, len(r.prompt_token_ids or ())),
                                r.block_ids[0][0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                md.new[rid] = (self._prompt[rid], cached.new_block_ids[i][0][0])
        md.hostless = [rid for rid in md.new if rid in self._hostless]
        md.hosted = self._move_to_host(cached)
        for rid in list(md.new) + md.hosted:
            if rid in self._pages:
                md.pages[rid] = (list(self._pages[rid]), self._shared_upto[rid])
        self._publish(cached, md.hosted)
        self._sent.update(md.new)
        return md

    def _move_to_host(self, cached) -> list[str]:
        """Host-less requests decoding in this step (scheduler_output.scheduled_cached_reqs, not
        resumed) that the host pool (and, "dense", the rows) now have room for get their host
        pages (and a row): the worker copies their KV so far to the host at this step
        (core/hostless.py ``host_back``; "dense": they turn sparse then), and from the next
        KV-manager call on each is an ordinary host-backed request, spilled like the others.
        resident_first only (off, the manager would free its blocks at once, before the worker
        knows); none while a request waits for host room (it comes first). Returns their ids."""
        if not self._hostless or self._waiting or self._ledger is None:
            return []
        moved = []
        for i, rid in enumerate(cached.req_ids):
            if (rid not in self._hostless or rid in cached.resumed_req_ids
                    or cached.num_computed_tokens[i] < self._prompt.get(rid, 0)):
                continue
            pages = self._hostless[rid]          # a host page for each block of its life
            shared = self._shareable(self._requests[rid], self._hit.get(rid, 0))
            if ((rid not in self._rows_held and len(self._rows_held) >= self.indexer_rows)
                    or not self._host_fits(pages, shared)):
                continue
            del self._hostless[rid]
            self._shared.hostless.discard(rid)
            self._rows_held.add(rid)
            self._take_pages(rid, pages, shared)
            self._moved += 1
            moved.append(rid)
            logger.info("hisparse: request %s moves into the host tier (%d pages; "
                        "requests_hostless=%d, requests_moved_to_host=%d)", rid, pages,
                        len(self._hostless), self._moved)
        return moved

    def _release(self, rid: str) -> None:
        self._reserved_total -= self._reserved.pop(rid, 0)
        self.host_pages.release(self._pages.pop(rid, []))
        for d in (self._shared_upto, self._published, self._requests, self._hit):
            d.pop(rid, None)
        self._rows_held.discard(rid)
        if self._hostless.pop(rid, None) is not None:
            self._shared.hostless.discard(rid)
        if self._shared is not None:
            self._shared.never_sparse.discard(rid)
        self._prompt.pop(rid, None)
        self._sent.discard(rid)
        self._waiting_logged.discard(rid)
        self._waiting.pop(rid, None)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """True (delay the free) only for a request the worker knows that holds host pages or an
        indexer row: they are released once the worker has dropped it (``get_finished`` ->
        ``update_connector_output``). A request that never could be sparse, or runs host-less with
        "dense", holds on the worker only its runtime row and first-block binding, which the next
        step's metadata drops (``freed``) before it binds any new request: its blocks go back at
        once, as in stock vLLM."""
        rid = request.request_id
        if rid in self._sent:
            if self._reserved.get(rid, 0) or rid in self._rows_held:
                self._finishing.append(rid)
                return True, None
            self._freed.append(rid)
        self._release(rid)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_sending or ():
            self._release(rid)

    def stats(self):
        """The scheduler's part of vllm/metrics.py (vLLM asks every step): None when unchanged."""
        waiting = {f"waiting_{r}": 0 for r in metrics.WAIT_REASONS}
        for reason in self._waiting.values():
            waiting[f"waiting_{reason}"] += 1
        pages = self.capacity if self.cfg.host_tier else 0         # resident mode has no pool
        now = {"host_pages_reserved": self._reserved_total, "host_pages": pages,
               "requests_hostless": len(self._hostless), "requests_moved_to_host": self._moved,
               **metrics.table_gauges(self.host_pages), **waiting,
               **metrics.donation_gauges(self._shared)}
        if now == self._sched_report:
            return None
        self._sched_report = now
        return metrics.HiSparseStats(data={"sched": dict(now)})
