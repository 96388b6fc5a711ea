"""Quest page scores in Triton, reading the per-page key bounds of each row through a row index.

score[r, u] = sum_h sum_g sum_d max(q[r, h*G+g, d] * kmin[row, u, h, d], q[r, h*G+g, d] * kmax[row, u, h, d])
with row = rows[r]. Where kmin <= kmax (true of every page that quest_update has written) the term
is q*kmax for q >= 0 and q*kmin for q < 0, so the sum over the G query heads of a group folds into
the query before the bounds are touched:

    sum_g max(q_g*mn, q_g*mx) = (sum_g max(q_g, 0)) * mx + (sum_g min(q_g, 0)) * mn

Two FMAs per bound pair whatever G is, so the kernel streams kmin/kmax at memory speed instead of
doing 4*G fp32 ops per pair. Everything is fp32 after the load.

Each program takes one row and BLOCK_U pages, each page's Hkv x D bounds (contiguous in memory) in
one load; BLOCK_U depends only on the shape, and nothing is shared between programs (no atomics),
so a row's scores are the same bits whichever other rows are in the batch. Pages at or past
num_units[r] are never read and score -inf (or, ``live_only``, are not written at all).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMS = 4096  # BLOCK_U * Hkv * D per program: 32 fp32 per thread per bound at 4 warps (a
                   # guess; faster than the head-by-head loop it replaced: docs/gpu-results.md)


@triton.jit
def _quest_rows_kernel(Q, KMIN, KMAX, ROWS, NUM, OUT, U, s_qr, s_qh, s_kn, s_ku, s_or,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, HD: tl.constexpr,
                       HDP: tl.constexpr, BLOCK_U: tl.constexpr, LIVE_ONLY: tl.constexpr):
    r = tl.program_id(0)
    ub = tl.program_id(1)
    n = tl.load(NUM + r)
    go = True
    if LIVE_ONLY:                       # pages past n are not written: nothing to do here
        go = ub * BLOCK_U < n
    if go:
        _quest_tile(Q, KMIN, KMAX, ROWS, OUT, U, s_qr, s_qh, s_kn, s_ku, s_or, r, ub, n,
                    G, GP, D, HD, HDP, BLOCK_U)


@triton.jit
def _quest_tile(Q, KMIN, KMAX, ROWS, OUT, U, s_qr, s_qh, s_kn, s_ku, s_or, r, ub, n,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, HD: tl.constexpr,
                HDP: tl.constexpr, BLOCK_U: tl.constexpr):
    row = tl.load(ROWS + r).to(tl.int64)
    oc = tl.arange(0, HDP)              # (KV head, d) of a page's Hkv x D bounds, in memory order
    og = tl.arange(0, GP)
    cm = oc < HD
    h = oc // D
    q = tl.load(Q + r.to(tl.int64) * s_qr + (h[None, :] * G + og[:, None]) * s_qh
                + (oc - h * D)[None, :], mask=(og < G)[:, None] & cm[None, :],
                other=0.0).to(tl.float32)
    qp = tl.sum(tl.maximum(q, 0.0), 0)
    qn = tl.sum(tl.minimum(q, 0.0), 0)
    ou = ub * BLOCK_U + tl.arange(0, BLOCK_U)
    live = (ou < n) & (ou < U)
    koff = row * s_kn + ou.to(tl.int64)[:, None] * s_ku + oc[None, :]
    m = live[:, None] & cm[None, :]
    mn = tl.load(KMIN + koff, mask=m, other=0.0).to(tl.float32)
    mx = tl.load(KMAX + koff, mask=m, other=0.0).to(tl.float32)
    s = tl.where(live, tl.sum(mx * qp[None, :] + mn * qn[None, :], 1), float("-inf"))
    tl.store(OUT + r.to(tl.int64) * s_or + ou, s, mask=ou < U)


def block_u(Hkv: int, D: int) -> int:
    """Pages per program: a function of the shape only (a row's bits must not depend on the
    batch); every page's Hkv x D bounds in one load (one 32K row of Llama-3-8B: 512 programs)."""
    return max(1, TILE_ELEMS // triton.next_power_of_2(Hkv * D))


def quest_scores_rows(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor,
                      num_units: torch.Tensor, out: torch.Tensor,
                      live_only: bool = False) -> torch.Tensor:
    """Launch on already-checked inputs (ops/quest.py checks them); also runs under TRITON_INTERPRET=1.

    q: (R, Hq, D) fp16/bf16/fp32, last dim contiguous; kmin/kmax: (N, U, Hkv, D), same strides,
    each page's (Hkv, D) contiguous; rows: (R,) int64; num_units: (R,) int32/int64; out: (R, U)
    fp32, last dim contiguous; live_only: pages at or past num_units[r] are not written.
    Precondition for the reference's exact formula: kmin <= kmax on pages < num_units.
    """
    R, Hq, D = q.shape
    U, Hkv = kmin.shape[1], kmin.shape[2]
    if R == 0 or U == 0:
        return out
    G = Hq // Hkv
    bu = block_u(Hkv, D)
    _quest_rows_kernel[(R, triton.cdiv(U, bu))](
        q, kmin, kmax, rows, num_units, out, U, q.stride(0), q.stride(1), kmin.stride(0),
        kmin.stride(1), out.stride(0), G=G, GP=max(2, triton.next_power_of_2(G)), D=D,
        HD=Hkv * D, HDP=triton.next_power_of_2(Hkv * D), BLOCK_U=bu, LIVE_ONLY=live_only,
        num_warps=4)
    return out
