"""The attention of a decode batch's sparse layer in one launch (Triton): sparse rows over their
selected pages plus their newest page (ops/triton_attention.py's split and combine), dense rows
over their whole paged context (ops/triton_dense_decode.py's split and ordered combine), each
program doing what its row's kind needs — instead of four launches, two of them inert for every
row of the other kind (each launch and the gap after it cost ~1.5-3 us at one row on the H200).

The combine is the split launch's tail ("the last program combines", split-K with a semaphore):
every program of a live row stores its split's partials (or has none: a split past the row's
tokens) and adds one to its (row, KV head) counter; the program that brings it to the number of
splits combines that KV head's query heads and sets the counter back to 0. The combine launch it
replaced was ~3.3 us of a ~31.9 us layer at one 32K row on the H200 (a launch doing little); the
fold is not yet measured there. In Triton's interpreter the programs run one after the other, so
there the last of a (row, KV head) is always its last split.

A row's programs run exactly the code of its kind's own kernels with the same split layout, and
the partial results only sit at a wider stride; the combine is their kernels' combine, per query
head, reading the splits in the same fixed order whichever program came last. So every row gets
the bits ``triton_attention.sparse_decode_attention_newest`` /
``triton_dense_decode.dense_decode_attention`` give it (tests/test_decode_attention.py checks
that, bit for bit). The plain-torch twin is ``kernels.decode_attention``'s CPU path (the two
references)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_attention as ta
from . import triton_dense_decode as td


@triton.jit(do_not_specialize=["split_tokens", "n_sp", "ns"])
def _decode_attention_kernel(Q, KV, LOCS, UNITS, SP_SEQ, NEWEST, DN_SEQ, BT, PO, PML, CNT, OUT,
                             scale, n_sel, n_tok, split_tokens, n_sp, ns,
                             s_qr, s_qh, s_kn, s_kc, s_ku, s_kh, s_lr, s_ur, s_br, s_or, s_oh,
                             UNIT: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                             GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                             DBLOCK: tl.constexpr, NSD: tl.constexpr, MIN: tl.constexpr,
                             SP: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    sparse = tl.load(SP_SEQ + r) > 0
    seq = tl.load(DN_SEQ + r)
    split_n = td._split_len(seq, NSD, MIN)
    if sparse:
        if sp < n_sp:
            ta._split(Q, KV, LOCS, UNITS, SP_SEQ, NEWEST, SP_SEQ, PO, PML, scale, n_sel, n_tok,
                      split_tokens, ns, s_qr, s_qh, s_kn, s_kc, s_ku, s_kh, s_lr, s_ur,
                      s_kn, s_ku, s_kc, s_kh, r, UNIT, HKV, G, GP, D, BLOCK, True, True)
    else:
        start = sp * split_n
        if (seq > 0) & (start < seq):
            td._split(Q, KV, KV + s_kc, BT + r * s_br, PO, PML, scale, ns, r, h, sp, start, seq,
                      split_n, s_qr, s_qh, s_kn, s_ku, s_kh, s_kn, s_ku, s_kh,
                      UNIT, HKV, G, GP, D, DBLOCK)
    if sparse | (seq > 0):                  # a padding row neither counts nor combines
        # Every thread's partial stores before the one thread's release below (bar.sync; the
        # release is cumulative), then the count. The acquire makes the other programs' partials
        # visible to the last one; it reads them past L1 (.cg) all the same.
        tl.debug_barrier()
        done = tl.atomic_add(CNT + r * HKV + h, 1, sem="acq_rel", scope="gpu")
        if done == ns - 1:
            _combine_heads(PO, PML, OUT, n_sp, ns, s_or, s_oh, r, h, sparse, seq, split_n,
                           HKV, G, D, SP)
            tl.store(CNT + r * HKV + h, 0)  # every program of (r, h) has counted: ready again


# Not inlined: Triton picks a load's layout from every load of the same shape its values meet
# (the coalesce pass: the widest vector among them), and the split's (64, D) bf16 K/V tiles would
# give the combine's (64, D) fp32 partials 8 elements per thread instead of 4 — another reduction
# order than the standalone combine kernels, other bits. In a function of its own it meets none.
@triton.jit(noinline=True)
def _combine_heads(PO, PML, OUT, n_sp, ns, s_or, s_oh, r, h, sparse, seq, split_n,
                   HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
    """The G query heads of KV head h of row r, each exactly as its kind's combine kernel, reading
    partials that other programs of this launch stored: past L1 (.cg)."""
    for g in tl.static_range(G):
        if sparse:
            ta._combine(PO, PML, OUT, n_sp, ns, s_or, s_oh, r, h * G + g, HKV * G, D, SP, ".cg")
        else:
            td._combine(PO, PML, OUT, ns, s_or, s_oh, r, h * G + g, seq, HKV * G, D, split_n,
                        ".cg")


def layout(R: int, Hkv: int, k: int, unit: int) -> tuple[int, int, int]:
    """(sparse splits, tokens per sparse split, partial slots per (row, head)) of a batch of R rows
    selecting k units of unit tokens (+ the newest unit)."""
    n_sp, split = ta.split_layout(R, Hkv, k * unit + unit)
    return n_sp, split, max(n_sp, td.SPLITS)


def partials_numel(R: int, Hq: int, Hkv: int, k: int, unit: int, D: int) -> tuple[int, int]:
    """Elements of the fp32 (po, pml) partial results of a call of R rows (``work``'s first two)."""
    ns = layout(R, Hkv, k, unit)[2]
    return R * Hq * ns * D, R * Hq * ns * 2


def decode_attention(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                     locs: torch.Tensor, units: torch.Tensor, sp_seq: torch.Tensor,
                     newest: torch.Tensor, dn_seq: torch.Tensor, scale: float, out: torch.Tensor,
                     work: tuple) -> torch.Tensor:
    """Rows with sp_seq > 0: sparse_decode_attention_newest(q, kv, locs, units, sp_seq, newest);
    rows with dn_seq > 0: dense_decode_attention(q, kv[:, 0], kv[:, 1], block_table, dn_seq);
    other rows' out left as they are. kv (N, 2, P, Hkv, D); block_table (R, W) int32 (W * P >=
    max dn_seq); locs/units (R, k) int32; sp_seq/dn_seq (R,) int; newest (R,) int.

    work (po, pml, counters): po/pml fp32 of at least ``partials_numel`` elements (any contents);
    counters int32 of at least R * Hkv elements, which must be zeros and are zeros again when the
    launch ends (the last program of each (row, KV head) resets its own): one buffer serves every
    call that runs after the previous one on the stream, eager or replayed, without a memset —
    but not two calls at once. No allocation, no host sync: capturable."""
    R, Hq, D = q.shape
    unit, Hkv = kv.shape[2], kv.shape[3]
    k = locs.shape[1]
    assert Hq % Hkv == 0 and D in (64, 128, 256) and kv.shape[4] == D and kv.dtype == q.dtype
    assert q.stride(2) == 1 and kv.stride(4) == 1 and locs.stride(1) == 1 and units.stride(1) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    if R == 0:
        return out
    n_sp, split, ns = layout(R, Hkv, k, unit)
    po, pml, counters = work
    assert po.numel() >= R * Hq * ns * D and pml.numel() >= R * Hq * ns * 2, "work too small"
    assert counters.dtype == torch.int32 and counters.numel() >= R * Hkv, "counters too small"
    G = Hq // Hkv
    _decode_attention_kernel[(R, Hkv, ns)](
        q, kv, locs, units, sp_seq, newest, dn_seq, block_table, po, pml, counters, out,
        float(scale), k * unit, k * unit + unit, split, n_sp, ns,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        locs.stride(0), units.stride(0), block_table.stride(0), out.stride(0), out.stride(1),
        UNIT=unit, HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D,
        BLOCK=ta.BLOCK_N if D <= 128 else 32, DBLOCK=td.BLOCK_N if D <= 128 else 32,
        NSD=td.SPLITS, MIN=td.MIN_SPLIT, SP=ta.MAX_SPLITS, num_warps=4, num_stages=2)
    return out
