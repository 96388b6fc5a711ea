"""The switch: a request whose context reaches ``min_context`` during its life turns sparse
(core/residency.py's length rule), and the KV it already has goes where a sparse request keeps it.

At the first step a request is sparse (``SparseRuntime._req_steps``), before any layer of that step
runs, its positions ``[0, start)`` — in its own GPU blocks, none given back yet (``freed_pages`` is
empty until the switch step has run) — are copied, for every layer, to:

- the host pool (every host layer: all layers, or the sparse ones with a dense pool), the pages the
  runtime has just handed the request for its whole context;
- the GPU dense pool (dense layers, with ``dense_pool_gib``);
- the request's new Quest row: the min/max key bounds of its pages ``0 .. (start - 1) // page``,
  restarted (a row's previous owner left stale bounds there).

The step's own tokens are then written by the usual paths (the decode batch's ``decode_write`` or
the prefill rows' write-through and Quest update), which extend the partial page's bounds; the
hot-slot state starts empty (the runtime resets the row). Resident mode makes the same Quest copy at
the same step and has no pools. No host sync: the indices go through the runtime's pinned staging,
the copies are device ops on the current stream, queued ahead of the step's layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.ops.write_through import write_through


@dataclass
class Switch:
    """One request turning sparse at this step."""
    idx: int                            # its row in the step's block table
    start: int                          # tokens already in its GPU blocks (> 0)
    qrow: int                           # its Quest row
    host_pages: list[int] | None        # its host-pool pages (None: no host tier)
    dpool_pages: list[int] | None       # its dense-pool pages (None: no dense pool)


def copy_context(rt, switches: list[Switch], block_table: torch.Tensor) -> None:
    """Copy the switching requests' KV so far into the pools and their Quest rows (every layer).
    rt: the SparseRuntime (its per-layer KV caches, pools, Quest bounds, staging);
    block_table: (B, W) int32 on the device, the step's block table (row ``Switch.idx``)."""
    if not switches:
        return
    P, U = rt.P, rt.U
    has_host = switches[0].host_pages is not None
    has_dpool = switches[0].dpool_pages is not None
    cols: dict[str, list] = {c: [] for c in ("row", "page", "off", "tok_page", "q_page", "host",
                                             "dpool")}
    base = 0                                                 # pages of the requests before
    for s in switches:                                       # a few requests at most: a loop
        pos = np.arange(s.start, dtype=np.int64)
        page = pos // P
        npages = int(page[-1]) + 1
        cols["row"].append(np.full(s.start, s.idx, dtype=np.int64))
        cols["page"].append(page)
        cols["off"].append(pos % P)
        cols["tok_page"].append(page + base)
        cols["q_page"].append(s.qrow * U + np.arange(npages, dtype=np.int64))
        if has_host:
            cols["host"].append(np.asarray(s.host_pages[:npages], dtype=np.int64)[page])
        if has_dpool:
            cols["dpool"].append(np.asarray(s.dpool_pages[:npages], dtype=np.int64)[page])
        base += npages
    names = [c for c in cols if cols[c]]
    flat = [np.concatenate(cols[c]) for c in names]
    d = rt.h2d(np.concatenate(flat))                         # one copy for every index
    dev, i = {}, 0
    for c, a in zip(names, flat):
        dev[c], i = d[i:i + len(a)], i + len(a)
    T, M = len(dev["row"]), len(dev["q_page"])
    off = dev["off"]
    bt_dev = block_table.device
    blk = block_table[dev["row"].to(bt_dev), dev["page"].to(bt_dev)].long()
    tok = torch.arange(T, device=d.device)
    new = torch.ones(M, dtype=torch.bool, device=d.device)
    for layer in range(rt.num_layers):
        kv = rt.kv_cache(layer)
        k, v = kv[blk, 0, off], kv[blk, 1, off]                 # (T, Hkv, D)
        host = rt.host_layer(layer)
        if host is not None:
            write_through(host, k, v, tok, dev["host"], off)
        dp = rt.dense_pool_layer(layer)
        if dp is not None:
            write_through(dp, k, v, tok, dev["dpool"], off)
        if rt.kmin[layer] is not None:
            sl.quest_update_pages(rt.kmin[layer], rt.kmax[layer], dev["q_page"], new,
                                  dev["tok_page"], k)
