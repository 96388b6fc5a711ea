"""The decode write and the Quest page scores of a sparse layer in one launch (Triton).

A sparse layer's first two kernels were the decode write (one program per row: the new token into
its block, the host pool, the Quest bounds) and the Quest scores (programs (row, tile of BLOCK_U
pages)). Each launch of the decode path costs microseconds at one row however little it does
(docs/gpu-results.md), so this launch runs both: program (r, ub) scores tile ub of row r like
``triton_quest._quest_rows_kernel`` (live pages only), and the program whose tile holds row r's
newest page also writes row r's token like ``triton_decode_write._decode_write_kernel``.

Why one launch can do both without ordering them: a decode row scores only its complete pages
[0, full) (``full = (seq - 1) // page``: the newest page is read in place by the attention, never
selected), while the write folds the new key into page ``full`` alone, so no program reads what
another writes; and the tile holding page ``full`` has at most a page's worth of live pages left,
the least work of the row. Every row's bits are those of the two kernels: the same helpers run.
The plain-torch twin is reference.decode_write followed by reference.quest_scores
(ops/decode_ops.decode_write_score's CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode_write import _write_row, write_args
from .triton_quest import _quest_tile, block_u


@triton.jit
def _write_score_kernel(K, V, KV, BT, SEQ, DPAGE, QPAGE, DST, QMIN, QMAX, NEWEST,
                        s_kt, s_kh, s_vt, s_vh, s_bt, s_cb, s_cc, s_cp, s_ch, s_db, s_dc, s_dp,
                        s_dh, s_qp, s_qhd,
                        Q, ROWS, NUM, OUT, U, s_qr, s_qh, s_kn, s_ku, s_or,
                        PAGE: tl.constexpr, HKV: tl.constexpr, HB: tl.constexpr,
                        D: tl.constexpr, DP: tl.constexpr, HAS_DST: tl.constexpr,
                        HAS_Q: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                        HD: tl.constexpr, HDP: tl.constexpr, BLOCK_U: tl.constexpr):
    r = tl.program_id(0)
    ub = tl.program_id(1)
    n = tl.load(NUM + r)
    if ub == tl.minimum(n // BLOCK_U, tl.num_programs(1) - 1):
        _write_row(r, K, V, KV, BT, SEQ, DPAGE, QPAGE, DST, QMIN, QMAX, NEWEST,
                   s_kt, s_kh, s_vt, s_vh, s_bt, s_cb, s_cc, s_cp, s_ch, s_db, s_dc, s_dp, s_dh,
                   s_qp, s_qhd, PAGE, HKV, HB, D, DP, HAS_DST, HAS_Q)
    if ub * BLOCK_U < n:
        _quest_tile(Q, QMIN, QMAX, ROWS, OUT, U, s_qr, s_qh, s_kn, s_ku, s_or, r, ub, n,
                    G, GP, D, HD, HDP, BLOCK_U)


def write_score(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                seq: torch.Tensor, newest: torch.Tensor, dst: torch.Tensor | None,
                dst_page: torch.Tensor | None, kmin: torch.Tensor, kmax: torch.Tensor,
                q_page: torch.Tensor, q: torch.Tensor, rows: torch.Tensor,
                num_units: torch.Tensor, out: torch.Tensor) -> None:
    """Launch on checked inputs (ops/decode_ops.decode_write_score); also runs under
    TRITON_INTERPRET=1. decode_write's arguments (dst on the device), then
    quest_scores_rows(q, kmin, kmax, rows, num_units, out, live_only=True)'s (num_units: the rows'
    complete pages, at most the page of each row's new token)."""
    N = k.shape[0]
    if N == 0:
        return
    U, Hkv, D = kmin.shape[1], kmin.shape[2], kmin.shape[3]
    G = q.shape[1] // Hkv
    bu = block_u(Hkv, D)
    args, consts = write_args(kv, k, v, block_table, seq, newest, dst, dst_page, kmin, kmax,
                              q_page)
    _write_score_kernel[(N, triton.cdiv(U, bu))](
        *args, q, rows, num_units, out, U, q.stride(0), q.stride(1), kmin.stride(0),
        kmin.stride(1), out.stride(0), **consts, G=G, GP=max(2, triton.next_power_of_2(G)),
        HD=Hkv * D, HDP=triton.next_power_of_2(Hkv * D), BLOCK_U=bu, num_warps=4)
