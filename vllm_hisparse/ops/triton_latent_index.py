"""The DSA read path's index conversion on CUDA (Triton): what ``ops/latent_index.py`` writes in
plain torch (``convert_rows``, ``region_rows``, ``valid_counts``: the references these kernels must
equal). A layer's conversion is two launches, beside stock's one (the profile: docs/dsa.md, "The
decode step on the GPU"):

- ``_convert_kernel`` (n + T programs): program d < n is decode entry d of a sparse request: its
  selection ``topk[min(gather[d], T - 1)]`` with entries >= region_len made -1 (stock's range
  rule) goes through RESOLVE against its row set's hot slots (ops/triton_select's
  ``_resolve_prelude`` / ``_resolve_row``, the policy's branch), and the slots it publishes, a
  miss's slot already chosen, go straight to ``out[scatter[d]]`` with their count to
  ``valid[scatter[d]]``; program n + t is token t: ``base[t] + topk[t, j]`` where
  ``base[t] >= 0`` and ``0 <= topk[t, j] < region_len``, else -1, and its count; a decode token
  (base -2) is left to its decode program. With no decode entries (``DEC`` off) only the tokens'
  programs exist;
- ``triton_resolve_given._miss_rows_kernel``: the misses' rows copied from the pinned host pool
  into the slots the first launch chose (the slots FA3 then reads).

``_valid_counts_kernel`` (T programs) counts a row's entries >= 0: speculative decoding's verify
rows, converted after the region rows (core/latent_graph.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_resolve_given import MISS_ROWS, _miss_rows_kernel
from .triton_select import _resolve_prelude, _resolve_row, policy_constants, select_widths


@triton.jit
def _token_row(t, TOPK, BASE, OUT, VALID, K, s_topk, REGION_LEN, SKIP, jk, KB: tl.constexpr):
    """Token t's region rows and their count; a token whose base is SKIP is left alone."""
    base = tl.load(BASE + t)
    if base != SKIP:
        u = tl.load(TOPK + t.to(tl.int64) * s_topk + jk, mask=jk < K, other=-1).to(tl.int64)
        ok = (base >= 0) & (u >= 0) & (u < REGION_LEN)
        tl.store(OUT + t.to(tl.int64) * K + jk, tl.where(ok, base + u, -1).to(tl.int32),
                 mask=jk < K)
        tl.store(VALID + t, tl.sum(ok.to(tl.int32), 0))


@triton.jit
def _convert_kernel(TOPK, BASE, OUT, VALID, GATHER, SCATTER, SEQ, HOT, ROWS, BT, SU, US, POL, SCR,
                    VIC, COUNTS, SEL, LOCS, T, N, K, S, s_topk, s_bt, s_su, s_us, s_pol,
                    REGION_LEN, SKIP, DEC: tl.constexpr, KB: tl.constexpr, SB: tl.constexpr,
                    POLICY: tl.constexpr, SHIFT: tl.constexpr, HIT: tl.constexpr):
    p = tl.program_id(0)
    jk = tl.arange(0, KB)
    if DEC:
        if p < N:                                       # decode entry r of a sparse request
            r = p
            seq = tl.load(SEQ + r)
            hot = tl.load(HOT + r)
            if (seq <= 0) | (hot == 0):                 # its row (if one of this call's) is empty
                dst0 = tl.load(SCATTER + r)
                if dst0 < T:
                    tl.store(OUT + dst0 * K + jk, tl.full([KB], -1, tl.int32), mask=jk < K)
                    tl.store(VALID + dst0, 0)
            if (seq > 0) & (hot != 0):
                t = tl.minimum(tl.load(GATHER + r), T - 1)
                u = tl.load(TOPK + t.to(tl.int64) * s_topk + jk, mask=jk < K, other=-1)
                u = tl.where(u < REGION_LEN, u, -1)
                tl.store(SEL + r.to(tl.int64) * K + jk, u, mask=jk < K)   # the miss copy's units
                none = tl.full([KB], -1, tl.int32)
                if tl.max(u, 0) >= 0:             # a row of only -1 is left alone (slots.engine)
                    row = tl.load(ROWS + r).to(tl.int64)
                    lo, lo_rev, su_rev = _resolve_prelude(r, row, True, S, SU, POL, SCR, s_su,
                                                          s_pol, SB, POLICY)
                    tl.debug_barrier()
                    _resolve_row(r, row, u, jk, K, S, BT, SU, US, POL, SCR, VIC, COUNTS, LOCS,
                                 s_bt, s_su, s_us, s_pol, lo, lo_rev, su_rev, none, KB, SB,
                                 POLICY, SHIFT, HIT)
                else:
                    tl.store(LOCS + r.to(tl.int64) * K + jk, none, mask=jk < K)
                tl.debug_barrier()
                loc = tl.load(LOCS + r.to(tl.int64) * K + jk, mask=jk < K, other=-1,
                              volatile=True)
                slot = tl.where(loc <= -2, -2 - loc, loc)   # a miss: the slot its row goes to
                dst = tl.load(SCATTER + r).to(tl.int64)
                tl.store(OUT + dst * K + jk, slot, mask=jk < K)
                tl.store(VALID + dst, tl.sum((slot >= 0).to(tl.int32), 0))
        else:
            _token_row(p - N, TOPK, BASE, OUT, VALID, K, s_topk, REGION_LEN, SKIP, jk, KB)
    else:
        _token_row(p, TOPK, BASE, OUT, VALID, K, s_topk, REGION_LEN, SKIP, jk, KB)


@triton.jit
def _valid_counts_kernel(OUT, VALID, K, KB: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, KB)
    v = tl.load(OUT + t.to(tl.int64) * K + j, mask=j < K, other=-1)
    tl.store(VALID + t, tl.sum((v >= 0).to(tl.int32), 0))


def _rows(*ts: torch.Tensor, i64: tuple = ()) -> None:
    """Contiguous (topk alone may have a wider row stride); int32, those in i64 int64."""
    for t in ts + i64:
        want = torch.int64 if any(t is x for x in i64) else torch.int32
        if t.dtype != want or t.stride(-1) != 1 or (t.dim() == 2 and t.stride(0) != t.shape[1]):
            raise ValueError(f"a contiguous {want} tensor expected, got {t.dtype} with strides "
                             f"{t.stride()}")


def _selections(topk: torch.Tensor) -> None:
    if topk.dtype != torch.int32 or topk.stride(-1) != 1:
        raise ValueError(f"topk must be int32 with unit column stride; got {topk.dtype} "
                         f"{topk.stride()}")


def region_rows(topk: torch.Tensor, base: torch.Tensor, region_len: int, out: torch.Tensor,
                valid: torch.Tensor) -> None:
    """Shapes: ops/latent_index.region_rows (topk's rows may be strided); valid (T,) int32 gets
    each row's count (one launch, the convert kernel without decode entries)."""
    T, K = topk.shape
    _rows(out, valid, i64=(base,))
    _selections(topk)
    if T:
        _convert_kernel[(T,)](topk, base, out, valid, *([base] * 14), T, 0, K, 0,
                              topk.stride(0), 0, 0, 0, 0, region_len, -3, DEC=False,
                              KB=triton.next_power_of_2(K), SB=16, POLICY=0, SHIFT=0, HIT=0,
                              num_warps=4)


def convert_rows(topk, base, region_len, gather, scatter, seq, slots, hot, rows, state, host_pt,
                 host, kv, counts, sel, locs, out, valid, scratch, victims) -> None:
    """Shapes: ops/latent_index.convert_rows; scratch / victims: the RESOLVE workspaces
    (resolve_given.workspace_shapes of n rows); host on the device (the pinned pool's alias)."""
    T, K = topk.shape
    n = gather.shape[0]
    _rows(out, valid, sel, locs, i64=(base, gather, scatter))
    _selections(topk)
    if not n:
        region_rows(topk, base, region_len, out[:T], valid)
        return
    if host.dtype != kv.dtype or host[0].numel() != kv[0].numel() or not kv.is_contiguous():
        raise ValueError(f"host rows and kv rows must have one shape and dtype; got "
                         f"{tuple(host.shape)} {host.dtype} vs {tuple(kv.shape)} {kv.dtype}")
    su, us, pol = state.kernel_state()
    S = su.shape[1]
    KB, SB = select_widths(K, S)
    _convert_kernel[(n + T,)](
        topk, base, out, valid, gather, scatter, seq, hot, rows, slots, su, us, pol, scratch,
        victims, counts, sel, locs, T, n, K, S, topk.stride(0), slots.stride(0), su.stride(0),
        us.stride(0), pol.stride(0), region_len, -2, DEC=True, KB=KB, SB=SB, num_warps=4,
        **policy_constants(state))
    row = kv[0].numel()
    _miss_rows_kernel[(n, triton.cdiv(K, MISS_ROWS))](
        locs, sel, seq, hot, rows, host_pt, host, kv, K, host_pt.stride(0), ROW=row,
        ROWP=triton.next_power_of_2(row), J=MISS_ROWS, num_warps=4)


def valid_counts(out: torch.Tensor, valid: torch.Tensor) -> None:
    """Shapes: ops/latent_index.valid_counts."""
    T, K = out.shape
    _rows(out, valid)
    if T:
        _valid_counts_kernel[(T,)](out, valid, K, KB=triton.next_power_of_2(K), num_warps=4)
