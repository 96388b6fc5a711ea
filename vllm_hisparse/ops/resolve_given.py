"""RESOLVE of a given selection: a decode batch's rows map the units their indexer selected (in
the indexer's order) to hot-buffer rows, copying misses from the host pool. For indexers that
select by themselves (DSA: docs/dsa.md section 4); Quest's scores go through
decode_ops.select_resolve, which also does the top-k.

CUDA: one select launch + one IO launch (ops/triton_resolve_given.py); CPU: the reference below.
"""
from __future__ import annotations

import torch

from vllm_hisparse.slots import HotBufferState, fetch_misses, resolve

# resolve_given's (scratch, victims) workspaces are select_resolve's: one shape rule
from .decode_ops import workspace_shapes  # noqa: F401  (re-exported)


def resolve_given_reference(sel: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                            locs: torch.Tensor, hot: torch.Tensor, rows: torch.Tensor,
                            state: HotBufferState, host_pt: torch.Tensor, host: torch.Tensor,
                            kv: torch.Tensor, counts: torch.Tensor) -> None:
    """In place, for the live (seq > 0) hot (hot != 0) rows r of the batch:
    locs[r, j] = the hot-buffer row now holding unit sel[r, j] (-1 where sel is -1).

    sel: (N, K) int32 unique units per row in the indexer's order, -1 = none (anywhere);
    seq: (N,) int, 0 = padding; block_table: (N, >= S) int32, slot s of row r = row
    block_table[r, s] of kv; locs: (N, K) int32 out (other rows untouched); hot: (N,) int;
    rows: (N,) int64 runtime rows; state: the slot engine's HotBufferState of M rows, S slots, U
    units, read and written at rows by its policy (one with a kernel branch: lru or crf), as
    slots.engine.resolve does; host_pt: (M, U) int32 host row of each unit; host (P, *row),
    kv (B, *row) the same row shape (opaque bytes); counts: (2,) or longer int64,
    counts[:2] += [hits, misses]."""
    h = torch.nonzero((seq > 0) & (hot != 0))[:, 0]
    if len(h) == 0 or sel.shape[1] == 0:
        return
    r, sh = rows[h].long(), sel[h]
    loc, miss = resolve(state, sh, rows=r)
    counts[:2] += torch.stack([((sh >= 0) & ~miss).sum(), miss.sum()])
    slot_map = block_table[h, :state.slots].long()
    fetch_misses(kv, slot_map, loc, miss, sh, lambda i, u: host[host_pt[r[i], u].long()])
    phys = torch.gather(slot_map, 1, loc.clamp(min=0))
    locs[h] = torch.where(loc >= 0, phys, -1).to(locs.dtype)


def resolve_given(sel: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                  locs: torch.Tensor, hot: torch.Tensor, rows: torch.Tensor,
                  state: HotBufferState, host_pt: torch.Tensor, host: torch.Tensor,
                  kv: torch.Tensor, counts: torch.Tensor, work: tuple | None = None) -> None:
    """resolve_given_reference (shapes there); on CUDA the Triton kernel, no host sync (work: the
    workspaces of workspace_shapes, allocated here when None)."""
    if not sel.is_cuda:
        resolve_given_reference(sel, seq, block_table, locs, hot, rows, state, host_pt, host, kv,
                                counts)
        return
    from . import kernels, triton_resolve_given
    if host.dtype != kv.dtype or host[0].numel() != kv[0].numel() or not kv.is_contiguous():
        raise ValueError(f"host rows and kv rows must have one shape and dtype; got "
                         f"{tuple(host.shape)} {host.dtype} vs {tuple(kv.shape)} {kv.dtype}")
    if work is None:
        work = tuple(torch.empty(s, dtype=torch.int32, device=sel.device)
                     for s in workspace_shapes(sel.shape[0], sel.shape[1], state.slots))
    triton_resolve_given.resolve_given(sel, seq, block_table, locs, *work, hot, rows, state,
                                       host_pt, kernels.device_alias(host, sel.device), kv, counts)
