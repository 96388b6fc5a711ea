"""The gathers and scatters around RESOLVE (contract: reference.take_hot_rows / put_hot_rows).

CUDA: one Triton launch each (ops/triton_hot_rows.py), the hit/miss count folded into the first,
instead of ~20 small torch ops per layer; the same values. CPU: the references.
"""
from __future__ import annotations

import torch

from . import reference


def _check(sel: torch.Tensor, hot: torch.Tensor | None, rows: torch.Tensor,
           state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    Rd = sel.shape[0]
    if sel.dim() != 2 or sel.dtype != torch.int32:
        raise ValueError(f"sel must be (Rd, k) int32; got {tuple(sel.shape)} {sel.dtype}")
    if rows.shape != (Rd,) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be ({Rd},) int64; got {tuple(rows.shape)} {rows.dtype}")
    if hot is not None and (hot.dim() != 1 or hot.dtype not in (torch.int64, torch.bool)
                            or not hot.is_contiguous() or hot.device != sel.device
                            or (hot.dtype == torch.bool and hot.shape[0] != Rd)):
        raise ValueError(f"hot must be (Rh,) int64 indices or a ({Rd},) bool mask, contiguous on "
                         f"{sel.device}; got {tuple(hot.shape)} {hot.dtype} on {hot.device}")
    for name, t in zip(("slot_unit", "unit_slot", "lru_order"), state):
        if t.dim() != 2 or t.dtype != torch.int32 or t.stride(1) != 1 or t.device != sel.device:
            raise ValueError(f"{name} must be (N, *) int32 with a contiguous last dim on "
                             f"{sel.device}; got {tuple(t.shape)} {t.dtype} {t.stride()} {t.device}")
    for name, t in (("sel", sel), ("rows", rows)):
        if not t.is_contiguous() or t.device != sel.device:
            raise ValueError(f"{name} must be contiguous on {sel.device}")


def take_hot_rows(sel: torch.Tensor, hot: torch.Tensor | None, rows: torch.Tensor,
                  slot_unit: torch.Tensor, unit_slot: torch.Tensor, lru_order: torch.Tensor,
                  counts: torch.Tensor):
    """(sel[hot], slot_unit[r], unit_slot[r], lru_order[r]) with r = rows[hot] (hot: int64 indices,
    a bool mask or None = all rows), contiguous, and counts (2,) int64 += [hits, misses] of
    sel[hot]. Shapes: reference.take_hot_rows."""
    if not sel.is_cuda:
        return reference.take_hot_rows(sel, hot, rows, slot_unit, unit_slot, lru_order, counts)
    from . import triton_hot_rows
    _check(sel, hot, rows, (slot_unit, unit_slot, lru_order))
    if counts.shape != (2,) or counts.dtype != torch.int64 or counts.device != sel.device:
        raise ValueError(f"counts must be (2,) int64 on {sel.device}; got {tuple(counts.shape)} "
                         f"{counts.dtype} on {counts.device}")
    return triton_hot_rows.take_hot_rows(sel, hot, rows, slot_unit, unit_slot, lru_order, counts)


def put_hot_rows(locs: torch.Tensor, hot: torch.Tensor | None, rows: torch.Tensor,
                 hot_locs: torch.Tensor, su: torch.Tensor, us: torch.Tensor, lru: torch.Tensor,
                 slot_unit: torch.Tensor, unit_slot: torch.Tensor, lru_order: torch.Tensor) -> None:
    """locs[hot] = hot_locs (not when hot is None) and state rows rows[hot] = su, us, lru, in place:
    the inverse of take_hot_rows. locs (Rd, k) int32; hot_locs/su/us/lru as take_hot_rows gave."""
    if not locs.is_cuda:
        reference.put_hot_rows(locs, hot, rows, hot_locs, su, us, lru, slot_unit, unit_slot, lru_order)
        return
    from . import triton_hot_rows
    _check(locs, hot, rows, (slot_unit, unit_slot, lru_order))
    for name, t in (("hot_locs", hot_locs), ("su", su), ("us", us), ("lru", lru)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    triton_hot_rows.put_hot_rows(locs, hot, rows, hot_locs, su, us, lru, slot_unit, unit_slot,
                                 lru_order)
