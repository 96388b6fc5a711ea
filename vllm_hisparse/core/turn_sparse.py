"""The switch: a request whose context reaches ``min_context`` during its life turns sparse
(core/residency.py's length rule), and the KV it already has goes where a sparse request keeps it.

At the first step a request is sparse (``step_requests.req_steps``), before any layer of that step
runs, its positions ``[0, start)`` — in its own GPU blocks, none given back yet (``freed_pages`` is
empty until the switch step has run) — are copied, for every layer, to:

- the host pool (every host layer: all layers, or the sparse ones with a dense pool), the pages the
  runtime has just handed the request for its whole context;
- the GPU dense pool (dense layers, with ``dense_pool_gib``);
- the request's new indexer row (core/indexers): its tokens ``[0, start)`` folded in as a prefill
  of them would (Quest: the min/max key bounds of its pages, restarted: a row's previous owner left
  stale bounds there).

The step's own tokens are then written by the usual paths (the decode batch's ``decode_write`` or
the prefill rows' write-through and indexer update), which extend the partial unit's state; the
hot-slot state starts empty (the runtime resets the row). Resident mode makes the same indexer copy at
the same step and has no pools. No host sync: the indices go through the runtime's pinned staging,
the copies are device ops on the current stream, queued ahead of the step's layers.

Host pages below a request's ``shared_upto`` (a prefix-cache hit on pages the scheduler's
``HostPageTable`` shares: core/host_pages.py) hold the prefix already and others read them: their
destinations are -1 (skipped); the dense pool is private and always filled.

A *host-less* request (no host pages: core/hostless.py) takes the same path without the host copy
(its host page column is -1, which write-through skips), and, moving into the host tier once it is
sparse, the copy without the indexer (``Switch.index`` False: its row is up to date).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_hisparse.core.prefill import ship
from vllm_hisparse.ops.write_through import write_through


@dataclass
class Switch:
    """One request turning sparse at this step (or, index False, moving into the host tier)."""
    idx: int                            # its row in the step's block table
    start: int                          # tokens already in its GPU blocks (> 0)
    irow: int                           # its indexer row
    host_pages: list[int] | None        # its host-pool pages (None: none, host-less or resident)
    dpool_pages: list[int] | None       # its dense-pool pages (None: none)
    index: bool = True                  # fold its tokens into its indexer row
    shared_upto: int = 0                # host pages [0, shared_upto): shared, complete, not written


def copy_context(rt, switches: list[Switch], block_table: torch.Tensor) -> None:
    """Copy the switching requests' KV so far into the pools and their indexer rows (every layer).
    rt: the SparseRuntime (its per-layer KV caches, pools, indexer, staging);
    block_table: (B, W) int32 on the device, the step's block table (row ``Switch.idx``)."""
    if not switches:
        return
    P = rt.P
    has_host, has_dpool = rt.pool is not None, rt.dpool is not None

    def dst(pages, n, page, shared=0):  # a pool's page of each position (-1: none, skipped)
        if pages is None:
            return np.full(len(page), -1, dtype=np.int64)
        ids = np.asarray(pages[:n], dtype=np.int64)
        ids[:shared] = -1               # shared host pages (section 3.3): never written again
        return ids[page]
    cols: dict[str, list] = {c: [] for c in ("row", "page", "off", "host", "dpool")}
    for s in switches:                                       # a few requests at most: a loop
        pos = np.arange(s.start, dtype=np.int64)
        page = pos // P
        npages = int(page[-1]) + 1
        cols["row"].append(np.full(s.start, s.idx, dtype=np.int64))
        cols["page"].append(page)
        cols["off"].append(pos % P)
        if has_host:
            cols["host"].append(dst(s.host_pages, npages, page, s.shared_upto))
        if has_dpool:
            cols["dpool"].append(dst(s.dpool_pages, npages, page))
    names = [c for c in cols if cols[c]]
    # the indexer's copy covers the switches only (a moving request's row is up to date): its
    # updates index the switches' tokens among every copied token (tok_ix)
    ixs = [s for s in switches if s.index]
    starts = np.array([s.start for s in ixs], dtype=np.int64)
    ix = rt.ix.plan_tokens(np.zeros_like(starts), starts,
                           np.array([s.irow for s in ixs], dtype=np.int64)) if ixs else {}
    first = np.cumsum([0] + [s.start for s in switches])
    tok_ix = np.concatenate([np.arange(first[i], first[i] + s.start) for i, s in
                             enumerate(switches) if s.index] or [np.zeros(0, dtype=np.int64)])
    flat, ix_d = ship(rt, [np.concatenate(cols[c]) for c in names] + [tok_ix], ix)   # one copy
    dev = dict(zip(names, flat))
    upd = rt.ix.device_update(ix_d) if ixs else None
    sub = None if len(ixs) == len(switches) else flat[-1]
    T = len(dev["row"])
    off = dev["off"]
    bt_dev = block_table.device
    blk = block_table[dev["row"].to(bt_dev), dev["page"].to(bt_dev)].long()
    tok = torch.arange(T, device=off.device)
    for layer in range(rt.num_layers):
        kv = rt.kv_cache(layer)
        k, v = kv[blk, 0, off], kv[blk, 1, off]                 # (T, Hkv, D)
        host = rt.host_layer(layer)
        if host is not None:
            write_through(host, k, v, tok, dev["host"], off)
        dp = rt.dense_pool_layer(layer)
        if dp is not None:
            write_through(dp, k, v, tok, dev["dpool"], off)
        if upd is not None and layer not in rt.dense_layers:
            rt.ix.update(layer, upd, k if sub is None else k[sub])
