"""Quest page-bound update in Triton: one launch folds a step's keys into kmin/kmax.

One program per touched page i (and block of the Hkv*D channels). The tokens of page i are the run
``tok_page == i``; tok_page is non-decreasing and every page has at least one token (the plan
builds it that way: a page's tokens are consecutive positions of one request), so the run starts in
``[i, i + T - m]`` and a binary search of ceil(log2(T - m + 1)) steps finds it: no step at all in
a pure decode batch (T == m, one token per page). The program takes the min/max of its tokens from
+-inf, folds in the old bounds unless the page restarts here, and stores. min/max are exact, so the
bounds are the same bits as the torch reference (reference.quest_update_pages) whatever the order;
NaN propagates as in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMS = 4096   # BLOCK_T * BLOCK_C per loop step (32 fp32 per thread per bound at 4 warps; a guess)
MAX_BLOCK_T = 16    # tokens per loop step: a page of 16 tokens in one step (a guess)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _run_start(TOKP, v, T, extra, NIT):
    """First j with tok_page[j] >= v; it lies in [v, min(v + extra, T)] (every page has a token)."""
    lo = v
    hi = tl.minimum(v + extra, T)
    for _ in range(NIT):
        go = lo < hi
        mid = (lo + hi) // 2
        x = tl.load(TOKP + mid, mask=go, other=0)
        up = go & (x < v)
        lo = tl.where(up, mid + 1, lo)
        hi = tl.where(go & (x >= v), mid, hi)
    return lo


@triton.jit(do_not_specialize=["T", "M", "NIT"])
def _quest_update_kernel(KMIN, KMAX, PAGE, NEW, TOKP, K, T, M, NIT, U, HD,
                         s_br, s_bu, s_bh, s_bd, s_kt, s_kh, s_kd,
                         D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    cb = tl.program_id(1)
    extra = T - M
    t0 = _run_start(TOKP, i, T, extra, NIT)
    t1 = _run_start(TOKP, i + 1, T, extra, NIT)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < HD
    h = c // D
    d = c - h * D
    koff = h * s_kh + d * s_kd
    mn = tl.full([BLOCK_C], float("inf"), tl.float32)
    mx = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for ts in range(t0, t1, BLOCK_T):
        t = ts + tl.arange(0, BLOCK_T)
        m2 = (t < t1)[:, None] & cmask[None, :]
        x = tl.load(K + t.to(tl.int64)[:, None] * s_kt + koff[None, :], mask=m2, other=0.0).to(tl.float32)
        mn = _min_nan(mn, tl.reduce(tl.where(m2, x, float("inf")), 0, _min_nan))
        mx = _max_nan(mx, tl.reduce(tl.where(m2, x, float("-inf")), 0, _max_nan))
    flat = tl.load(PAGE + i)
    keep = tl.load(NEW + i) == 0                     # the page continues: fold the old bounds in
    boff = (flat // U) * s_br + (flat % U) * s_bu + h * s_bh + d * s_bd
    # +-inf for a restarting page leaves the step's value unchanged (bits and NaN included)
    mn = _min_nan(tl.load(KMIN + boff, mask=cmask & keep, other=float("inf")).to(tl.float32), mn)
    mx = _max_nan(tl.load(KMAX + boff, mask=cmask & keep, other=float("-inf")).to(tl.float32), mx)
    tl.store(KMIN + boff, mn.to(KMIN.dtype.element_ty), mask=cmask)
    tl.store(KMAX + boff, mx.to(KMAX.dtype.element_ty), mask=cmask)


def quest_update_pages(kmin: torch.Tensor, kmax: torch.Tensor, page_flat: torch.Tensor,
                       page_new: torch.Tensor, tok_page: torch.Tensor, k: torch.Tensor) -> None:
    """Launch on already-checked inputs (ops/quest_update.py checks them); runs under TRITON_INTERPRET=1.

    kmin/kmax: (R, U, Hkv, D) same strides; page_flat: (m,) int64 distinct row * U + page, m >= 1;
    page_new: (m,) bool; tok_page: (T,) int64, non-decreasing, every value in [0, m) present;
    k: (T, Hkv, D) kmin's dtype (values are stored as loaded: exact for min/max).
    """
    m, T = page_flat.shape[0], tok_page.shape[0]
    U, Hkv, D = kmin.shape[1], kmin.shape[2], kmin.shape[3]
    extra = T - m                                  # tokens beyond one per page
    bt = min(MAX_BLOCK_T, max(2, triton.next_power_of_2(extra + 1)))
    bc = min(triton.next_power_of_2(Hkv * D), max(64, TILE_ELEMS // bt))
    _quest_update_kernel[(m, triton.cdiv(Hkv * D, bc))](
        kmin, kmax, page_flat, page_new, tok_page, k, T, m, max(extra, 0).bit_length(), U, Hkv * D,
        kmin.stride(0), kmin.stride(1), kmin.stride(2), kmin.stride(3),
        k.stride(0), k.stride(1), k.stride(2),
        D=D, BLOCK_T=bt, BLOCK_C=bc, num_warps=4)
