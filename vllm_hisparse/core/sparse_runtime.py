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
from dataclasses import dataclass, field

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.residency import freed_pages, is_sparse_request


@dataclass
class Req:
    row: int
    num_prompt: int
    sparse: bool


@dataclass
class ReqStep:
    """One request of the batch: tokens [t0, t1) at positions [start, seq_len)."""
    idx: int
    req_id: str
    t0: int
    t1: int
    start: int
    seq_len: int
    row: int
    sparse: bool
    freed: tuple[int, int]


@dataclass
class StepPlan:
    reqs: list[ReqStep]
    slot_mapping: torch.Tensor                 # (T,) int64, -1 = padding
    block_table: torch.Tensor                  # (B, W) int32
    tok_rows: torch.Tensor                     # (T,) runtime row of each token
    tok_pos: torch.Tensor                      # (T,) position of each token
    host_tok: torch.Tensor                     # (n,) tokens written through to the host pool
    host_page: torch.Tensor                    # (n,) their host pages
    host_off: torch.Tensor                     # (n,) their offsets in the page
    host_pages: dict = field(default_factory=dict)   # req_id -> (pages,) int64 host page table
    dec: list[ReqStep] = field(default_factory=list)  # sparse single-token decode rows
    dense: list[ReqStep] = field(default_factory=list)  # everything else (prefill, short requests)
    dec_step: list[int] = field(default_factory=list)  # trace only: decode-step index of each decode row
    dec_tok: torch.Tensor | None = None        # (Rd,) token index of each decode row
    dec_rows: torch.Tensor | None = None       # (Rd,) runtime rows
    dec_seq: torch.Tensor | None = None        # (Rd,) seq lens
    dec_newest_blk: torch.Tensor | None = None  # (Rd,) block of the newest page
    dec_full: torch.Tensor | None = None       # (Rd,) complete pages
    dec_bt: torch.Tensor | None = None         # (Rd, W) int64 block tables of the decode rows
    hot: torch.Tensor | None = None            # (Rh,) indices into the decode rows using RESOLVE
    hot_slot_map: torch.Tensor | None = None   # (Rh, S) blocks [0, S) of the hot rows
    hot_pt: torch.Tensor | None = None         # (Rh, U) int32 host page of each logical page


class SparseRuntime:
    def __init__(self, cfg: HiSparseConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, max_rows: int, max_model_len: int,
                 host_pages: int | None = None, quest_meta: tuple[list, list] | None = None):
        """quest_meta: per-layer (kmin, kmax) tensors (rows, U, Hkv, D), None for dense layers,
        allocated by the caller (the vLLM adapter does it before memory profiling); default: here."""
        cfg.check_layers(num_layers)
        self.cfg = cfg
        self.P = cfg.page_size
        self.S = cfg.num_slots
        self.k_sel = max(cfg.top_k_units - 1, 0)       # the newest page takes one unit of top_k
        self.U = -(-max_model_len // self.P)
        self.device = torch.device(device)
        self.num_layers = num_layers
        self.dense_layers = set(cfg.dense_layers)
        page_bytes = HostKVPool.page_bytes(self.P, num_kv_heads, head_dim, dtype)
        if host_pages is None:
            host_pages = cfg.host_pool_bytes // (page_bytes * num_layers)
        self.pool = (HostKVPool(num_layers, host_pages, self.P, num_kv_heads, head_dim, dtype)
                     if cfg.host_tier else None)
        if quest_meta is None:
            meta = (max_rows, self.U, num_kv_heads, head_dim)
            mk = lambda i: (None if i in self.dense_layers  # noqa: E731
                            else torch.zeros(meta, dtype=dtype, device=self.device))
            quest_meta = ([mk(i) for i in range(num_layers)], [mk(i) for i in range(num_layers)])
        self.kmin, self.kmax = quest_meta
        self.hot = [sl.HotSlots(max_rows, self.S, self.U, self.device)
                    if cfg.host_tier and i not in self.dense_layers else None
                    for i in range(num_layers)]
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
        self.stats = {"steps": 0, "decode_rows": 0,
                      "finished": 0}

    # ---- request lifecycle ---------------------------------------------------------------------
    def add(self, req_id: str, num_prompt: int) -> None:
        """A request was scheduled (new, or resumed after preemption: it restarts from token 0)."""
        if req_id not in self.reqs:
            if not self._free_rows:
                raise RuntimeError(f"hisparse runtime: no free row for {req_id} (max_num_seqs rows)")
            self.reqs[req_id] = Req(self._free_rows.pop(), num_prompt,
                                    is_sparse_request(self.cfg, num_prompt))
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

    @property
    def host_pages_used(self) -> int:
        return self.pool.used_pages if self.pool is not None else 0

    # ---- plan once per step ----------------------------------------------------------------------
    def plan(self, req_ids: list[str], query_start_loc: list[int], seq_lens: list[int],
             block_table: torch.Tensor, slot_mapping: torch.Tensor) -> StepPlan:
        """req_ids: the B requests of the batch in row order; query_start_loc: B+1 token offsets;
        seq_lens: B lengths including this step's tokens; block_table (B, W); slot_mapping (T,)."""
        steps, rows, pos, htok, hpage, hoff = [], [], [], [], [], []
        host_pages = {}
        for i, rid in enumerate(req_ids):
            r = self.reqs[rid]
            t0, t1 = query_start_loc[i], query_start_loc[i + 1]
            start, n = seq_lens[i] - (t1 - t0), seq_lens[i]
            if start == 0:
                self._reset_row(r.row)                # a new request or a recompute after preemption
                self._restart_trace(rid)
            st = ReqStep(i, rid, t0, t1, start, n, r.row, r.sparse,
                         freed_pages(self.cfg, start, r.num_prompt))
            steps.append(st)
            p = torch.arange(start, n, dtype=torch.int64)
            rows.append(torch.full((t1 - t0,), r.row, dtype=torch.int64))
            pos.append(p)
            if self.pool is not None and r.sparse:
                pages = torch.tensor(self.pool.ensure(rid, n), dtype=torch.int64)
                host_pages[rid] = pages
                htok.append(torch.arange(t0, t1, dtype=torch.int64))
                hpage.append(pages[p // self.P])
                hoff.append(p % self.P)
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
        dev = self.device
        plan = StepPlan(steps, slot_mapping.long(), block_table, cat(rows).to(dev), cat(pos).to(dev),
                        cat(htok).to(dev), cat(hpage), cat(hoff), host_pages)
        plan.dec = [s for s in steps if s.sparse and s.t1 - s.t0 == 1 and s.start > 0]
        dec_idx = {s.idx for s in plan.dec}
        plan.dense = [s for s in steps if s.idx not in dec_idx]
        if plan.dec:
            self._plan_decode(plan)
            if self.trace is not None:
                plan.dec_step = [self._dec_steps.get(s.req_id, 0) for s in plan.dec]
                for s, n in zip(plan.dec, plan.dec_step):
                    self._dec_steps[s.req_id] = n + 1
        self.stats["steps"] += 1
        self.stats["decode_rows"] += len(plan.dec)
        return plan

    def _plan_decode(self, plan: StepPlan) -> None:
        d = plan.dec
        dev = self.device
        plan.dec_tok = torch.tensor([s.t0 for s in d], dtype=torch.int64, device=dev)
        plan.dec_rows = torch.tensor([s.row for s in d], dtype=torch.int64, device=dev)
        plan.dec_seq = torch.tensor([s.seq_len for s in d], dtype=torch.int32, device=dev)
        newest = torch.tensor([(s.seq_len - 1) // self.P for s in d], dtype=torch.int64, device=dev)
        idx = torch.tensor([s.idx for s in d], dtype=torch.int64, device=plan.block_table.device)
        bt = plan.block_table[idx].to(dev)
        plan.dec_bt = bt.long()
        plan.dec_newest_blk = torch.gather(bt.long(), 1, newest[:, None])[:, 0]
        plan.dec_full = newest
        hot = [j for j, s in enumerate(d) if s.freed[1] > s.freed[0]]
        if hot:
            plan.hot = torch.tensor(hot, dtype=torch.int64, device=dev)
            plan.hot_slot_map = bt[plan.hot, :self.S]
            plan.hot_pt = self.pool.page_table_tensor([d[j].req_id for j in hot], self.U).to(dev)

    # ---- per layer -----------------------------------------------------------------------------
    def forward_layer(self, layer: int, plan: StepPlan, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """q (T, Hq, D), k/v (T, Hkv, D) of this step's tokens; kv (N, 2, P, Hkv, D) this layer's
        paged cache; out (T, Hq, D) is written."""
        sl.write_kv(kv, plan.slot_mapping, k, v)
        host = self.pool.data[layer] if self.pool is not None else None
        if host is not None and len(plan.host_tok):
            sl.write_host(host, plan.host_page, plan.host_off, k[plan.host_tok], v[plan.host_tok])
        dense_layer = layer in self.dense_layers
        if not dense_layer:
            sl.quest_update(self.kmin[layer], self.kmax[layer], plan.tok_rows, plan.tok_pos,
                            k, self.P)
        for s in (plan.reqs if dense_layer else plan.dense):
            kc, vc = sl.gather_context(kv, host, plan.block_table[s.idx].to(kv.device),
                                       plan.host_pages.get(s.req_id), s.seq_len, s.freed)
            sl.dense_attention(q[s.t0:s.t1], kc, vc, s.start, scale, out[s.t0:s.t1])
        if dense_layer or not plan.dec:
            return
        qd = q[plan.dec_tok]
        rows = plan.dec_rows
        sel = sl.quest_topk(qd, self.kmin[layer][rows], self.kmax[layer][rows], plan.dec_full,
                            self.k_sel)
        locs = torch.where(sel >= 0, torch.gather(plan.dec_bt, 1, sel.long().clamp(min=0)), -1).to(torch.int32)
        if plan.hot is not None:
            hot_locs, counts = sl.resolve_hot(sel[plan.hot], self.hot[layer], rows[plan.hot],
                                              plan.hot_slot_map, kv, host, plan.hot_pt,
                                              io_chunk_bytes=self.cfg.io_chunk_bytes)
            locs[plan.hot] = hot_locs
            self._hit_miss += counts
        if self.trace is not None:                     # newest page first, then Quest's choice
            pos = torch.cat([plan.dec_full[:, None].to(sel.dtype), sel], 1)
            self.trace.append_batch([s.req_id for s in plan.dec], self._trace_row[layer],
                                    plan.dec_step, pos, [s.seq_len for s in plan.dec])
        o = torch.empty_like(qd)
        sl.sparse_decode(qd, kv, locs, sel, plan.dec_seq, plan.dec_newest_blk, scale, o)
        out[plan.dec_tok] = o.to(out.dtype)

    # ---- reporting -----------------------------------------------------------------------------
    def stats_dict(self) -> dict:
        s = dict(self.stats)
        s["hits"], s["misses"] = (int(x) for x in self._hit_miss.tolist())
        n = s["resolved_units"] = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / n if n else None
        s["host_pages_used"] = self.host_pages_used
        s["live_requests"] = len(self.reqs)
        return s

    def dump_stats(self, path: str | None) -> None:
        if path:
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.stats_dict(), f)
            os.replace(tmp, path)
