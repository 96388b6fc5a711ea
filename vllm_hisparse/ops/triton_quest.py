"""Quest page scores in Triton, reading the per-page key bounds of each row through a row index.

score[r, u] = sum_h sum_g sum_d max(q[r, h*G+g, d] * kmin[row, u, h, d], q[r, h*G+g, d] * kmax[row, u, h, d])
with row = rows[r]. Where kmin <= kmax (true of every page that quest_update has written) the term
is q*kmax for q >= 0 and q*kmin for q < 0, so the sum over the G query heads of a group folds into
the query before the bounds are touched:

    sum_g max(q_g*mn, q_g*mx) = (sum_g max(q_g, 0)) * mx + (sum_g min(q_g, 0)) * mn

Two FMAs per bound pair whatever G is, so the kernel streams kmin/kmax at memory speed instead of
doing 4*G fp32 ops per pair. Everything is fp32 after the load.

Each program takes one row and BLOCK_U pages and loops over the KV heads in order; BLOCK_U depends
only on D, and nothing is shared between programs (no atomics), so a row's scores are the same bits
whichever other rows are in the batch. Pages at or past num_units[r] are never read and score -inf.

``topk_pages``: top-k indices over the scores -> int32 pages with -1 padding (and the
pages' blocks from a block table), one launch for what took ~10 small torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMS = 4096  # BLOCK_U * D per head step: 32 fp32 per thread per tensor at 4 warps, ~121
                   # registers on sm_90 (ptxas), no spills; a guess, not yet benchmarked


@triton.jit
def _quest_rows_kernel(Q, KMIN, KMAX, ROWS, NUM, OUT, U, HKV,
                       s_qr, s_qh, s_kn, s_ku, s_kh, s_or,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                       BLOCK_U: tl.constexpr):
    r = tl.program_id(0)
    ub = tl.program_id(1)
    n = tl.load(NUM + r)
    row = tl.load(ROWS + r).to(tl.int64)
    ou = ub * BLOCK_U + tl.arange(0, BLOCK_U)
    od = tl.arange(0, DP)
    og = tl.arange(0, GP)
    live = (ou < n) & (ou < U)
    dmask = od < D
    kmask = live[:, None] & dmask[None, :]
    qmask = (og < G)[:, None] & dmask[None, :]
    koff = row * s_kn + ou.to(tl.int64)[:, None] * s_ku + od[None, :]
    qoff = r.to(tl.int64) * s_qr + og[:, None] * s_qh + od[None, :]
    acc = tl.zeros([BLOCK_U, DP], tl.float32)
    for h in range(HKV):
        q = tl.load(Q + qoff + h * G * s_qh, mask=qmask, other=0.0).to(tl.float32)
        qp = tl.sum(tl.maximum(q, 0.0), 0)
        qn = tl.sum(tl.minimum(q, 0.0), 0)
        mn = tl.load(KMIN + koff + h * s_kh, mask=kmask, other=0.0).to(tl.float32)
        mx = tl.load(KMAX + koff + h * s_kh, mask=kmask, other=0.0).to(tl.float32)
        acc += mx * qp[None, :] + mn * qn[None, :]
    s = tl.where(live, tl.sum(acc, 1), float("-inf"))
    tl.store(OUT + r.to(tl.int64) * s_or + ou, s, mask=ou < U)


def block_u(D: int) -> int:
    """Pages per program: a function of D only (a row's bits must not depend on the batch)."""
    return max(16, TILE_ELEMS // triton.next_power_of_2(D))


def quest_scores_rows(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor,
                      num_units: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch on already-checked inputs (ops/quest.py checks them); also runs under TRITON_INTERPRET=1.

    q: (R, Hq, D) fp16/bf16/fp32, last dim contiguous; kmin/kmax: (N, U, Hkv, D), same strides,
    last dim contiguous; rows: (R,) int64; num_units: (R,) int32/int64; out: (R, U) fp32, last dim
    contiguous. Precondition for the reference's exact formula: kmin <= kmax on pages < num_units.
    """
    R, Hq, D = q.shape
    U, Hkv = kmin.shape[1], kmin.shape[2]
    if R == 0 or U == 0:
        return out
    G = Hq // Hkv
    bu = block_u(D)
    _quest_rows_kernel[(R, triton.cdiv(U, bu))](
        q, kmin, kmax, rows, num_units, out, U, Hkv,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), out.stride(0),
        G=G, GP=max(2, triton.next_power_of_2(G)), D=D, DP=triton.next_power_of_2(D),
        BLOCK_U=bu, num_warps=4)
    return out


@triton.jit
def _topk_pages_kernel(IDX, NUM, OUT, BT, BLK, kk, K, s_ir, s_or, s_br, s_bc, s_lr,
                       HAS_BT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(NUM + r)
    x = tl.load(IDX + r.to(tl.int64) * s_ir + j, mask=j < kk, other=-1)
    page = tl.where((j < kk) & (x < n), x, -1)
    tl.store(OUT + r.to(tl.int64) * s_or + j, page.to(tl.int32), mask=j < K)
    if HAS_BT:
        b = tl.load(BT + r.to(tl.int64) * s_br + page * s_bc, mask=(j < K) & (page >= 0), other=-1)
        tl.store(BLK + r.to(tl.int64) * s_lr + j, b.to(tl.int32), mask=j < K)


def topk_pages(idx: torch.Tensor, num_full: torch.Tensor, out: torch.Tensor,
               block_table: torch.Tensor | None = None, blocks: torch.Tensor | None = None) -> None:
    """One launch of reference.topk_pages into out (R, K) int32 (and blocks (R, K) int32 when
    block_table (R, W) is given), on already-checked inputs; also runs under TRITON_INTERPRET=1.

    idx: (R, kk) int64, last dim contiguous, kk <= K; num_full: (R,) int; out/blocks last dim
    contiguous.
    """
    R, K = out.shape
    if R == 0 or K == 0:
        return
    bs = min(1024, triton.next_power_of_2(K))
    has_bt = block_table is not None
    bt = block_table if has_bt else out
    bl = blocks if has_bt else out
    _topk_pages_kernel[(R, triton.cdiv(K, bs))](
        idx, num_full, out, bt, bl, idx.shape[1], K, idx.stride(0), out.stride(0),
        bt.stride(0), bt.stride(1), bl.stride(0), HAS_BT=has_bt, BLOCK=bs, num_warps=4)
