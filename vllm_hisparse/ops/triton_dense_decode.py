"""Dense decode attention over a paged cache with split-KV that stays batch-invariant (Triton).

One query token per row attends its first ``seq_k[r]`` keys, read through its block table. Why not
FlashAttention: called with split-KV its split count is chosen per call from the whole batch, so a
row's result would depend on which rows share the call (and hisparse and resident mode group rows
differently); called with ``num_splits=1`` (as for prefill) it runs one CTA per KV head, 8 CTAs for
one Llama-3-8B row, slow for a few rows (docs/gpu-results.md). Here the
keys of row r are cut into at most ``SPLITS`` splits of ``split_len(seq_k[r])`` keys each (a
function of the row's own length: a 4K row gets 32 splits of 128 keys, 256 programs for one
Llama-3-8B row, where fixed 512-key splits gave it 64 programs of 8 steps each: too few for one
row, docs/gpu-results.md) — and the partial results are combined one split
after the other in that order, so a row's output is a function of its own query and keys alone:
not of the batch, the block-table width or the call. Programs past a row's last key return at once. The plain-torch reference is
``ops.reference.dense_decode_attention`` (equal up to fp32 summation order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import kv_dtype_ok
from .head_sizes import DENSE_DECODE_HEAD_SIZES
from .triton_online_softmax import online_softmax_step, partials, store_partials

SPLITS = 32           # splits per row at most (the grid's third dimension)
MIN_SPLIT = 128       # keys per split at least (a multiple of both inner-step sizes, 64 and 32)
BLOCK_N = 64          # keys per inner step
WARPS, STAGES = 4, 2  # the split kernel's launch (bench.dense_tune sweeps these and the three above)


@triton.jit
def _split_len(seq, NS: tl.constexpr, MIN: tl.constexpr):
    """Keys per split of a row of seq keys: seq / NS rounded up to a multiple of MIN (>= MIN)."""
    per = (seq + NS - 1) // NS
    return tl.maximum((per + MIN - 1) // MIN, 1) * MIN


def split_len(seq: int) -> int:
    """Host twin of ``_split_len`` (tests, docs)."""
    per = -(-seq // SPLITS)
    return max(-(-per // MIN_SPLIT), 1) * MIN_SPLIT


@triton.jit
def _dense_split_kernel(Q, K, V, BT, BT_ROWS, SEQ, PO, PML, scale, n_splits,
                        s_qr, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_br,
                        PAGE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                        D: tl.constexpr, NS: tl.constexpr, MIN: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_BT_ROWS: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    seq = tl.load(SEQ + r)
    split_n = _split_len(seq, NS, MIN)
    start = sp * split_n
    if start < seq:                         # else nothing here: the combine reads live splits only
        bt = BT + r * s_br
        if HAS_BT_ROWS:                     # row r reads table row BT_ROWS[r]
            bt = BT + tl.load(BT_ROWS + r).to(tl.int64) * s_br
        _split(Q, K, V, bt, PO, PML, scale, n_splits, r, h, sp, start, seq, split_n,
               s_qr, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh,
               PAGE, HKV, G, GP, D, BLOCK)


@triton.jit
def _split(Q, K, V, BT, PO, PML, scale, n_splits, r, h, sp, start, seq, split_n,
           s_qr, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh,
           PAGE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
           D: tl.constexpr, BLOCK: tl.constexpr):
    og = tl.arange(0, GP)
    od = tl.arange(0, D)
    gmask = og < G
    q = tl.load(Q + r * s_qr + (h * G + og)[:, None] * s_qh + od[None, :], mask=gmask[:, None],
                other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    end = tl.minimum(start + split_n, seq)
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        live = t < end
        j = t // PAGE
        off = t - j * PAGE
        blk = tl.load(BT + j, mask=live, other=0).to(tl.int64)
        kt = tl.load(K + (blk * s_kn + off * s_kp + h * s_kh)[:, None] + od[None, :],
                     mask=live[:, None], other=0.0)
        vt = tl.load(V + (blk * s_vn + off * s_vp + h * s_vh)[:, None] + od[None, :],
                     mask=live[:, None], other=0.0)
        m_i, l_i, acc = online_softmax_step(q, kt, vt, live, scale, m_i, l_i, acc)
    hq = h * G + og
    store_partials(PO, PML, ((r * (HKV * G) + hq) * n_splits + sp).to(tl.int64), acc, m_i, l_i,
                   gmask, od, D)


@triton.jit
def _two_split_kernel(Q, KV, BT, SEQ, KV2, BT2, ROWS2, SEQ2, PO, PML, scale, n_splits,
                      s_qr, s_qh, s_n, s_c, s_p, s_h, s_br, s2_n, s2_c, s2_p, s2_h, s2_br,
                      PAGE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      D: tl.constexpr, NS: tl.constexpr, MIN: tl.constexpr, BLOCK: tl.constexpr):
    """``_dense_split_kernel`` with each row's keys in one of two paged caches: rows with
    SEQ2[r] > 0 over KV2 through table row ROWS2[r] of BT2, the others over KV through row r of
    BT — the same ``_split`` either way, so a row's partials are those of a one-cache call."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    seq2 = tl.load(SEQ2 + r).to(tl.int64)      # one type in both branches
    if seq2 > 0:
        split_n = _split_len(seq2, NS, MIN)
        start = sp * split_n
        if start < seq2:
            bt = BT2 + tl.load(ROWS2 + r).to(tl.int64) * s2_br
            _split(Q, KV2, KV2 + s2_c, bt, PO, PML, scale, n_splits, r, h, sp, start, seq2,
                   split_n, s_qr, s_qh, s2_n, s2_p, s2_h, s2_n, s2_p, s2_h,
                   PAGE, HKV, G, GP, D, BLOCK)
    else:
        seq = tl.load(SEQ + r).to(tl.int64)
        split_n = _split_len(seq, NS, MIN)
        start = sp * split_n
        if start < seq:
            _split(Q, KV, KV + s_c, BT + r * s_br, PO, PML, scale, n_splits, r, h, sp, start, seq,
                   split_n, s_qr, s_qh, s_n, s_p, s_h, s_n, s_p, s_h,
                   PAGE, HKV, G, GP, D, BLOCK)


@triton.jit
def _ordered_combine_kernel(PO, PML, SEQ, OUT, n_splits, s_or, s_oh, HQ: tl.constexpr,
                            D: tl.constexpr, NS: tl.constexpr, MIN: tl.constexpr,
                            SKIP_EMPTY: tl.constexpr, SEQ2=None, TWO: tl.constexpr = False):
    r = tl.program_id(0)
    seq = tl.load(SEQ + r)
    if TWO:                                 # _two_split_kernel's rows: SEQ2's where it is > 0
        seq2 = tl.load(SEQ2 + r).to(tl.int64)
        seq = tl.where(seq2 > 0, seq2, seq.to(tl.int64))
    live = True
    if SKIP_EMPTY:                          # a row with no keys is not this call's: out untouched
        live = seq > 0
    if live:
        _combine(PO, PML, OUT, n_splits, s_or, s_oh, r, seq, HQ, D, _split_len(seq, NS, MIN))


@triton.jit
def _combine(PO, PML, OUT, n_splits, s_or, s_oh, r, seq, HQ: tl.constexpr, D: tl.constexpr,
             split_n):
    h = tl.program_id(1)
    od = tl.arange(0, D)
    live = tl.minimum((seq + split_n - 1) // split_n, n_splits)
    base = ((r * HQ + h) * n_splits).to(tl.int64)
    mx = tl.full([], float("-inf"), tl.float32)
    for s in range(0, live):
        mx = tl.maximum(mx, tl.load(PML + (base + s) * 2))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.zeros([], tl.float32)
    num = tl.zeros([D], tl.float32)
    for s in range(0, live):                # one split after the other: a fixed order
        w = tl.exp(tl.load(PML + (base + s) * 2) - mx)
        den += w * tl.load(PML + (base + s) * 2 + 1)
        num += w * tl.load(PO + (base + s) * D + od)
    res = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(OUT + r * s_or + h * s_oh + od, res.to(OUT.dtype.element_ty))


def dense_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_k: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, max_k: int | None = None,
                           table_rows: torch.Tensor | None = None,
                           work: tuple | None = None) -> torch.Tensor:
    """q/out (R, Hq, D) one query per row; k_cache/v_cache (N, P, Hkv, D) pages (strided views of
    one cache are fine, last dim contiguous); block_table (R, W) int32 (W * P >= max seq_k), or
    (M, W) read at rows table_rows (R,) int64; seq_k (R,) int32 keys per row (0: zeros out);
    max_k: accepted for FlashAttention's signature; the grid is (R, Hkv, SPLITS) whatever the
    lengths. work: preallocated (po, pml) partials (at least
    ``partials_numel``); with it, rows with seq_k 0 are skipped, their out rows left as they are,
    and nothing is allocated. No host sync, fixed shapes: capturable."""
    R, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert Hq % Hkv == 0 and D in DENSE_DECODE_HEAD_SIZES and k_cache.shape[3] == D
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    if out is None:
        out = torch.empty(R, Hq, D, dtype=q.dtype, device=q.device)
    if R == 0:
        return out
    ns = SPLITS
    po, pml = partials(R, Hq, ns, D, q.device, work)
    G = Hq // Hkv
    has_rows = table_rows is not None
    _dense_split_kernel[(R, Hkv, ns)](
        q, k_cache, v_cache, block_table, table_rows if has_rows else seq_k, seq_k, po, pml,
        float(scale), ns,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        PAGE=P, HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, NS=SPLITS,
        MIN=MIN_SPLIT, BLOCK=BLOCK_N if D <= 128 else 32, HAS_BT_ROWS=has_rows, num_warps=WARPS,
        num_stages=STAGES)
    _ordered_combine_kernel[(R, Hq)](po, pml, seq_k, out, ns, out.stride(0), out.stride(1), HQ=Hq,
                                     D=D, NS=SPLITS, MIN=MIN_SPLIT, SKIP_EMPTY=work is not None)
    return out


def dense_decode_two(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                     seq_k: torch.Tensor, kv2: torch.Tensor, table2: torch.Tensor,
                     rows2: torch.Tensor, seq2: torch.Tensor, scale: float, out: torch.Tensor,
                     work: tuple) -> torch.Tensor:
    """``dense_decode_attention`` over two paged caches in one split and one combine launch (a
    dense layer whose rows read either vLLM's cache or the dense pool): rows with seq2 > 0 attend
    their first seq2 keys of kv2 (M, 2, P, Hkv, D) through table2[rows2[r]] (rows2 int64), the
    others their first seq_k keys of kv (N, 2, P, Hkv, D) through block_table[r]; rows with
    neither are left as they are. Each row gets the bits a one-cache call gives it (the same split
    code and layout). work: the partials (``partials_numel``). No allocation, no sync."""
    R, Hq, D = q.shape
    P, Hkv = kv.shape[2], kv.shape[3]
    assert kv2.shape[2:] == kv.shape[2:] and kv2.dtype == kv.dtype and kv_dtype_ok(kv, q)
    assert Hq % Hkv == 0 and D in DENSE_DECODE_HEAD_SIZES and q.stride(2) == 1
    assert kv.stride(4) == 1 and kv2.stride(4) == 1
    for t in (block_table, table2):
        assert t.dtype == torch.int32 and t.stride(1) == 1
    if R == 0:
        return out
    po, pml = partials(R, Hq, SPLITS, D, q.device, work)
    G = Hq // Hkv
    _two_split_kernel[(R, Hkv, SPLITS)](
        q, kv, block_table, seq_k, kv2, table2, rows2, seq2, po, pml, float(scale), SPLITS,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_table.stride(0), kv2.stride(0), kv2.stride(1), kv2.stride(2), kv2.stride(3),
        table2.stride(0),
        PAGE=P, HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, NS=SPLITS,
        MIN=MIN_SPLIT, BLOCK=BLOCK_N if D <= 128 else 32, num_warps=WARPS, num_stages=STAGES)
    _ordered_combine_kernel[(R, Hq)](po, pml, seq_k, out, SPLITS, out.stride(0), out.stride(1),
                                     HQ=Hq, D=D, NS=SPLITS, MIN=MIN_SPLIT, SKIP_EMPTY=True,
                                     SEQ2=seq2, TWO=True)
    return out


def partials_numel(R: int, Hq: int, D: int) -> tuple[int, int]:
    """Elements of the (po, pml) partial results of a call of R rows."""
    return R * Hq * SPLITS * D, R * Hq * SPLITS * 2
