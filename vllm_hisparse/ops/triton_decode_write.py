"""The new token of every decode row, written where it belongs, in one launch (Triton).

Row r of a decode batch (one query token, at position seq[r] - 1) stores its K/V into its newest
block of the paged cache (the block table's entry for that position), into a second paged pool
when the row has a page there (the pinned host pool through a UVA alias, or the dense-layer GPU
pool), and folds its key into the Quest page bounds (min/max per page; a page restarts at its first
token). It also reports the newest block, which the sparse attention reads in place. Rows with
seq 0 (vLLM's padding) write nothing and report block -1.

Pure data movement plus exact min/max: the plain-torch reference is ``reference.decode_write``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_write_kernel(K, V, KV, BT, SEQ, DPAGE, QPAGE, DST, QMIN, QMAX, NEWEST,
                         s_kt, s_kh, s_vt, s_vh, s_bt, s_cb, s_cc, s_cp, s_ch, s_db, s_dc, s_dp, s_dh,
                         s_qp, s_qh,
                         PAGE: tl.constexpr, HKV: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                         DP: tl.constexpr, HAS_DST: tl.constexpr, HAS_Q: tl.constexpr):
    _write_row(tl.program_id(0), K, V, KV, BT, SEQ, DPAGE, QPAGE, DST, QMIN, QMAX, NEWEST,
               s_kt, s_kh, s_vt, s_vh, s_bt, s_cb, s_cc, s_cp, s_ch, s_db, s_dc, s_dp, s_dh,
               s_qp, s_qh, PAGE, HKV, HB, D, DP, HAS_DST, HAS_Q)


@triton.jit
def _write_row(r, K, V, KV, BT, SEQ, DPAGE, QPAGE, DST, QMIN, QMAX, NEWEST,
               s_kt, s_kh, s_vt, s_vh, s_bt, s_cb, s_cc, s_cp, s_ch, s_db, s_dc, s_dp, s_dh,
               s_qp, s_qh, PAGE: tl.constexpr, HKV: tl.constexpr, HB: tl.constexpr,
               D: tl.constexpr, DP: tl.constexpr, HAS_DST: tl.constexpr, HAS_Q: tl.constexpr):
    """Row r's new token (the whole of _decode_write_kernel's program r; also run by one program
    per row of ops/triton_write_score.py's fused launch)."""
    seq = tl.load(SEQ + r)
    if seq > 0:
        pos = seq - 1
        page = pos // PAGE
        off = pos - page * PAGE
        blk = tl.load(BT + r.to(tl.int64) * s_bt + page)
        tl.store(NEWEST + r, blk.to(tl.int32))
        oh = tl.arange(0, HB)
        od = tl.arange(0, DP)
        m = (oh < HKV)[:, None] & (od < D)[None, :]
        k = tl.load(K + r.to(tl.int64) * s_kt + oh[:, None] * s_kh + od[None, :], mask=m)
        v = tl.load(V + r.to(tl.int64) * s_vt + oh[:, None] * s_vh + od[None, :], mask=m)
        hd = oh[:, None] * s_ch + od[None, :]
        c = KV + blk.to(tl.int64) * s_cb + off * s_cp + hd
        tl.store(c, k.to(KV.dtype.element_ty), mask=m)
        tl.store(c + s_cc, v.to(KV.dtype.element_ty), mask=m)
        if HAS_DST:
            dp = tl.load(DPAGE + r)
            if dp >= 0:
                d = DST + dp.to(tl.int64) * s_db + off * s_dp + oh[:, None] * s_dh + od[None, :]
                tl.store(d, k.to(DST.dtype.element_ty), mask=m)
                tl.store(d + s_dc, v.to(DST.dtype.element_ty), mask=m)
        if HAS_Q:
            qp = tl.load(QPAGE + r)
            if qp >= 0:
                qo = qp.to(tl.int64) * s_qp + oh[:, None] * s_qh + od[None, :]
                kq = k.to(QMIN.dtype.element_ty)
                if off == 0:                       # the page's first token: its bounds restart
                    tl.store(QMIN + qo, kq, mask=m)
                    tl.store(QMAX + qo, kq, mask=m)
                else:
                    tl.store(QMIN + qo, tl.minimum(tl.load(QMIN + qo, mask=m), kq), mask=m)
                    tl.store(QMAX + qo, tl.maximum(tl.load(QMAX + qo, mask=m), kq), mask=m)
    else:
        tl.store(NEWEST + r, -1)


def decode_write(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                 seq: torch.Tensor, newest: torch.Tensor, dst: torch.Tensor | None = None,
                 dst_page: torch.Tensor | None = None, kmin: torch.Tensor | None = None,
                 kmax: torch.Tensor | None = None, q_page: torch.Tensor | None = None) -> None:
    """Launch on checked inputs (ops/decode_ops.py); also runs under TRITON_INTERPRET=1. Shapes as
    reference.decode_write; dst on the device (a pinned host pool as its CUDA alias)."""
    N = k.shape[0]
    if N == 0:
        return
    args, consts = write_args(kv, k, v, block_table, seq, newest, dst, dst_page, kmin, kmax,
                              q_page)
    _decode_write_kernel[(N,)](*args, **consts, num_warps=2)


def write_args(kv, k, v, block_table, seq, newest, dst, dst_page, kmin, kmax, q_page):
    """(arguments, constexprs) of ``_write_row`` after its row: decode_write's inputs as tensors
    and strides (absent pools replaced by inert stand-ins)."""
    P, Hkv, D = kv.shape[2], kv.shape[3], kv.shape[4]
    has_dst, has_q = dst is not None, kmin is not None
    d = dst if has_dst else kv
    qm, qx = (kmin, kmax) if has_q else (kv, kv)
    args = (k, v, kv, block_table, seq, dst_page if has_dst else seq, q_page if has_q else seq,
            d, qm, qx, newest,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_table.stride(0),
            kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            d.stride(0), d.stride(1), d.stride(2), d.stride(3),
            qm.stride(1) if has_q else 0, qm.stride(2) if has_q else 0)
    consts = dict(PAGE=P, HKV=Hkv, HB=triton.next_power_of_2(Hkv), D=D,
                  DP=triton.next_power_of_2(D), HAS_DST=has_dst, HAS_Q=has_q)
    return args, consts
