"""SparseRuntime: the worker-side HiSparse engine of one model (plain torch, no vLLM).

It owns the host KV pool (the authoritative copy of every sparse request but host-less ones:
core/hostless.py), the indexer (``cfg.indexer``'s selection state, core/indexers) and the per-layer
hot-slot state, keyed by *runtime rows* (one per live request). The adapter tells it about requests
(``add`` / ``finish``), builds one ``StepPlan`` per step (``plan``: all host work) and calls
``forward_layer`` for every attention layer. A step's one-token rows form its decode batch
(core/decode_batch.py; layers: core/decode_body.py); a uniform decode step is planned by
``plan_full`` for vLLM's FULL CUDA graph of its padded size (core/steady_step.py) and its layers
run ``full_layer``. ``cfg.trace_dir``: decode selections traced (core/decode_trace.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import decode_body, dense_groups, indexers, prefill, spec_rows
from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.core.decode_batch import DecodeBatch, fill, row_counts
from vllm_hisparse.core.decode_trace import DecodeTrace
from vllm_hisparse.core.deployment import Deployment, EngineLimits, resolve
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.hot_rows import HotRows
from vllm_hisparse.core.page_table import DevicePageTable
from vllm_hisparse.core import give_back, runtime_stats, step_requests
from vllm_hisparse.core.hostless import runs_dense
from vllm_hisparse.core.residency import is_sparse_request
from vllm_hisparse.core.staging import HostToDevice
from vllm_hisparse.core.steady_step import SteadyStep
from vllm_hisparse.core.step_plan import ReqStep, StepPlan
from vllm_hisparse.core.write_behind import WriteBehind


@dataclass
class Req:
    row: int
    num_prompt: int
    sparse: bool              # sparse now (from add for a long prompt, else from its switch on)
    irow: int = -1            # indexer row (sparse requests only)
    keep: int | None = 0      # newest complete pages kept beyond the floor (residency.freed_pages)
    start: int = 0            # tokens before its last planned step (the stats' residency)
    hostless: bool = False    # no host copy (admitted so): every page on the GPU (core/hostless.py)
    moving: bool = False      # host-less until now, sparse: its next step copies its KV to the host
    fresh: bool = True        # added, not planned since: a first step with start > 0 is a prefix hit
    shared_upto: int = 0      # its host pages [0, shared_upto) are shared, complete: never written


class SparseRuntime:
    def __init__(self, cfg: HiSparseConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, max_rows: int, max_model_len: int,
                 host_pages: int | None = None, indexer_state=None,
                 dense_pool: HostKVPool | None = None, trace_writer=None,
                 deployment: Deployment | None = None):
        """max_rows: requests at once; the indexer's state and hot-slot state have one more row,
        the scratch row that padding rows of a decode batch point at (core/decode_batch.py).
        indexer_state, dense_pool: the indexer's ``allocate_state`` for cfg.quest_rows (default
        max_rows) rows, the GPU pool of the dense layers of sparse requests (cfg.dense_pool_gib >
        0), allocated by the caller (the vLLM adapter: before memory profiling); default: here.
        trace_writer: with cfg.trace_dir, the trace writer's factory ``(trace_dir, meta=dict) ->
        writer`` (sim.recorder_hook.TraceWriter; the adapter passes it, so core imports no sim).
        deployment: the sizes (core/deployment.py: indexer rows, S, K, the dense pool); default:
        resolved from the arguments, with the same function."""
        cfg.check_layers(num_layers)
        dep = deployment or resolve(cfg, EngineLimits(num_layers, max_model_len, max_rows,
                                                      num_kv_heads, head_dim, dtype.itemsize))
        self.cfg = cfg
        self.max_rows, self.scratch_row = max_rows, max_rows
        self.dtype, self.num_kv_heads, self.head_dim = dtype, num_kv_heads, head_dim
        self.P = cfg.page_size
        self.S = dep.num_slots
        self.k_sel = max(dep.top_k_units - 1, 0)       # the newest page takes one unit of top_k
        self.U = -(-max_model_len // self.P)
        self.device = torch.device(device)
        self.h2d = HostToDevice(self.device)     # per-step metadata, without waiting for the GPU
        self.write_behind = WriteBehind(self.device)     # prefill write-through on a side stream
        self.num_layers = num_layers
        self.dense_layers = set(cfg.dense_layers)
        host_layers = dep.host_layers
        self._host_layer = {layer: i for i, layer in enumerate(host_layers)}
        if host_pages is None:
            host_pages = cfg.host_pool_pages(num_layers, dep.page_bytes)
        self.pool = (HostKVPool(len(host_layers), host_pages, self.P, num_kv_heads, head_dim, dtype)
                     if cfg.host_tier else None)
        # The indexer: one row per sparse request admitted at once (none when no request can
        # turn sparse) + a scratch row that decode-graph padding points at.
        self.ix = indexers.get(cfg.indexer)(cfg, num_layers, dep.indexer_rows, max_model_len,
                                            num_kv_heads, head_dim, dtype, self.device,
                                            state=indexer_state)
        # no request can ever be sparse (core/gpu_pools.py): no hot slots, as in resident mode
        self.sparse_possible = dep.sparse_possible
        self.spec_tokens = dep.limits.spec_tokens   # vLLM's num_speculative_tokens (spec_rows.py)
        self.hot = HotRows(num_layers, [i for i in range(num_layers) if i not in self.dense_layers]
                           if cfg.host_tier and self.sparse_possible else [],
                           max_rows + 1, self.S, self.U, cfg.policy, self.device)
        self.given_back = give_back.GiveBack()
        self.steady = SteadyStep()               # plans of steady decode steps
        self.host_pt = DevicePageTable(max_rows, self.U, self.device, self.h2d)  # host page of each
        # Dense layers of sparse requests: every page in a GPU pool of their own (cfg.dense_pool_gib),
        # attended with the pool's page table; without it they read given-back pages from the host.
        self.dpool = None
        if cfg.uses_dense_pool:
            nd = len(self.dense_layers)
            self.dpool = dense_pool or HostKVPool(nd, dep.dense_pool_pages, self.P, num_kv_heads,
                                                  head_dim, dtype, device=self.device)
            self._dpool_layer = {layer: i for i, layer in enumerate(sorted(self.dense_layers))}
            self.dense_pt = DevicePageTable(max_rows, self.U, self.device, self.h2d)
        # Paged causal attention for prefill / dense rows: paged_dense_reference's signature. The
        # vLLM adapter plugs FlashAttention in on the GPU; the default is the plain-torch twin.
        self.dense_fn = sl.paged_dense_reference
        self.reqs: dict[str, Req] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.trace = (DecodeTrace(trace_writer, cfg, self.ix, num_layers, self.dense_layers,
                                  num_kv_heads, head_dim) if cfg.trace_dir else None)
        self._hit_miss = torch.zeros(3, dtype=torch.int64, device=self.device)  # see hit_miss
        self.split_dense = dense_groups.split_enabled(cfg, self.device, head_dim)
        self._batches: dict[int, DecodeBatch] = {}         # decode batches by size (fixed buffers)
        self._kv: list[torch.Tensor | None] = [None] * num_layers    # bind_kv_caches
        self.stats = {"steps": 0, "decode_rows": 0, "dense_decode_rows": 0, "finished": 0,
                      "dense_pool_pages_handed": 0, "full_steps": 0, "turned_sparse": 0,
                      "resident_rows": 0, "spills": 0, "shrinks": 0, "partial_rows": 0,
                      "steady_steps": 0, "spec_rows": 0, "prefix_hits": 0}
        self._host_s = dict.fromkeys(("plan", "dense_layers", "sparse_layers", "full_layers"), 0.0)

    # ---- request lifecycle ---------------------------------------------------------------------
    def add(self, req_id: str, num_prompt: int, hostless: bool = False) -> None:
        """A request was scheduled (new, or resumed after preemption: from token 0, resident
        again under resident_first as in the KV manager); hostless: no host copy (core/hostless)."""
        keep = None if self.cfg.resident_first or hostless else 0
        if req_id not in self.reqs:
            if not self._free_rows:
                raise RuntimeError(f"hisparse runtime: no free row for {req_id} (max_num_seqs rows)")
            r = Req(self._free_rows.pop(), num_prompt, False, keep=keep, hostless=hostless)
            if not runs_dense(self.cfg, r) and is_sparse_request(self.cfg, num_prompt):
                try:
                    self.make_sparse(req_id, r, num_prompt)
                except RuntimeError:
                    self._free_rows.append(r.row)
                    raise
            self.reqs[req_id] = r
        r = self.reqs[req_id]
        r.keep, r.start, r.fresh = keep, 0, True
        self.hot.reset(r.row)
        self.steady.forget()          # a resumed id's steady plan is stale
        if self.trace is not None:
            self.trace.restart(req_id)

    def assign_host(self, req_id: str, pages: list[int], shared_upto: int) -> None:
        """The scheduler's host pages of the request's whole life (core/host_pages.py), the first
        ``shared_upto`` shared with others: complete, never written (the switch skips them)."""
        r = self.reqs[req_id]
        self.pool.assign(req_id, pages)
        self.host_pt.clear(r.row)            # re-mirrored at its next step (a resumption swaps)
        r.shared_upto = shared_upto

    def make_sparse(self, req_id: str, r: Req, context: int) -> None:
        """The request is sparse from now on (core/residency.py): its indexer row and fresh
        hot-slot state. A request stays sparse once it is (also when recomputed after a preemption)."""
        irow = self.ix.allocate()    # the connector admits at most quest_rows that may be sparse
        if irow < 0:
            raise RuntimeError(
                f"hisparse runtime: no free indexer row for {req_id}, sparse at {context} tokens "
                f"(quest_rows={self.ix.rows}); the connector reserves one at admission for "
                f"every request whose prompt + max_tokens (+ draft tokens) reaches min_context")
        r.irow = irow
        r.sparse = True
        self.hot.reset(r.row)

    def spill(self, req_id: str, keep: int = 0) -> None:
        """resident_first: from this step on the request holds, beyond its floor, only its ``keep``
        newest complete pages (0: the floor); keep only shrinks. Older pages resolve through the
        hot slots, holding pages [0, S) at the row's first step with a page given back (HotRows)."""
        r = self.reqs[req_id]
        if r.keep is not None and keep >= r.keep:
            return
        if r.keep is None:
            self.stats["spills"] += 1
        self.stats["shrinks"] += 1
        self.given_back.spill(req_id, r.keep)
        r.keep = keep
        self.steady.forget()

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """The paged KV cache of every layer (layer i: (blocks, 2, P, Hkv, D)), which a request
        turning sparse copies from (core/turn_sparse.py; the KV connector's register_kv_caches)."""
        if len(caches) != self.num_layers:
            raise ValueError(f"bind_kv_caches: {len(caches)} caches for {self.num_layers} layers")
        self._kv = list(caches)

    def kv_cache(self, layer: int) -> torch.Tensor:
        kv = self._kv[layer]
        if kv is None:
            raise RuntimeError(f"hisparse runtime: no KV cache bound for layer {layer} (a request "
                               f"turning sparse copies from it); call SparseRuntime.bind_kv_caches")
        return kv

    def finish(self, req_id: str) -> bool:
        """Return the request's host pages and row; False if it was unknown."""
        r = self.reqs.pop(req_id, None)
        if r is None:
            return False
        if self.pool is not None:
            self.pool.free(req_id)
        if self.trace is not None:
            self.trace.finish(req_id)
        self._free_rows.append(r.row)
        self.ix.free(r.irow)
        self.host_pt.clear(r.row)
        if self.dpool is not None:
            self.dpool.free(req_id)
            self.dense_pt.clear(r.row)
        self.stats["finished"] += 1
        return True

    def dense_pool_layer(self, layer: int) -> torch.Tensor | None:
        """The GPU dense pool's pages of a dense layer (None: no dense pool, or a sparse layer)."""
        if self.dpool is None or layer not in self.dense_layers:
            return None
        return self.dpool.data[self._dpool_layer[layer]]

    def host_layer(self, layer: int) -> torch.Tensor | None:
        """The host pool's copy of one layer (None: no host tier, or a dense layer kept in the
        dense pool)."""
        i = self._host_layer.get(layer)
        return None if self.pool is None or i is None else self.pool.data[i]

    @property
    def hit_miss(self) -> torch.Tensor:
        """(3,) int64 on the device: RESOLVE's hits, misses and pages taken through the block table
        so far (vllm/metrics.py reads it without waiting for the GPU)."""
        return self._hit_miss

    @property
    def host_pages_used(self) -> int:
        return self.pool.used_pages if self.pool is not None else 0

    # ---- plan once per step ----------------------------------------------------------------------
    def plan(self, req_ids: list[str], query_start_loc: list[int], seq_lens: list[int],
             block_table: torch.Tensor, slot_mapping: torch.Tensor) -> StepPlan:
        t0 = time.perf_counter()
        try:
            return self._plan(req_ids, query_start_loc, seq_lens, block_table, slot_mapping)
        finally:
            self._host_s["plan"] += time.perf_counter() - t0

    def _plan(self, req_ids: list[str], query_start_loc: list[int], seq_lens: list[int],
              block_table: torch.Tensor, slot_mapping: torch.Tensor) -> StepPlan:
        """req_ids: the B requests in row order; query_start_loc: B+1 token offsets; seq_lens: B
        lengths with this step's tokens; block_table (B, W); slot_mapping (T,). All host work is
        here, once per step (forward_layer syncs nothing); one-token rows form the decode batch."""
        self.write_behind.join()             # the last steps' host writes before this step's work
        self.steady.forget()
        steps, pages = step_requests.req_steps(self, req_ids, query_start_loc, seq_lens,
                                                   block_table)
        dec = [s for s in steps if s.t1 - s.t0 == 1]
        plan = prefill.plan(self, [s for s in steps if s.t1 - s.t0 > 1], block_table,
                            slot_mapping)
        plan.spec = spec_rows.plan(self, steps, plan, block_table)   # speculative verify rows
        if dec:
            plan.db = self._fill_batch(dec, pages, len(dec))
            plan.db_bt = prefill.rows_of(self, dec, block_table)
            if any(s.t0 != i for i, s in enumerate(dec)):
                plan.db_tok = self.h2d([s.t0 for s in dec], torch.int64)
        self.stats["steps"] += 1
        return plan

    def plan_full(self, req_ids: list[str], seq_lens: list[int], N: int,
                  block_table: torch.Tensor | None = None) -> None:
        """A step of one-token rows (vLLM's FULL graphs): req_ids and seq_lens of its n real rows
        (0..n-1, padding after them), N >= n its padded size; block_table (>= n, W) int32 on the
        device, read only when a request turns sparse. Fills decode batch N for full_layer."""
        t0 = time.perf_counter()
        self.write_behind.join()
        db = self._batch(N)
        if not self.steady.advance(self, req_ids, seq_lens, db):
            steps, pages = step_requests.req_steps(self, req_ids, list(range(len(req_ids) + 1)),
                                                   seq_lens, block_table)
            self._fill_batch(steps, pages, N)
            self.steady.remember(self, db, req_ids, seq_lens, steps)
        self.stats["steps"] += 1
        self.stats["full_steps"] += 1
        self._host_s["plan"] += time.perf_counter() - t0

    def full_layer(self, layer: int, N: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv: torch.Tensor, block_table: torch.Tensor, scale: float,
                   out: torch.Tensor) -> None:
        """One layer of a plan_full step (q/out (N, Hq, D), k/v (N, Hkv, D), block_table (N, W)
        int32: row i = decode-batch row i): recorded by vLLM's FULL graph capture and replayed, or
        run eagerly when vLLM replays no graph for the step."""
        why = q.is_cuda and torch.cuda.is_current_stream_capturing() and self.cfg.full_graphs_blocker()
        if why:
            raise RuntimeError(f"full_layer: a CUDA graph cannot record this config's decode: {why}")
        t0 = time.perf_counter()
        self._body(layer)(self, layer, self._batch(N), q, k, v, kv, block_table, scale, out)
        self._host_s["full_layers"] += time.perf_counter() - t0

    def end_step(self) -> None:
        """The step's forward is queued: the compute stream waits for its write-behind (the
        adapter's wait_for_save). vLLM may zero or copy blocks it freed (and the host may read
        the pool) before the next step's plan, so the side stream is not left reading them."""
        self.write_behind.join()

    def _body(self, layer: int):                  # the decode body of a layer
        return decode_body.dense_layer if layer in self.dense_layers else decode_body.sparse_layer

    def _fill_batch(self, dec: list[ReqStep], pages: dict, N: int) -> DecodeBatch:
        """Decode batch N holding the one-token rows ``dec`` (the rest padding); trace, stats."""
        db = self._batch(N)
        fill(self, db, dec, pages)
        self.given_back.decoded(db, dec)
        if self.trace is not None:
            self.trace.number_steps(db)
        for k, v in row_counts(dec, self.P).items():
            self.stats[k] += v
        return db

    def _batch(self, N: int) -> DecodeBatch:
        db = self._batches.get(N)
        if db is None:
            db = self._batches[N] = DecodeBatch(N, self.device, (self.num_layers, self.k_sel))
        return db

    # ---- per layer -----------------------------------------------------------------------------
    def forward_layer(self, layer: int, plan: StepPlan, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """See _forward_layer; its host time is counted (host_ms_* in stats_dict)."""
        t0 = time.perf_counter()
        try:
            self._forward_layer(layer, plan, q, k, v, kv, scale, out)
        finally:
            key = "dense_layers" if layer in self.dense_layers else "sparse_layers"
            self._host_s[key] += time.perf_counter() - t0

    def _forward_layer(self, layer: int, plan: StepPlan, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """q (T, Hq, D), k/v (T, Hkv, D) of this step's tokens; kv (N, 2, P, Hkv, D) this layer's
        paged cache; out (T, Hq, D) is written. No host sync on the GPU path."""
        if plan.dense:              # prefill chunks, and the verify rows of core/spec_rows.py
            spec_rows.multi_layer(self, layer, plan, q, k, v, kv, scale, out)
        db = plan.db
        if db is None:
            return
        n, tok = db.n, plan.db_tok
        body = self._body(layer)
        if tok is None and out.dtype == q.dtype:        # the decode rows are the first tokens
            body(self, layer, db, q[:n], k[:n], v[:n], kv, plan.db_bt, scale, out[:n])
            return
        o = torch.empty_like(q[:n]) if tok is None else torch.empty_like(q[tok])
        qd, kd, vd = (q[:n], k[:n], v[:n]) if tok is None else (q[tok], k[tok], v[tok])
        body(self, layer, db, qd, kd, vd, kv, plan.db_bt, scale, o)
        if tok is None:
            out[:n] = o.to(out.dtype)
        else:
            out[tok] = o.to(out.dtype)

    # ---- reporting -----------------------------------------------------------------------------
    def stats_dict(self) -> dict:
        return runtime_stats.stats_dict(self)

    def dump_stats(self, path: str | None) -> None:
        runtime_stats.dump(self, path)
