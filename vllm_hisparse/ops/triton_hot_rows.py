"""The gathers and scatters around RESOLVE in Triton: one launch before (the hot rows' selections
and LRU state rows, and the hit/miss count) and one after (state rows and device slots back).

RESOLVE (csrc/resolve.cu) works on (Rh, *) tensors of the hot rows, while the state lives in
(N, *) tensors over every runtime row; in torch the round trip is ~20 small ops per layer. Pure
data movement plus an integer count (atomics on integers are exact): the same values as the torch
reference (reference.take_hot_rows / put_hot_rows). Program (i, b) moves column block b of hot
row i of every tensor; the count is done by the programs that hold selection columns. The hot rows
are given as indices into the decode rows, or as a bool mask over them (CUDA graphs: fixed shapes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024   # int32 columns per program (a guess; U = 2048 pages -> 2 programs per row)


@triton.jit
def _hot_row(HOT, ROWS, i, HOT_MODE: tl.constexpr):
    """Hot row i -> (its decode row j, its runtime row)."""
    if HOT_MODE == 1:                                  # HOT: indices of the hot decode rows
        j = tl.load(HOT + i)
    else:                                              # every row (HOT_MODE 2: a bool mask)
        j = i
    return j, tl.load(ROWS + j).to(tl.int64)


@triton.jit
def _take_kernel(SEL, HOT, ROWS, SU, US, LRU, COUNTS, SEL_H, SU_H, US_H, LRU_H, K, S, U,
                 s_sel, s_su, s_us, s_lru, HOT_MODE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j, row = _hot_row(HOT, ROWS, i, HOT_MODE)
    i64 = i.to(tl.int64)
    m = c < S
    tl.store(SU_H + i64 * S + c, tl.load(SU + row * s_su + c, mask=m), mask=m)
    tl.store(LRU_H + i64 * S + c, tl.load(LRU + row * s_lru + c, mask=m), mask=m)
    m = c < U
    tl.store(US_H + i64 * U + c, tl.load(US + row * s_us + c, mask=m), mask=m)
    if tl.program_id(1) * BLOCK < K:
        m = c < K
        if HOT_MODE == 2:
            m = m & (tl.load(HOT + i) != 0)            # a cold row selects nothing here
        s = tl.load(SEL + j.to(tl.int64) * s_sel + c, mask=m, other=-1)
        tl.store(SEL_H + i64 * K + c, s, mask=c < K)
        valid = s >= 0
        was = tl.load(US + row * s_us + s, mask=valid, other=-1) >= 0
        tl.atomic_add(COUNTS, tl.sum((valid & was).to(tl.int64), 0))
        tl.atomic_add(COUNTS + 1, tl.sum((valid & ~was).to(tl.int64), 0))


@triton.jit
def _put_kernel(LOCS, HOT, ROWS, LOCS_H, SU_H, US_H, LRU_H, SU, US, LRU, K, S, U,
                s_locs, s_su, s_us, s_lru, HOT_MODE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j, row = _hot_row(HOT, ROWS, i, HOT_MODE)
    i64 = i.to(tl.int64)
    m = c < S
    tl.store(SU + row * s_su + c, tl.load(SU_H + i64 * S + c, mask=m), mask=m)
    tl.store(LRU + row * s_lru + c, tl.load(LRU_H + i64 * S + c, mask=m), mask=m)
    m = c < U
    tl.store(US + row * s_us + c, tl.load(US_H + i64 * U + c, mask=m), mask=m)
    if HOT_MODE != 0:                                  # HOT_MODE 0: RESOLVE wrote LOCS itself
        m = c < K
        if HOT_MODE == 2:
            m = m & (tl.load(HOT + i) != 0)
        tl.store(LOCS + j.to(tl.int64) * s_locs + c, tl.load(LOCS_H + i64 * K + c, mask=m), mask=m)


def _grid(Rh: int, K: int, S: int, U: int):
    return (Rh, triton.cdiv(max(K, S, U, 1), BLOCK))


def _mode(hot: torch.Tensor | None) -> int:
    return 0 if hot is None else 2 if hot.dtype == torch.bool else 1


def take_hot_rows(sel: torch.Tensor, hot: torch.Tensor | None, rows: torch.Tensor,
                  slot_unit: torch.Tensor, unit_slot: torch.Tensor, lru_order: torch.Tensor,
                  counts: torch.Tensor):
    """reference.take_hot_rows in one launch (inputs checked by ops/hot_rows.py; state tensors
    with a contiguous last dim). Returns contiguous (sel_h, su, us, lru)."""
    Rh = hot.shape[0] if _mode(hot) == 1 else sel.shape[0]
    K, S, U = sel.shape[1], slot_unit.shape[1], unit_slot.shape[1]
    dev = sel.device
    sel_h = torch.empty((Rh, K), dtype=sel.dtype, device=dev)
    su = torch.empty((Rh, S), dtype=slot_unit.dtype, device=dev)
    us = torch.empty((Rh, U), dtype=unit_slot.dtype, device=dev)
    lru = torch.empty((Rh, S), dtype=lru_order.dtype, device=dev)
    if Rh:
        _take_kernel[_grid(Rh, K, S, U)](
            sel, rows if hot is None else hot, rows, slot_unit, unit_slot, lru_order, counts,
            sel_h, su, us, lru, K, S, U, sel.stride(0), slot_unit.stride(0), unit_slot.stride(0),
            lru_order.stride(0), HOT_MODE=_mode(hot), BLOCK=BLOCK, num_warps=4)
    return sel_h, su, us, lru


def put_hot_rows(locs: torch.Tensor, hot: torch.Tensor | None, rows: torch.Tensor,
                 hot_locs: torch.Tensor, su: torch.Tensor, us: torch.Tensor, lru: torch.Tensor,
                 slot_unit: torch.Tensor, unit_slot: torch.Tensor, lru_order: torch.Tensor) -> None:
    """reference.put_hot_rows in one launch (su/us/lru/hot_locs contiguous, as take_hot_rows and
    RESOLVE leave them)."""
    Rh, K = hot_locs.shape
    S, U = slot_unit.shape[1], unit_slot.shape[1]
    if Rh:
        _put_kernel[_grid(Rh, K, S, U)](
            locs, rows if hot is None else hot, rows, hot_locs, su, us, lru, slot_unit, unit_slot,
            lru_order, K, S, U, locs.stride(0), slot_unit.stride(0), unit_slot.stride(0),
            lru_order.stride(0), HOT_MODE=_mode(hot), BLOCK=BLOCK, num_warps=4)
