"""SparseRuntime: the worker-side HiSparse engine of one model (plain torch, no vLLM).

It owns the host KV pool (the authoritative copy of every sparse request), the Quest page bounds
and the per-layer hot-slot state, keyed by *runtime rows* (one per live request). The adapter
tells it about requests (``add`` / ``finish``), builds one ``StepPlan`` per step from the batch
(block table, sequence lengths, query ranges) and calls ``forward_layer`` for every attention
layer. Everything per step is decided in ``plan``; ``forward_layer`` only does the layer's work.

With ``cfg.trace_dir`` set, every sparse layer's Quest selection of every decode row is appended to
a per-request trace (``sim.recorder_hook.TraceWriter``, format ``sim/trace.py``, unit = one page,
rows = the sparse layers in order, each row the newest page then the selected complete pages, as
``sim/record.py`` writes Quest traces), written to ``<trace_dir>/<request id>.npz`` at ``finish``.
It copies the selection to the host once per layer: a measurement mode, not a serving mode.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import dense_groups
from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.page_table import DevicePageTable
from vllm_hisparse.core.residency import freed_pages, is_sparse_request
from vllm_hisparse.core.staging import HostToDevice
from vllm_hisparse.core.step_plan import DenseGroup, ReqStep, StepPlan
from vllm_hisparse.ops.write_through import write_through


@dataclass
class Req:
    row: int
    num_prompt: int
    sparse: bool
    qrow: int = -1            # Quest bounds row (sparse requests only)


class SparseRuntime:
    def __init__(self, cfg: HiSparseConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, max_rows: int, max_model_len: int,
                 host_pages: int | None = None, quest_meta: tuple[list, list] | None = None,
                 dense_pool: HostKVPool | None = None, num_heads: int | None = None):
        """max_rows: requests at once; the Quest bounds and hot-slot state have one more row, the
        scratch row that decode-graph padding points at (core/decode_graph.py).
        quest_meta: per-layer (kmin, kmax) tensors (max_rows + 1, U, Hkv, D), None for dense layers,
        allocated by the caller (the vLLM adapter does it before memory profiling); default: here.
        dense_pool: the GPU pool holding the dense layers of sparse requests when
        cfg.dense_pool_gib > 0 (the adapter allocates it before memory profiling); default: here."""
        cfg.check_layers(num_layers)
        self.cfg = cfg
        self.max_rows, self.scratch_row = max_rows, max_rows
        self.dtype, self.num_kv_heads, self.head_dim = dtype, num_kv_heads, head_dim
        self.P = cfg.page_size
        self.S = cfg.num_slots
        self.k_sel = max(cfg.top_k_units - 1, 0)       # the newest page takes one unit of top_k
        self.U = -(-max_model_len // self.P)
        self.device = torch.device(device)
        self.h2d = HostToDevice(self.device)     # per-step metadata, without waiting for the GPU
        self.num_layers = num_layers
        self.dense_layers = set(cfg.dense_layers)
        page_bytes = HostKVPool.page_bytes(self.P, num_kv_heads, head_dim, dtype)
        host_layers = cfg.host_pool_layers(num_layers)
        self._host_layer = {layer: i for i, layer in enumerate(host_layers)}
        if host_pages is None:
            host_pages = cfg.host_pool_pages(num_layers, page_bytes)
        self.pool = (HostKVPool(len(host_layers), host_pages, self.P, num_kv_heads, head_dim, dtype)
                     if cfg.host_tier else None)
        # Quest page bounds: one row per sparse request admitted at once (cfg.quest_rows, default
        # max_rows) + a scratch row that decode-graph padding points at.
        self.quest_rows = cfg.quest_rows or max_rows
        self.quest_scratch = self.quest_rows
        if quest_meta is None:
            meta = (self.quest_rows + 1, self.U, num_kv_heads, head_dim)
            mk = lambda i: (None if i in self.dense_layers  # noqa: E731
                            else torch.zeros(meta, dtype=dtype, device=self.device))
            quest_meta = ([mk(i) for i in range(num_layers)], [mk(i) for i in range(num_layers)])
        self.kmin, self.kmax = quest_meta
        if any(t is not None and t.shape[0] != self.quest_rows + 1 for t in self.kmin):
            raise ValueError(f"quest_meta must have quest_rows + 1 = {self.quest_rows + 1} rows")
        self._free_qrows = list(range(self.quest_rows - 1, -1, -1))
        self.hot = [sl.HotSlots(max_rows + 1, self.S, self.U, self.device)
                    if cfg.host_tier and i not in self.dense_layers else None
                    for i in range(num_layers)]
        self.host_pt = DevicePageTable(max_rows, self.U, self.device, self.h2d)  # host page of each
        # Dense layers of sparse requests: every page in a GPU pool of their own (cfg.dense_pool_gib),
        # attended with the pool's page table; without it they read given-back pages from the host.
        self.dpool = None
        if cfg.uses_dense_pool:
            nd = len(self.dense_layers)
            self.dpool = dense_pool or HostKVPool(
                nd, cfg.dense_pool_pages(page_bytes), self.P, num_kv_heads, head_dim, dtype,
                device=self.device)
            self._dpool_layer = {layer: i for i, layer in enumerate(sorted(self.dense_layers))}
            self.dense_pt = DevicePageTable(max_rows, self.U, self.device, self.h2d)
        # Paged causal attention for prefill / dense rows: paged_dense_reference's signature. The
        # vLLM adapter plugs FlashAttention in on the GPU; the default is the plain-torch twin.
        self.dense_fn = sl.paged_dense_reference
        self.reqs: dict[str, Req] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.trace = None
        if cfg.trace_dir:
            from vllm_hisparse.sim.recorder_hook import TraceWriter

            sparse = [i for i in range(num_layers) if i not in self.dense_layers]
            self._trace_row = {layer: j for j, layer in enumerate(sparse)}
            self._dec_steps: dict[str, int] = {}           # req_id -> decode steps so far
            self.trace = TraceWriter(cfg.trace_dir, meta={
                "model": "served by vLLM (hisparse runtime)", "text": "served requests",
                "indexer": (f"Quest page selection (min/max key bounds, page {self.P}, newest page "
                            f"first), hisparse serving runtime"),
                "unit": self.P, "page_size": self.P, "top_k": cfg.top_k,
                "device_buffer_size": cfg.device_buffer_size, "policy": cfg.policy,
                "num_layers": num_layers, "sparse_layers": sparse, "kv_heads": num_kv_heads,
                "head_dim": head_dim, "decode": "as served"})
        self._hit_miss = torch.zeros(2, dtype=torch.int64, device=self.device)  # read in stats_dict
        self.graphs = None
        self.full = None
        graphs = cfg.decode_graphs if cfg.decode_graphs is not None else self.device.type == "cuda"
        self.split_dense = dense_groups.split_enabled(cfg, self.device, head_dim)
        if cfg.full_decode_graphs:     # vLLM's FULL graphs (the adapter: dense-only batches)
            from vllm_hisparse.core.full_decode import FullDecode

            if num_heads is None:
                raise ValueError("full_decode_graphs needs the runtime's num_heads")
            self.full = FullDecode(self, num_heads, self.U)
        if graphs and cfg.trace_dir is None:       # per-layer graphs: sparse steps run PIECEWISE
            from vllm_hisparse.core.decode_graph import DecodeGraphs

            if num_heads is None:
                raise ValueError("decode_graphs needs the runtime's num_heads")
            self.graphs = DecodeGraphs(self, num_heads, self.U, capture=self.device.type == "cuda")
        self.stats = {"steps": 0, "decode_rows": 0, "dense_decode_rows": 0, "finished": 0,
                      "dense_pool_pages_handed": 0}
        self._host_s = dict.fromkeys(("plan", "dense_layers", "sparse_layers", "graph_layers",
                                      "full_layers"), 0.0)

    def may_hold_sparse(self, req_ids) -> bool:
        """Whether any of these requests is sparse, or not added yet (vLLM picks a step's graph
        mode before the connector adds the step's new requests; one of them may be sparse)."""
        return any(r is None or r.sparse for r in map(self.reqs.get, req_ids))

    # ---- request lifecycle ---------------------------------------------------------------------
    def add(self, req_id: str, num_prompt: int) -> None:
        """A request was scheduled (new, or resumed after preemption: it restarts from token 0)."""
        if req_id not in self.reqs:
            if not self._free_rows:
                raise RuntimeError(f"hisparse runtime: no free row for {req_id} (max_num_seqs rows)")
            r = Req(self._free_rows.pop(), num_prompt, is_sparse_request(self.cfg, num_prompt))
            if r.sparse:
                if not self._free_qrows:     # the connector admits at most quest_rows at once
                    self._free_rows.append(r.row)
                    raise RuntimeError(f"hisparse runtime: no free Quest row for {req_id} "
                                       f"(quest_rows={self.quest_rows})")
                r.qrow = self._free_qrows.pop()
            self.reqs[req_id] = r
        self._reset_row(self.reqs[req_id].row)
        self._restart_trace(req_id)

    def finish(self, req_id: str) -> bool:
        """Return the request's host pages and row; False if it was unknown."""
        r = self.reqs.pop(req_id, None)
        if r is None:
            return False
        if self.pool is not None:
            self.pool.free(req_id)
        if self.trace is not None:
            self._dec_steps.pop(req_id, None)
            self.trace.finish(req_id)
        self._free_rows.append(r.row)
        if r.qrow >= 0:
            self._free_qrows.append(r.qrow)
        self.host_pt.clear(r.row)
        if self.dpool is not None:
            self.dpool.free(req_id)
            self.dense_pt.clear(r.row)
        self.stats["finished"] += 1
        return True

    def _restart_trace(self, req_id: str) -> None:
        """A (re)started request traces from decode step 0: what an earlier run of it recorded
        (before a preemption) is written now and dropped; finish overwrites it with the new run."""
        if self.trace is not None and self._dec_steps.pop(req_id, None) is not None:
            self.trace.finish(req_id)

    def _reset_row(self, row: int) -> None:
        for h in self.hot:
            if h is not None:
                h.reset(row)

    def host_layer(self, layer: int) -> torch.Tensor | None:
        """The host pool's copy of one layer (None: no host tier, or a dense layer kept in the
        dense pool)."""
        i = self._host_layer.get(layer)
        return None if self.pool is None or i is None else self.pool.data[i]

    @property
    def hit_miss(self) -> torch.Tensor:
        """(2,) int64 on the device: RESOLVE's hits and misses so far (vllm/metrics.py reads it
        without waiting for the GPU)."""
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
        """req_ids: the B requests of the batch in row order; query_start_loc: B+1 token offsets;
        seq_lens: B lengths including this step's tokens; block_table (B, W); slot_mapping (T,).
        Everything that needs the host is decided here, once per step; forward_layer then runs
        without host syncs."""
        steps = self._req_steps(req_ids, query_start_loc, seq_lens)
        plan = self._plan_writes(steps, block_table, slot_mapping)
        plan.dec = [s for s in steps if s.sparse and s.t1 - s.t0 == 1 and s.start > 0]
        dec_idx = {s.idx for s in plan.dec}
        plan.dense = [s for s in steps if s.idx not in dec_idx]
        assert all(s.freed[1] <= s.freed[0] for s in plan.dense), "dense rows must be resident"
        plan.dense_sparse = self._dense_group(plan.dense, self._rows_of(plan.dense, block_table))
        if self.dpool is not None:
            res = [s for s in steps if not s.sparse]
            inpool = [s for s in steps if s.sparse]
            plan.dense_res = (plan.dense_sparse if res == plan.dense else   # no sparse request
                              self._dense_group(res, self._rows_of(res, block_table)))
            if inpool:
                rows = self.h2d([s.row for s in inpool], torch.int64)
                plan.dense_pool = self._dense_group(inpool, self.dense_pt.table[rows])
        elif len(self.dense_layers):
            plan.dense_freed = [s for s in steps if s.freed[1] > s.freed[0]]
            res = [s for s in steps if s.freed[1] <= s.freed[0]]
            plan.dense_res = (plan.dense_sparse if len(res) == len(plan.dense) else
                              self._dense_group(res, self._rows_of(res, block_table)))
        if plan.dec:
            # a pure decode step: token i is decode row i, so q[:Rd] replaces the gather q[dec_tok]
            plan.dec_prefix = all(s.t0 == i for i, s in enumerate(plan.dec))
            if self.graphs is not None and not plan.dense:   # every sparse layer replays a graph:
                if not plan.dec_prefix:                       # its buffers hold the rest (fill)
                    plan.dec_tok = self.h2d([s.t0 for s in plan.dec], torch.int64)
                self.graphs.fill(plan)
            else:
                self._plan_decode(plan)
            if self.trace is not None:
                plan.dec_step = [self._dec_steps.get(s.req_id, 0) for s in plan.dec]
                for s, n in zip(plan.dec, plan.dec_step):
                    self._dec_steps[s.req_id] = n + 1
        self.stats["steps"] += 1
        self.stats["decode_rows"] += len(plan.dec)
        self.stats["dense_decode_rows"] += sum(s.t1 - s.t0 == 1 and s.start > 0 for s in plan.dense)
        return plan

    def plan_full(self, req_ids: list[str], seq_lens: list[int], block_table: torch.Tensor,
                  N: int) -> None:
        """A single-token decode step for vLLM's FULL graphs (cfg.full_decode_graphs): req_ids and
        seq_lens of the n real rows (rows 0..n-1 of the batch, one token each), block_table (>= n,
        W); N >= n the padded batch size. Host pages for the new tokens, then the static buffers of
        batch size N (core/full_decode.py) that every layer's fixed body reads."""
        t0 = time.perf_counter()
        steps = self._req_steps(req_ids, list(range(len(req_ids) + 1)), seq_lens)
        assert all(s.freed[1] <= s.freed[0] for s in steps if not s.sparse), \
            "dense rows must be resident"
        self.full.fill(steps, block_table, N)
        self.stats["steps"] += 1
        self.stats["decode_rows"] += sum(s.sparse for s in steps)
        self.stats["dense_decode_rows"] += sum(not s.sparse and s.start > 0 for s in steps)
        self._host_s["plan"] += time.perf_counter() - t0

    def full_layer(self, layer: int, N: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """One layer of a plan_full step (q/out (N, Hq, D), k/v (N, Hkv, D)): recorded by vLLM's
        FULL graph capture, or run eagerly when vLLM does not replay a graph for the step."""
        t0 = time.perf_counter()
        self.full.layer(layer, N, q, k, v, kv, scale, out)
        self._host_s["full_layers"] += time.perf_counter() - t0

    def _req_steps(self, req_ids: list[str], query_start_loc: list[int],
                   seq_lens: list[int]) -> list[ReqStep]:
        """The batch's requests with their tokens; one starting at token 0 (new, or recomputed
        after a preemption) gets fresh hot-slot state; sparse requests get host (and dense-pool)
        pages for this step's tokens, mirrored on the device."""
        steps = []
        for i, rid in enumerate(req_ids):
            r = self.reqs[rid]
            t0, t1 = query_start_loc[i], query_start_loc[i + 1]
            start, n = seq_lens[i] - (t1 - t0), seq_lens[i]
            if start == 0:
                self._reset_row(r.row)
                self._restart_trace(rid)
            steps.append(ReqStep(i, rid, t0, t1, start, n, r.row, r.sparse,
                                 freed_pages(self.cfg, start, r.num_prompt), r.qrow))
            if self.pool is not None and r.sparse:
                self.host_pt.grow(r.row, self.pool.ensure(rid, n))
                if self.dpool is not None:
                    self.stats["dense_pool_pages_handed"] += self.dense_pt.grow(
                        r.row, self.dpool.ensure(rid, n))
        self.host_pt.flush()
        if self.dpool is not None:
            self.dense_pt.flush()
        return steps

    def _plan_writes(self, steps: list[ReqStep], block_table: torch.Tensor,
                     slot_mapping: torch.Tensor) -> StepPlan:
        """Cache slots, Quest page updates and host write-through of this step's tokens."""
        dev, P, U = self.device, self.P, self.U
        sm = slot_mapping.to(dev).long()
        T = sm.shape[0]
        wr_tok = None
        n_real = max((s.t1 for s in steps), default=0)
        if n_real < sm.shape[0]:       # vLLM pads a step's tokens at the tail (slot -1): drop them
            wr_tok = torch.arange(n_real, device=dev)  # known on the host: no sync to find them
            sm = sm[:n_real]
        plan = StepPlan(steps, block_table, sm // P, sm % P, wr_tok)
        # Quest bounds and host write-through cover the tokens of sparse requests (vectorised over
        # the requests: this runs every step, a Python loop per request cost ~50 us each).
        sp = [s for s in steps if s.sparse and s.t1 > s.t0]
        if sp:
            t0, t1, start, seq, row, qrow = (np.array(x, dtype=np.int64) for x in zip(
                *((s.t0, s.t1, s.start, s.seq_len, s.row, s.qrow) for s in sp)))
            n = t1 - t0                                 # tokens per request
            k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)      # index within its request
            tok = np.repeat(t0, n) + k
            pos = np.repeat(start, n) + k
            p0 = start // P
            m = (seq - 1) // P - p0 + 1                 # pages each request touches
            mbase = np.cumsum(m) - m
            page = np.repeat(p0, m) + np.arange(m.sum()) - np.repeat(mbase, m)
            ntok, npg = len(tok), len(page)
            packed = np.concatenate([
                tok, pos // P - np.repeat(p0, n) + np.repeat(mbase, n),             # q_tok_page
                np.repeat(qrow, m) * U + page, (page * P >= np.repeat(start, m)),   # q_page, q_new
                pos, np.repeat(row, n)]).astype(np.int64)
            d = self.h2d(packed)
            plan.q_tok, plan.q_tok_page = d[:ntok], d[ntok:2 * ntok]
            plan.q_page = d[2 * ntok:2 * ntok + npg]
            plan.q_new = d[2 * ntok + npg:2 * ntok + 2 * npg].bool()
            if ntok == T:
                plan.q_tok = None                      # every token: no gather of k
            if self.pool is not None:
                pos_d = d[2 * ntok + 2 * npg:3 * ntok + 2 * npg]
                rows_d = d[3 * ntok + 2 * npg:]
                plan.host_tok = d[:ntok]
                plan.host_page = self.host_pt.table[rows_d, pos_d // P].long()
                plan.host_off = pos_d % P
                if self.dpool is not None:
                    plan.dpool_page = self.dense_pt.table[rows_d, pos_d // P].long()
        return plan

    def _rows_of(self, group: list[ReqStep], block_table: torch.Tensor) -> torch.Tensor | None:
        if not group:
            return None
        idx = [s.idx for s in group]
        if idx == list(range(len(idx))):               # the batch's first rows: a view
            return block_table[:len(idx)]
        return block_table[self.h2d(idx, torch.int64).to(block_table.device)]

    def _dense_group(self, group: list[ReqStep], table: torch.Tensor | None) -> DenseGroup | None:
        return dense_groups.make(self, group, table)

    def _plan_decode(self, plan: StepPlan) -> None:
        d = plan.dec
        dev = self.device
        m = self.h2d([[s.t0 for s in d], [s.row for s in d], [s.seq_len for s in d],
                      [(s.seq_len - 1) // self.P for s in d], [s.idx for s in d],
                      [s.qrow for s in d]], torch.int64)
        plan.dec_tok, plan.dec_rows, plan.dec_qrows = m[0], m[1], m[5]
        plan.dec_seq = m[2].to(torch.int32)
        newest = m[3]
        bt = plan.block_table.to(dev)[m[4]]
        plan.dec_bt = bt.long()
        plan.dec_newest_blk = torch.gather(plan.dec_bt, 1, newest[:, None])[:, 0]
        plan.dec_full = newest
        hot = [j for j, s in enumerate(d) if s.freed[1] > s.freed[0]]
        if hot:
            plan.hot = self.h2d(hot, torch.int64)
            plan.hot_slot_map = bt[plan.hot, :self.S]
            plan.hot_pt = self.host_pt.table[plan.dec_rows[plan.hot]]

    # ---- per layer -----------------------------------------------------------------------------
    def precapture(self, layer: int, rows: int, kv: torch.Tensor, scale: float) -> bool:
        """Capture the decode graph of a sparse layer for a batch of `rows` before serving (see
        DecodeGraphs.precapture); nothing for dense layers, without graphs, or while the current
        stream is itself being captured (a graph inside another's capture)."""
        if self.graphs is None or layer in self.dense_layers or rows > self.max_rows:
            return False
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return self.graphs.precapture(layer, rows, kv, scale)

    def forward_layer(self, layer: int, plan: StepPlan, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """See _forward_layer; the host time it takes is counted (host_ms_* in stats_dict: with
        a GPU, launch and Python overhead, the part of a step the GPU may wait for)."""
        t0 = time.perf_counter()
        try:
            self._forward_layer(layer, plan, q, k, v, kv, scale, out)
        finally:
            key = ("dense_layers" if layer in self.dense_layers else
                   "graph_layers" if plan.graph else "sparse_layers")
            self._host_s[key] += time.perf_counter() - t0

    def _forward_layer(self, layer: int, plan: StepPlan, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """q (T, Hq, D), k/v (T, Hkv, D) of this step's tokens; kv (N, 2, P, Hkv, D) this layer's
        paged cache; out (T, Hq, D) is written. No host sync on the GPU path."""
        dense_layer = layer in self.dense_layers
        if plan.graph and not dense_layer:                     # one replay, core/decode_graph.py
            self.graphs.run(layer, plan, q, k, v, kv, scale, out)
            return
        sl.write_kv(kv, plan.wr_blk, plan.wr_off, plan.wr_tok, k, v)
        host = self.host_layer(layer)
        if dense_layer and self.dpool is not None:            # the dense pool, not the host
            dp = self.dpool.data[self._dpool_layer[layer]]
            if plan.host_tok is not None:
                write_through(dp, k, v, plan.host_tok, plan.dpool_page, plan.host_off)
            self._dense(plan.dense_res, q, kv, scale, out)
            self._dense(plan.dense_pool, q, dp, scale, out)
            return
        if host is not None and plan.host_tok is not None:
            write_through(host, k, v, plan.host_tok, plan.host_page, plan.host_off)
        if not dense_layer and plan.q_page is not None:
            kq = k if plan.q_tok is None else k[plan.q_tok]
            sl.quest_update_pages(self.kmin[layer], self.kmax[layer], plan.q_page, plan.q_new,
                                  plan.q_tok_page, kq)
        if dense_layer:
            self._dense(plan.dense_res, q, kv, scale, out)
            if plan.dense_freed:
                self._dense_freed(plan, q, kv, host, scale, out)
            return
        self._dense(plan.dense_sparse, q, kv, scale, out)
        if not plan.dec:
            return
        n = len(plan.dec)
        qd = q[:n] if plan.dec_prefix else q[plan.dec_tok]
        rows = plan.dec_rows
        sel, locs = sl.quest_topk_locs(qd, self.kmin[layer], self.kmax[layer], plan.dec_qrows,
                                       plan.dec_full, self.k_sel, plan.dec_bt)
        if plan.hot is not None:
            sl.resolve_hot_into(locs, sel, plan.hot, rows, self.hot[layer], plan.hot_slot_map, kv,
                                host, plan.hot_pt, self._hit_miss,
                                io_chunk_bytes=self.cfg.io_chunk_bytes)
        if self.trace is not None:                     # newest page first, then Quest's choice
            pos = torch.cat([plan.dec_full[:, None].to(sel.dtype), sel], 1)
            self.trace.append_batch([s.req_id for s in plan.dec], self._trace_row[layer],
                                    plan.dec_step, pos, [s.seq_len for s in plan.dec])
        direct = plan.dec_prefix and out.dtype == qd.dtype
        o = out[:n] if direct else torch.empty_like(qd)
        sl.sparse_decode(qd, kv, locs, sel, plan.dec_seq, plan.dec_newest_blk, scale, o)
        if not direct:
            out[plan.dec_tok] = o.to(out.dtype)

    def _dense(self, g: DenseGroup | None, q: torch.Tensor, kv: torch.Tensor, scale: float,
               out: torch.Tensor) -> None:
        dense_groups.attend(self, g, q, kv[:, 0], kv[:, 1], scale, out)

    def _dense_freed(self, plan: StepPlan, q: torch.Tensor, kv: torch.Tensor, host: torch.Tensor,
                     scale: float, out: torch.Tensor) -> None:
        """Dense layers of requests whose pages left the GPU: read them back (slow path). The host
        reads the pinned pool itself, so the write-through kernels queued before (earlier steps'
        tokens of these pages) must have run: the stream is synchronised first (the plan copies
        without syncs, and vLLM's asynchronous scheduling runs this while the last step may still
        be on the GPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        fr = plan.dense_freed
        bt = plan.block_table
        pages, table = sl.gather_pages(
            kv, host, [bt[s.idx] for s in fr],
            [torch.tensor(self.pool.page_table(s.req_id), dtype=torch.int64) for s in fr],
            [s.seq_len for s in fr], [s.freed for s in fr])
        dense_groups.attend(self, self._dense_group(fr, table), q, pages[:, 0], pages[:, 1], scale,
                            out)

    # ---- reporting -----------------------------------------------------------------------------
    def stats_dict(self) -> dict:
        s = dict(self.stats)
        s["hits"], s["misses"] = (int(x) for x in self._hit_miss.tolist())
        n = s["resolved_units"] = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / n if n else None
        s["host_pages_used"] = self.host_pages_used
        s["dense_pool_pages_used"] = self.dpool.used_pages if self.dpool is not None else 0
        s["live_requests"] = len(self.reqs)
        # host (CPU) time spent in plan / forward_layer, totals over all steps
        s.update({f"host_ms_{k}": round(v * 1e3, 3) for k, v in self._host_s.items()})
        if self.graphs is not None:              # decode graphs: layers replayed, graphs captured
            s.update({f"graph_{k}": v for k, v in self.graphs.stats.items()})
        if self.full is not None:                # FULL graphs: steps planned, layers run eagerly
            s.update(self.full.stats)
        return s

    def dump_stats(self, path: str | None) -> None:
        if path:
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.stats_dict(), f)
            os.replace(tmp, path)
