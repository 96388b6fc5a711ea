"""The rows of a step with several query tokens (prefill chunks): their tokens written into the
cache, through to the host pool (or the dense pool) and into the indexer's state, and their dense
causal attention over the paged cache — through the runtime's ``dense_fn`` (FlashAttention on the
GPU). Also the slow path of rows whose pages left the GPU (``attend_from_host``: a chunk of a
request recomputed after a preemption; dense layers without a dense pool), shared with the decode
batch. Module functions over the SparseRuntime
``rt``; the one-token rows go through core/decode_body.py instead.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from vllm_hisparse.core import dense_groups
from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.core.step_plan import ReqStep, StepPlan
from vllm_hisparse.ops import kernels
from vllm_hisparse.ops.write_through import write_through


def plan(rt, multi: list[ReqStep], block_table: torch.Tensor,
         slot_mapping: torch.Tensor) -> StepPlan:
    """The step's plan with what the prefill rows ``multi`` need: write indices, indexer
    updates, write-through destinations and their dense attention groups."""
    p = _plan_writes(rt, multi, block_table, slot_mapping)
    p.dense = multi
    # A prefill chunk with given-back pages: a request recomputed from token 0 after a preemption
    # (prompt and generated tokens), in a chunk past its switch to sparse; its attention reads
    # those pages back from the host pool (dense layers: the dense pool, if any).
    p.dense_freed = [s for s in multi if s.freed[1] > s.freed[0]]
    on_gpu = [s for s in multi if s.freed[1] <= s.freed[0]]
    p.dense_sparse = dense_groups.make(rt, on_gpu, rows_of(rt, on_gpu, block_table))
    if rt.dpool is not None:
        # sparse rows' dense layers are in the pool, but a host-less one's (core/hostless.py)
        inpool = [s for s in multi if s.sparse and not rt.reqs[s.req_id].hostless]
        res = [s for s in multi if not s.sparse or rt.reqs[s.req_id].hostless]   # none given back
        p.dense_res = (p.dense_sparse if len(res) == len(on_gpu) else
                       dense_groups.make(rt, res, rows_of(rt, res, block_table)))
        if inpool:
            rows = rt.h2d([s.row for s in inpool], torch.int64)
            p.dense_pool = dense_groups.make(rt, inpool, rt.dense_pt.table[rows])
    else:
        p.dense_res = p.dense_sparse
    return p


def rows_of(rt, group: list[ReqStep], block_table: torch.Tensor) -> torch.Tensor | None:
    """The block-table rows of ``group`` (a view when they are the batch's first rows)."""
    if not group:
        return None
    idx = [s.idx for s in group]
    if idx == list(range(len(idx))):
        return block_table[:len(idx)]
    return block_table[rt.h2d(idx, torch.int64).to(block_table.device)]


def _plan_writes(rt, steps: list[ReqStep], block_table: torch.Tensor,
                 slot_mapping: torch.Tensor) -> StepPlan:
    """Cache slots, indexer updates and host write-through of the tokens of the rows
    `steps` (the prefill rows; the decode batch writes its own)."""
    dev, P = rt.device, rt.P
    T = slot_mapping.shape[0]
    slots = slot_mapping.to(dev).long()
    n = _leading(steps)             # the rows' tokens are 0..n-1 in order (a 32K prompt: no list)
    if n == T:
        wr_tok, sm = None, slots
    elif n is not None:                              # the first tokens (vLLM pads at the tail)
        wr_tok = torch.arange(n, device=dev)
        sm = slots[:n]
    else:
        wr_tok = rt.h2d(np.concatenate([np.arange(s.t0, s.t1, dtype=np.int64) for s in steps]))
        sm = slots[wr_tok]
    plan = StepPlan(steps, block_table, sm // P, sm % P, wr_tok)
    # The indexer's state and host write-through cover the tokens of sparse requests (vectorised
    # over the requests: this runs every step, so its host time must not grow by a Python loop
    # per request).
    sp = [s for s in steps if s.sparse and s.t1 > s.t0]
    if sp:
        t0, t1, start, seq, row, irow = (np.array(x, dtype=np.int64) for x in zip(
            *((s.t0, s.t1, s.start, s.seq_len, s.row, s.irow) for s in sp)))
        n = t1 - t0                                 # tokens per request
        k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)      # index within its request
        tok = np.repeat(t0, n) + k
        pos = np.repeat(start, n) + k
        ix = rt.ix.plan_tokens(start, seq, irow)
        d, ix_d = ship(rt, [tok, pos, np.repeat(row, n)], ix)
        tok_d, pos_d, rows_d = d
        plan.ix_upd = rt.ix.device_update(ix_d)
        plan.ix_tok = None if len(tok) == T else tok_d      # every token: no gather of k
        if rt.pool is not None:
            plan.host_tok = tok_d
            plan.host_page = rt.host_pt.table[rows_d, pos_d // P].long()
            plan.host_off = pos_d % P
            if rt.write_behind.stream is not None:    # its source: the cache's K row (write_kv)
                s = slots[tok_d]
                plan.host_src = sl.cache_row(s // P, s % P, P)
            if rt.dpool is not None:
                plan.dpool_page = rt.dense_pt.table[rows_d, pos_d // P].long()
    return plan


def _leading(steps: list[ReqStep]) -> int | None:
    """n when the rows' tokens, row after row, are 0, 1, .., n-1; else None."""
    n = 0
    for s in steps:
        if s.t0 != n:
            return None
        n = s.t1
    return n


def ship(rt, arrays: list, named: dict) -> tuple[list, dict]:
    """arrays and the named arrays (int64 numpy) on the device in one host->device copy."""
    names = list(named)
    flat = [np.asarray(a, dtype=np.int64) for a in arrays] + [np.asarray(named[c], dtype=np.int64)
                                                              for c in names]
    d = rt.h2d(np.concatenate(flat))
    out, i = [], 0
    for a in flat:
        out.append(d[i:i + len(a)])
        i += len(a)
    return out[:len(arrays)], dict(zip(names, out[len(arrays):]))


def layer(rt, layer: int, plan: StepPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """The prefill rows of a step: their tokens written (cache, host / dense pool, indexer
    state) and attended densely over the paged cache (or the dense pool / the host pool)."""
    dense_layer = layer in rt.dense_layers
    sl.write_kv(kv, plan.wr_blk, plan.wr_off, plan.wr_tok, k, v)
    host = rt.host_layer(layer)
    dp = rt.dense_pool_layer(layer)
    if dp is not None:                                 # the dense pool, not the host
        if plan.host_tok is not None:
            write_through(dp, k, v, plan.host_tok, plan.dpool_page, plan.host_off)
        _dense(rt, plan.dense_res, q, kv, scale, out)
        _dense(rt, plan.dense_pool, q, dp, scale, out)
        return
    if host is not None and plan.host_tok is not None:      # on a side stream (core/write_behind)
        rt.write_behind.write(host, kv, plan.host_src, k, v, plan.host_tok, plan.host_page,
                              plan.host_off)
    if not dense_layer and plan.ix_upd is not None:
        rt.ix.update(layer, plan.ix_upd, k if plan.ix_tok is None else k[plan.ix_tok])
    _dense(rt, plan.dense_res if dense_layer else plan.dense_sparse, q, kv, scale, out)
    if plan.dense_freed:
        attend_from_host(rt, plan.dense_freed, plan.block_table, q, kv, host, scale, out)


def _dense(rt, g, q: torch.Tensor, kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    dense_groups.attend(rt, g, q, kv[:, 0], kv[:, 1], scale, out)


def dense_from_host(rt, layer: int, db, q: torch.Tensor, kv: torch.Tensor, bt: torch.Tensor,
                    scale: float, out: torch.Tensor) -> None:
    """Dense layers, no dense pool: the decode batch's sparse rows whose pages left the GPU
    (db.freed), attended over their pages read back from the host pool (eager only). Row i of
    q/out/bt is decode-batch row i."""
    pos = {id(s): i for i, s in enumerate(db.steps)}
    rows = [replace(s, idx=pos[id(s)], t0=pos[id(s)], t1=pos[id(s)] + 1) for s in db.freed]
    attend_from_host(rt, rows, bt, q, kv, rt.host_layer(layer), scale, out)


def attend_from_host(rt, fr: list[ReqStep], bt: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                     host: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Rows whose pages left the GPU, attended over them read back (slow path). The host
    reads the pinned pool itself, so the write-through kernels queued before (earlier steps'
    tokens of these pages) must have run: the stream is synchronised first (the plan copies
    without syncs, and vLLM's asynchronous scheduling runs this while the last step may still
    be on the GPU), and so are the side stream's (core/write_behind.py). One-token rows go
    through the same kernel as the other decode rows."""
    if rt.device.type == "cuda":
        rt.write_behind.join()
        torch.cuda.current_stream(rt.device).synchronize()
    pages, table = sl.gather_pages(
        kv, host, [bt[s.idx] for s in fr],
        [torch.tensor(rt.host_pt.host_reads(rt.pool.page_table(s.req_id)), dtype=torch.int64)
         for s in fr],
        [s.seq_len for s in fr], [s.freed for s in fr])
    if all(s.t1 - s.t0 == 1 for s in fr) and (rt.split_dense or not q.is_cuda):
        idx = torch.tensor([s.t0 for s in fr], dtype=torch.int64, device=q.device)
        seq = torch.tensor([s.seq_len for s in fr], dtype=torch.int32, device=q.device)
        out[idx] = kernels.dense_decode_attention(q[idx], pages[:, 0], pages[:, 1], table,
                                                  seq, scale).to(out.dtype)
        return
    dense_groups.attend(rt, dense_groups.make(rt, fr, table), q, pages[:, 0], pages[:, 1], scale,
                        out)
