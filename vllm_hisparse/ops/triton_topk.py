"""Top-k indices of each row of a score matrix in one Triton program per row (radix select).

Replaces torch.topk on the decode path: for one 32K request (2081 page scores, k = 127) torch's
gatherTopK + radix sort took ~22 us per layer on the H200 (docs/gpu-results.md), longer than the
Quest scores themselves. Here each program holds its row in registers and finds the k-th largest
value bit by bit (32 block reductions over an order-preserving integer key), then keeps every value
above it and the first ties in index order: contract ``reference.topk_index`` (ascending indices,
ties to the lowest index), so the result is the same whatever the launch. Rows up to MAX_U scores;
longer rows take the reference (torch sort) instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_U = 16384     # scores per row held by one program (256K tokens of 16-token pages)


@triton.jit
def _topk_kernel(S, OUT, U, K, s_sr, s_or, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    live = o < U
    x = tl.load(S + r * s_sr + o, mask=live, other=0.0)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    # order-preserving key in [0, 2^32): negatives flipped, positives above them; padding = -1
    key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = tl.where(live, key, -1)
    t = tl.zeros([], tl.int64)          # the largest t with count(key >= t) >= K: the K-th key
    for b in tl.static_range(31, -1, -1):
        cand = t | (1 << b)
        n = tl.sum((key >= cand).to(tl.int32), 0)
        t = tl.where(n >= K, cand, t)
    gt = key > t
    eq = key == t
    need = K - tl.sum(gt.to(tl.int32), 0)
    eq_i = eq.to(tl.int32)
    take = gt | (eq & (tl.cumsum(eq_i, 0) - eq_i < need))
    take_i = take.to(tl.int32)
    pos = tl.cumsum(take_i, 0) - take_i
    tl.store(OUT + r * s_or + pos, o.to(tl.int64), mask=take)


def topk_index(scores: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """Launch on already-checked inputs (ops/quest.py checks them); also runs under
    TRITON_INTERPRET=1. scores: (R, U) fp32, last dim contiguous, U <= MAX_U; 0 < k <= U;
    out: (R, k) int64, last dim contiguous."""
    R, U = scores.shape
    if R == 0 or k == 0:
        return out
    block = max(16, triton.next_power_of_2(U))
    _topk_kernel[(R,)](scores, out, U, k, scores.stride(0), out.stride(0), BLOCK=block,
                       num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return out
