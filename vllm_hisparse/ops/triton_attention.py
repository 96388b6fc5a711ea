"""Sparse GQA decode attention in Triton (split-KV "flash decoding" + a fixed-order combine).

The token sequence of a row is the selected units' rows in selection order (unit j holds tokens
j*unit .. j*unit+unit-1 of the sequence) followed by the extra rows. Each program takes one row,
one KV head (its whole query group, padded to 16 for the tensor cores) and one contiguous split
of that sequence; the split count depends only on the shapes (R, Hkv, tokens), never on the data
or the physical slots, and the combine reduces the splits in a fixed order. So the output is a
function of the gathered values and their order alone: HiSparse (locs into the hot buffer) and the
resident mode (locs into a full cache) are bit-identical for the same selection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import kv_dtype_ok
from .triton_online_softmax import online_softmax_step, partials, store_partials

BLOCK_N = 64          # tokens per inner step (a guess, good for D=128 on Hopper; see bench)
TARGET_PROGRAMS = 528  # ~4 programs per SM of a 132-SM GPU across (R, Hkv, splits) (a guess)
MAX_SPLITS = 64        # the combine holds this many (one width: one compiled combine kernel)
MIN_SPLIT_TOKENS = 64  # one BLOCK_N step per split at least; 256 left one 32K request (2064 tokens,
                       # 8 KV heads) with 72 programs, slower than 64's (docs/gpu-results.md)


# The split layout follows the batch size (num_splits): not specialised on, so a decode batch of a
# new size does not compile the kernels again (a JIT in the middle of serving stalls the step).
@triton.jit(do_not_specialize=["split_tokens", "n_splits"])
def _split_kernel(Q, KV, LOCS, UNITS, SEQ, EXTRA, ELEN, PO, PML,
                  scale, n_sel, n_tok, split_tokens, n_splits,
                  s_qr, s_qh, s_kn, s_kc, s_ku, s_kh, s_lr, s_ur, s_er, s_et, s_ec, s_eh,
                  UNIT: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr,
                  EXTRA_IN_KV: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    r = tl.program_id(0)
    live = True
    if SKIP_EMPTY:                      # a row with seq 0 is not this call's: nothing to do
        live = tl.load(SEQ + r) > 0
    if live:
        _split(Q, KV, LOCS, UNITS, SEQ, EXTRA, ELEN, PO, PML, scale, n_sel, n_tok, split_tokens,
               n_splits, s_qr, s_qh, s_kn, s_kc, s_ku, s_kh, s_lr, s_ur, s_er, s_et, s_ec, s_eh,
               r, UNIT, HKV, G, GP, D, BLOCK, HAS_EXTRA, EXTRA_IN_KV, KV, LOCS, SEQ, LOCS, 0, False,
               1)


@triton.jit
def _split(Q, KV, LOCS, UNITS, SEQ, EXTRA, ELEN, PO, PML, scale, n_sel, n_tok, split_tokens,
           n_splits, s_qr, s_qh, s_kn, s_kc, s_ku, s_kh, s_lr, s_ur, s_er, s_et, s_ec, s_eh,
           r, UNIT: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
           D: tl.constexpr, BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr,
           EXTRA_IN_KV: tl.constexpr, HOST, HPT, ROWS, MISSED, s_hpt, FETCH: tl.constexpr,
           KP: tl.constexpr):
    """FETCH: a locs entry -2 - block is a miss: its tokens (this program's KV head) are copied
    from the host pool's page HPT[ROWS[r], unit] (HOST: the pool's CUDA alias, kv's layout) into
    the block before the split's loop reads them there (``_fetch_misses``), so the page is also
    resident for the next step (each (token, KV head) of the selection belongs to exactly one
    program, so each byte of the page is written once). MISSED[r] (the select's): 0 for a row
    without a miss this step, whose programs then skip even the check (one scalar load beside the
    query's, instead of a load of the row's locs and a block-wide min before the loop, which
    showed in a one-row split: docs/gpu-results.md). KP: a power of two >= the selected units per
    row."""
    h = tl.program_id(1)
    sp = tl.program_id(2)
    og = tl.arange(0, GP)
    od = tl.arange(0, D)
    gmask = og < G
    q = tl.load(Q + r * s_qr + (h * G + og)[:, None] * s_qh + od[None, :], mask=gmask[:, None], other=0.0)
    seq = tl.load(SEQ + r)
    ebase = KV
    elen = 0
    if HAS_EXTRA:
        if EXTRA_IN_KV:
            # EXTRA holds the newest block of each row (-1: none); its first (seq-1) % UNIT + 1
            # rows (torch's floor modulo: UNIT rows when seq == 0) are read straight from KV,
            # whose strides the caller passed as the extra strides.
            blk = tl.load(EXTRA + r)
            elen = tl.where(blk >= 0, ((seq - 1) % UNIT + UNIT) % UNIT + 1, 0)
            ebase = KV + blk.to(tl.int64) * s_er
        else:
            elen = tl.load(ELEN + r)
            ebase = EXTRA + r * s_er
    start = sp * split_tokens
    end = tl.minimum(start + split_tokens, n_tok)
    if FETCH:
        if tl.load(MISSED + r) != 0:
            _fetch_misses(KV, LOCS, UNITS, HOST, HPT, ROWS, r, h, start, tl.minimum(end, n_sel),
                          s_kn, s_kc, s_ku, s_kh, s_lr, s_ur, s_hpt, od, UNIT, BLOCK, KP)
    m_i, l_i, acc = _tokens(
        q, seq, KV, LOCS, UNITS, r, h, start, end, n_sel, scale, s_kn, s_kc, s_ku, s_kh, s_lr,
        s_ur, s_et, s_ec, s_eh, od, ebase, elen, UNIT, GP, D, BLOCK, HAS_EXTRA, FETCH)
    hq = h * G + og
    store_partials(PO, PML, (r * (HKV * G) + hq) * n_splits + sp, acc, m_i, l_i, gmask, od, D)


@triton.jit
def _fetch_misses(KV, LOCS, UNITS, HOST, HPT, ROWS, r, h, start, end, s_kn, s_kc, s_ku, s_kh,
                  s_lr, s_ur, s_hpt, od, UNIT: tl.constexpr, BLOCK: tl.constexpr,
                  KP: tl.constexpr):
    """The missed pages (locs -2 - block) among the selected tokens [start, end) of row r: their
    KV head h tokens copied from the host pool's page into the block, before the attention's loop.
    A split without a miss (one load of its units' locs tells) skips it, so with no miss the loop
    after it is the plain one: no per-token host pointer, no store (a fetch inside the loop cost
    every token ~15% more instructions, misses or not)."""
    jl = tl.arange(0, KP)
    mine = (jl * UNIT < end) & (jl * UNIT + UNIT > start)
    if tl.min(tl.load(LOCS + r * s_lr + jl, mask=mine, other=-1)) <= -2:
        prow = tl.load(ROWS + r).to(tl.int64)
        for t0 in range(start, end, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            j = t // UNIT
            off = t - j * UNIT
            loc = tl.load(LOCS + r * s_lr + j, mask=t < end, other=-1)
            miss = loc <= -2
            u = tl.load(UNITS + r * s_ur + j, mask=miss, other=0)
            hp = tl.load(HPT + prow * s_hpt + u, mask=miss, other=0)
            src = HOST + hp.to(tl.int64) * s_kn + off * s_ku + h * s_kh
            dst = KV + (-2 - loc).to(tl.int64) * s_kn + off * s_ku + h * s_kh
            kt = tl.load(src[:, None] + od[None, :], mask=miss[:, None], other=0.0)
            vt = tl.load(src[:, None] + s_kc + od[None, :], mask=miss[:, None], other=0.0)
            tl.store(dst[:, None] + od[None, :], kt, mask=miss[:, None])
            tl.store(dst[:, None] + s_kc + od[None, :], vt, mask=miss[:, None])
        tl.debug_barrier()          # the stores seen by every thread of the program's loop


@triton.jit
def _tokens(q, seq, KV, LOCS, UNITS, r, h, start, end, n_sel, scale, s_kn, s_kc, s_ku, s_kh,
            s_lr, s_ur, s_et, s_ec, s_eh, od, ebase, elen, UNIT: tl.constexpr, GP: tl.constexpr,
            D: tl.constexpr, BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr, FETCH: tl.constexpr):
    """The online softmax of the query group q over tokens [start, end) of row r, KV head h (the
    selected pages', then the extra rows at ebase, elen of them); FETCH: a miss's block (-2 -
    block), which _fetch_misses filled, is read like a hit's. Returns (max, sum, weighted
    values)."""
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        live = t < end
        is_sel = live & (t < n_sel)
        j = t // UNIT
        off = t - j * UNIT
        loc = tl.load(LOCS + r * s_lr + j, mask=is_sel, other=-1)
        if FETCH:
            loc = tl.where(loc <= -2, -2 - loc, loc)
        u = tl.load(UNITS + r * s_ur + j, mask=is_sel, other=0)
        kp = KV + loc.to(tl.int64) * s_kn + off * s_ku + h * s_kh
        valid = is_sel & (loc >= 0) & (u * UNIT + off < seq)
        kt = tl.load(kp[:, None] + od[None, :], mask=valid[:, None], other=0.0)
        vt = tl.load(kp[:, None] + s_kc + od[None, :], mask=valid[:, None], other=0.0)
        if HAS_EXTRA:
            e = t - n_sel
            is_ext = live & (e >= 0) & (e < elen)
            ep = ebase + e.to(tl.int64) * s_et + h * s_eh
            kt = tl.where(is_ext[:, None], tl.load(ep[:, None] + od[None, :], mask=is_ext[:, None], other=0.0), kt)
            vt = tl.where(is_ext[:, None],
                          tl.load(ep[:, None] + s_ec + od[None, :], mask=is_ext[:, None], other=0.0), vt)
            valid = valid | is_ext
        m_i, l_i, acc = online_softmax_step(q, kt, vt, valid, scale, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(PO, PML, OUT, SEQ, n_splits, s_or, s_oh, HQ: tl.constexpr, D: tl.constexpr,
                    SP: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    r = tl.program_id(0)
    live = True
    if SKIP_EMPTY:                      # its out row is left as it is
        live = tl.load(SEQ + r) > 0
    if live:
        _combine(PO, PML, OUT, n_splits, n_splits, s_or, s_oh, r, HQ, D, SP)


@triton.jit
def _combine(PO, PML, OUT, n_splits, stride, s_or, s_oh, r, HQ: tl.constexpr, D: tl.constexpr,
             SP: tl.constexpr):
    """Row r, head program_id(1): the first n_splits partials of the (r, head) run of ``stride``."""
    h = tl.program_id(1)
    os_ = tl.arange(0, SP)
    od = tl.arange(0, D)
    smask = os_ < n_splits
    base = (r * HQ + h) * stride
    m = tl.load(PML + (base + os_) * 2, mask=smask, other=float("-inf"))
    l = tl.load(PML + (base + os_) * 2 + 1, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(m - mx)
    den = tl.sum(w * l, 0)
    o = tl.load(PO + (base + os_)[:, None] * D + od[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], 0)
    res = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(OUT + r * s_or + h * s_oh + od, res.to(OUT.dtype.element_ty))


def num_splits(R: int, Hkv: int, n_tok: int) -> int:
    """Splits per (row, KV head): a function of the shapes only (exactness depends on it)."""
    want = max(1, -(-TARGET_PROGRAMS // max(1, R * Hkv)))
    most = max(1, -(-n_tok // MIN_SPLIT_TOKENS))
    return min(want, most, MAX_SPLITS)


def sparse_decode_attention(q: torch.Tensor, kv: torch.Tensor, locs: torch.Tensor, units: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, extra_kv: torch.Tensor | None = None,
                            extra_lens: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton implementation of ops.reference.sparse_decode_attention (same contract).

    q: (R, Hq, D) bf16/fp16/fp32, D in {64, 128, 256}; kv: (N, 2, unit, Hkv, D) q's dtype, last dim
    contiguous; locs, units: (R, k) int32 (-1 = padding); seq_lens: (R,) int32; extra_kv:
    (R, E, 2, Hkv, D); extra_lens: (R,) int32; out: (R, Hq, D) q's dtype. Hq % Hkv == 0.
    """
    if extra_kv is None or extra_kv.shape[1] == 0:
        return _launch(q, kv, locs, units, seq_lens, scale, out, 0, kv, seq_lens, (0, 0, 0, 0), False)
    return _launch(q, kv, locs, units, seq_lens, scale, out, extra_kv.shape[1], extra_kv, extra_lens,
                   extra_kv.stride()[:4], False)


def sparse_decode_attention_newest(q: torch.Tensor, kv: torch.Tensor, locs: torch.Tensor,
                                   units: torch.Tensor, seq_lens: torch.Tensor,
                                   newest_blocks: torch.Tensor, scale: float,
                                   out: torch.Tensor | None = None,
                                   work: tuple | None = None) -> torch.Tensor:
    """sparse_decode_attention with extra rows = the first (seq_lens[r] - 1) % unit + 1 rows of
    block newest_blocks[r] of kv, read in place: the same bits as gathering them into extra_kv
    (R, unit, 2, Hkv, D) with those extra_lens (same token order, same splits).

    newest_blocks: (R,) int32/int64, -1 = no extra rows (a padding row); other args as above.
    work: preallocated (po, pml) partials of at least ``partials_shape(R, Hq, Hkv, k * unit +
    unit)`` each; with it, rows with seq_lens 0 are skipped (their out rows are left as they are)
    and nothing is allocated (a CUDA graph's conditional body).
    """
    return _launch(q, kv, locs, units, seq_lens, scale, out, kv.shape[2], newest_blocks, seq_lens,
                   (kv.stride(0), kv.stride(2), kv.stride(1), kv.stride(3)), True, work)


def split_layout(R: int, Hkv: int, n_tok: int) -> tuple[int, int]:
    """(splits, tokens per split) of a call: a function of the shapes only."""
    ns = num_splits(R, Hkv, n_tok)
    split = -(-max(n_tok, 1) // ns)
    split = -(-split // BLOCK_N) * BLOCK_N
    return max(1, -(-n_tok // split)), split


def partials_shape(R: int, Hq: int, Hkv: int, n_tok: int, D: int) -> tuple[tuple, tuple]:
    """Shapes of the (po, pml) partial results of a call over n_tok tokens per row."""
    ns = split_layout(R, Hkv, n_tok)[0]
    return (R, Hq, ns, D), (R, Hq, ns, 2)


def _launch(q, kv, locs, units, seq_lens, scale, out, E, ex, el, es, in_kv, work=None):
    """Both kernels; the extra rows: E per row, from ex (a tensor, or newest blocks when in_kv) with
    strides es = (row or block, token, K/V, head)."""
    R, Hq, D = q.shape
    unit, Hkv = kv.shape[2], kv.shape[3]
    k = locs.shape[1]
    assert Hq % Hkv == 0 and D in (64, 128, 256) and kv.shape[4] == D and kv_dtype_ok(kv, q)
    assert q.stride(2) == 1 and kv.stride(4) == 1 and locs.stride(1) == 1 and units.stride(1) == 1
    if out is None:
        out = torch.empty(R, Hq, D, dtype=q.dtype, device=q.device)
    if R == 0:
        return out
    G = Hq // Hkv
    n_sel = k * unit
    n_tok = n_sel + E
    ns, split = split_layout(R, Hkv, n_tok)
    po, pml = partials(R, Hq, ns, D, q.device, work)
    block = BLOCK_N if D <= 128 else 32
    _split_kernel[(R, Hkv, ns)](
        q, kv, locs, units, seq_lens, ex, el, po, pml,
        float(scale), n_sel, n_tok, split, ns,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        locs.stride(0), units.stride(0), es[0], es[1], es[2], es[3],
        UNIT=unit, HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK=block,
        HAS_EXTRA=E > 0, EXTRA_IN_KV=in_kv, SKIP_EMPTY=work is not None, num_warps=4, num_stages=2)
    _combine_kernel[(R, Hq)](po, pml, out, seq_lens, ns, out.stride(0), out.stride(1), HQ=Hq, D=D,
                             SP=MAX_SPLITS, SKIP_EMPTY=work is not None)
    return out
