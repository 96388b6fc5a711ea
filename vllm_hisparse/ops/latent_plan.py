"""The DSA step plan's device half (core/latent_graph.py): ``materialize`` writes the buffers the
layers read from the plan the host last shipped, ``delta`` decode steps later. A steady decode
step (the same requests, one more token each, no admission event) is the last plan with every live
position one further on, so it needs no host plan and no copy: one launch here.

The buffers are LatentGraphStep's one int64 tensor (sections of T tokens and D one-token decode
entries, then the verify rows): the host sources ``row set x W + position`` [0, T) and pool rows
[T, 2T) advance where >= 0, the decode entries' context lengths [3T + 3D, 3T + 4D) where > 0;
region bases, gathers, scatters, row sets and the verify rows are copied as they are. Each
token's host row is its host source looked up in the row sets' host page table (the write path's
destination). CUDA: one Triton launch (ops/triton_latent_plan.py); CPU: the plain-torch reference
below.
"""
from __future__ import annotations

import torch


def materialize(base: torch.Tensor, meta: torch.Tensor, host_row: torch.Tensor,
                table: torch.Tensor | None, delta: int, T: int, D: int) -> None:
    """In place: meta (N,) int64 = base (N,) int64 with its live positions advanced by delta >= 0
    (sections above); host_row (T,) int64 = table.view(-1)[meta[:T]] where meta[:T] >= 0, else -1;
    table: (R, W) int32 host page of each row set's positions (None: resident mode, every host
    row -1)."""
    if base.shape != meta.shape or base.dtype != torch.int64 or meta.dtype != torch.int64:
        raise ValueError(f"base {tuple(base.shape)} {base.dtype} and meta {tuple(meta.shape)} "
                         f"{meta.dtype} must be one int64 shape")
    if host_row.shape != (T,) or 3 * T + 4 * D > base.shape[0] or delta < 0:
        raise ValueError(f"host_row {tuple(host_row.shape)} must be ({T},), the sections of "
                         f"{T} tokens and {D} decode entries must fit {base.shape[0]}, delta "
                         f"{delta} must be >= 0")
    if meta.is_cuda:
        from . import triton_latent_plan
        triton_latent_plan.materialize(base, meta, host_row, table, delta, T, D)
        return
    m = base.clone()
    live = (slice(0, T), slice(T, 2 * T))
    for s in live:
        m[s] = torch.where(base[s] >= 0, base[s] + delta, base[s])
    s = slice(3 * T + 3 * D, 3 * T + 4 * D)
    m[s] = torch.where(base[s] > 0, base[s] + delta, base[s])
    meta.copy_(m)
    if table is None:
        host_row.fill_(-1)
        return
    src = m[:T]
    host_row.copy_(torch.where(src >= 0, table.view(-1)[src.clamp(min=0)].long(), -1))
