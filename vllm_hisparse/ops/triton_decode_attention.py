"""The attention of a decode batch's sparse layer in two launches (Triton): sparse rows over their
selected pages plus their newest page (ops/triton_attention.py's split and combine), dense rows
over their whole paged context (ops/triton_dense_decode.py's split and ordered combine), each
program doing what its row's kind needs — instead of four launches, two of them inert for every
row of the other kind (each launch and the gap after it cost microseconds at one row, however
little it does: docs/gpu-results.md).

A row's programs run exactly the code of its kind's own kernels with the same split layout, and
the partial results only sit at a wider stride, so every row gets the bits
``triton_attention.sparse_decode_attention_newest`` / ``triton_dense_decode.dense_decode_attention``
give it (tests/test_decode_attention.py checks that, bit for bit). The plain-torch twin is
``kernels.decode_attention``'s CPU path (the two references)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import kv_dtype_ok
from . import triton_attention as ta
from . import triton_dense_decode as td


@triton.jit(do_not_specialize=["split_tokens", "n_sp", "ns"])
def _mixed_split_kernel(Q, KV, LOCS, UNITS, SP_SEQ, NEWEST, DN_SEQ, BT, PO, PML, HOST, HPT, ROWS,
                        MISSED,
                        scale, n_sel, n_tok, split_tokens, n_sp, ns,
                        s_qr, s_qh, s_kn, s_kc, s_ku, s_kh, s_lr, s_ur, s_br, s_hpt,
                        UNIT: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                        D: tl.constexpr, BLOCK: tl.constexpr, DBLOCK: tl.constexpr,
                        NSD: tl.constexpr, MIN: tl.constexpr, FETCH: tl.constexpr,
                        KP: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    if tl.load(SP_SEQ + r) > 0:
        if sp < n_sp:
            ta._split(Q, KV, LOCS, UNITS, SP_SEQ, NEWEST, SP_SEQ, PO, PML, scale, n_sel, n_tok,
                      split_tokens, ns, s_qr, s_qh, s_kn, s_kc, s_ku, s_kh, s_lr, s_ur,
                      s_kn, s_ku, s_kc, s_kh, r, UNIT, HKV, G, GP, D, BLOCK, True, True,
                      HOST, HPT, ROWS, MISSED, s_hpt, FETCH, KP)
    else:
        seq = tl.load(DN_SEQ + r)
        split_n = td._split_len(seq, NSD, MIN)
        start = sp * split_n
        if (seq > 0) & (start < seq):
            td._split(Q, KV, KV + s_kc, BT + r * s_br, PO, PML, scale, ns, r, h, sp, start, seq,
                      split_n, s_qr, s_qh, s_kn, s_ku, s_kh, s_kn, s_ku, s_kh,
                      UNIT, HKV, G, GP, D, DBLOCK)


@triton.jit(do_not_specialize=["n_sp", "ns"])
def _mixed_combine_kernel(PO, PML, SP_SEQ, DN_SEQ, OUT, n_sp, ns, s_or, s_oh, HQ: tl.constexpr,
                          D: tl.constexpr, SP: tl.constexpr, NSD: tl.constexpr,
                          MIN: tl.constexpr):
    r = tl.program_id(0)
    if tl.load(SP_SEQ + r) > 0:
        ta._combine(PO, PML, OUT, n_sp, ns, s_or, s_oh, r, HQ, D, SP)
    else:
        seq = tl.load(DN_SEQ + r)
        if seq > 0:
            td._combine(PO, PML, OUT, ns, s_or, s_oh, r, seq, HQ, D, td._split_len(seq, NSD, MIN))


def layout(R: int, Hkv: int, k: int, unit: int) -> tuple[int, int, int]:
    """(sparse splits, tokens per sparse split, partial slots per (row, head)) of a batch of R rows
    selecting k units of unit tokens (+ the newest unit)."""
    n_sp, split = ta.split_layout(R, Hkv, k * unit + unit)
    return n_sp, split, max(n_sp, td.SPLITS)


def partials_numel(R: int, Hq: int, Hkv: int, k: int, unit: int, D: int) -> tuple[int, int]:
    ns = layout(R, Hkv, k, unit)[2]
    return R * Hq * ns * D, R * Hq * ns * 2


def decode_attention(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                     locs: torch.Tensor, units: torch.Tensor, sp_seq: torch.Tensor,
                     newest: torch.Tensor, dn_seq: torch.Tensor, scale: float, out: torch.Tensor,
                     work: tuple, miss: tuple | None = None) -> torch.Tensor:
    """Rows with sp_seq > 0: sparse_decode_attention_newest(q, kv, locs, units, sp_seq, newest);
    rows with dn_seq > 0: dense_decode_attention(q, kv[:, 0], kv[:, 1], block_table, dn_seq);
    other rows' out left as they are. kv (N, 2, P, Hkv, D); block_table (R, W) int32 (W * P >=
    max dn_seq); locs/units (R, k) int32; sp_seq/dn_seq (R,) int; newest (R,) int; work (po, pml)
    of at least ``partials_numel`` elements. miss (rows (R,) int, host_pt (M, U) int32, host,
    missed (R,) int32: the select's, 0 for a row without a marked entry):
    locs entries -2 - block are pages copied from host[host_pt[rows[r], units[r, j]]] (host on the
    GPU: the pinned pool's CUDA alias, kv's page layout) into kv[block] by the split program that
    reads them, before its loop (kernels.decode_attention). No allocation, no host sync:
    capturable."""
    R, Hq, D = q.shape
    unit, Hkv = kv.shape[2], kv.shape[3]
    k = locs.shape[1]
    assert Hq % Hkv == 0 and D in (64, 128, 256) and kv.shape[4] == D and kv_dtype_ok(kv, q)
    assert q.stride(2) == 1 and kv.stride(4) == 1 and locs.stride(1) == 1 and units.stride(1) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    if R == 0:
        return out
    n_sp, split, ns = layout(R, Hkv, k, unit)
    po, pml = work
    assert po.numel() >= R * Hq * ns * D and pml.numel() >= R * Hq * ns * 2, "work too small"
    G = Hq // Hkv
    if miss is None:
        rows, host_pt, host, missed = sp_seq, locs, kv, locs   # not read (FETCH off)
    else:
        rows, host_pt, host, missed = miss
        assert missed.dtype == torch.int32 and missed.shape[0] >= R
        assert host.device == kv.device and host.dtype == kv.dtype and host.is_contiguous()
        assert kv.is_contiguous() and host.shape[1:] == kv.shape[1:], "host pages: kv's layout"
        assert host_pt.dtype == torch.int32 and host_pt.stride(1) == 1
    _mixed_split_kernel[(R, Hkv, ns)](
        q, kv, locs, units, sp_seq, newest, dn_seq, block_table, po, pml, host, host_pt, rows, missed,
        float(scale), k * unit, k * unit + unit, split, n_sp, ns,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        locs.stride(0), units.stride(0), block_table.stride(0), host_pt.stride(0),
        UNIT=unit, HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D,
        BLOCK=ta.BLOCK_N if D <= 128 else 32, DBLOCK=td.BLOCK_N if D <= 128 else 32,
        NSD=td.SPLITS, MIN=td.MIN_SPLIT, FETCH=miss is not None,
        KP=triton.next_power_of_2(max(k, 1)) if miss is not None else 1, num_warps=4, num_stages=2)
    _mixed_combine_kernel[(R, Hq)](po, pml, sp_seq, dn_seq, out, n_sp, ns, out.stride(0),
                                   out.stride(1), HQ=Hq, D=D, SP=ta.MAX_SPLITS, NSD=td.SPLITS,
                                   MIN=td.MIN_SPLIT)
    return out
