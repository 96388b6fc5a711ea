"""The requests of one step, before any layer runs (SparseRuntime's plan and plan_full).

Each request of the batch gets its tokens [start, n) and its ``ReqStep``; one starting at token 0
gets fresh hot-slot state; one whose context reaches min_context turns sparse (core/residency.py)
and one that is a prefix-cache hit or moves into the host tier has its KV so far copied from its
GPU blocks (core/turn_sparse.py ``copy_context``); sparse requests with a host copy get their host
(and dense-pool) pages for the step, mirrored on the device.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core import give_back
from vllm_hisparse.core.hostless import runs_dense
from vllm_hisparse.core.residency import freed_pages, is_sparse_at
from vllm_hisparse.core.page_table import flush_tables
from vllm_hisparse.core.step_plan import ReqStep
from vllm_hisparse.core.turn_sparse import Switch, copy_context


def req_steps(rt, req_ids: list[str], query_start_loc: list[int], seq_lens: list[int],
              block_table: torch.Tensor | None) -> tuple[list[ReqStep], dict]:
    """The batch's requests with their tokens; one starting at token 0 (new, or recomputed
    after a preemption) gets fresh hot-slot state; one whose context reaches min_context turns
    sparse (core/residency.py), its KV so far copied from block_table's row to the pools and
    its indexer row (core/turn_sparse.py; to the pools only when it moves into the host tier:
    core/hostless.py); sparse requests (not host-less) get host (and dense-pool) pages for the
    step, mirrored on the device and returned: req_id -> (host pages, dense-pool pages)."""
    steps, pages, switches = [], {}, []
    for i, rid in enumerate(req_ids):
        r = rt.reqs[rid]
        t0, t1 = query_start_loc[i], query_start_loc[i + 1]
        start, n = seq_lens[i] - (t1 - t0), seq_lens[i]
        if start < r.shared_upto * rt.P:      # its writes would land on shared host pages
            raise RuntimeError(f"hisparse runtime: {rid} starts at token {start}, inside its "
                               f"{r.shared_upto} shared (read-only) host pages; the scheduler "
                               f"makes them private first (HostPageTable.make_writable)")
        if start == 0:
            rt.hot.reset(r.row)
            if rt.trace is not None:
                rt.trace.restart(rid)
        if not r.sparse and not runs_dense(rt.cfg, r) and is_sparse_at(rt.cfg, r.num_prompt, n):
            rt.make_sparse(rid, r, n)
            rt.stats["turned_sparse"] += 1
            if start > 0:                   # KV on the GPU to copy (none at a restart)
                switches.append((i, rid, start, True))
        elif r.fresh and start > 0 and r.sparse:
            # a prefix-cache hit: tokens [0, start) are in (shared) GPU blocks it never
            # computed; its new indexer row (and host / dense-pool pages) get them here, as
            # a request turning sparse (docs/design/prefix-caching.md section 3.2)
            switches.append((i, rid, start, True))
            rt.stats["prefix_hits"] += 1
        elif r.moving and start > 0:        # into the host tier: its KV so far to the host
            switches.append((i, rid, start, False))
        r.moving = r.fresh = False
        r.start = start
        steps.append(ReqStep(i, rid, t0, t1, start, n, r.row, r.sparse,
                             freed_pages(rt.cfg, start, r.num_prompt, r.keep), r.irow))
        rt.hot.step(r.row, steps[-1].freed)      # (seeded at its first step through them)
        if rt.pool is not None and r.sparse and not r.hostless:
            hp = rt.pool.ensure(rid, n)
            rt.host_pt.grow(r.row, hp)
            dp = None
            if rt.dpool is not None:
                dp = rt.dpool.ensure(rid, n)
                rt.stats["dense_pool_pages_handed"] += rt.dense_pt.grow(r.row, dp)
            pages[rid] = (hp, dp)
    flush_tables([rt.host_pt, rt.dense_pt if rt.dpool is not None else None])
    if switches:
        if block_table is None:
            raise RuntimeError("hisparse runtime: a request turns sparse in a step planned "
                               "without its block table")
        copy_context(rt, [Switch(i, start, rt.reqs[rid].irow, *pages.get(rid, (None, None)),
                                   index, rt.reqs[rid].shared_upto)
                            for i, rid, start, index in switches], block_table)
    give_back.insert(rt, steps, block_table)
    return steps, pages
