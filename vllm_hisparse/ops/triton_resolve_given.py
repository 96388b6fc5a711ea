"""RESOLVE of a *given* selection (Triton): the hot-slot half of ops/triton_select.py without its
top-k, for indexers that hand over their own selection (DSA: vLLM's ``topk_indices_buffer``,
docs/dsa.md section 4). Per live hot row r: ``_resolve_row`` on ``sel[r]`` as it is (any order,
-1 anywhere = nothing; a row of only -1 is left alone, as slots.engine.resolve leaves it), in the
branch of the state's policy (``POLICY`` 0 = lru, 1 = crf, with the policy's kernel constants),
then ``_miss_rows_kernel`` copies the misses' rows from the host pool, J selection entries a
program; the contract is ``resolve_given.resolve_given_reference``. It reuses triton_select's jit
functions (_resolve_prelude, _resolve_row: their signatures are this file's only coupling to that
kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_select import _resolve_prelude, _resolve_row, policy_constants, select_widths

MISS_ROWS = 16        # selection entries a miss-copy program covers (J)


@triton.jit
def _resolve_given_kernel(SEL, SEQ, HOT, ROWS, BT, SU, US, POL, SCR, VIC, COUNTS, LOCS, K, S,
                          s_bt, s_su, s_us, s_pol, KB: tl.constexpr, SB: tl.constexpr,
                          POLICY: tl.constexpr, SHIFT: tl.constexpr, HIT: tl.constexpr):
    r = tl.program_id(0)
    if (tl.load(SEQ + r) > 0) & (tl.load(HOT + r) != 0):
        jk = tl.arange(0, KB)
        u = tl.load(SEL + r.to(tl.int64) * K + jk, mask=jk < K, other=-1)
        none = tl.full([KB], -1, tl.int32)
        if tl.max(u, 0) >= 0:                     # a row of only -1 is left alone (slots.engine)
            row = tl.load(ROWS + r).to(tl.int64)
            lo, lo_rev, su_rev = _resolve_prelude(r, row, True, S, SU, POL, SCR, s_su, s_pol, SB,
                                                  POLICY)
            tl.debug_barrier()
            _resolve_row(r, row, u, jk, K, S, BT, SU, US, POL, SCR, VIC, COUNTS, LOCS, s_bt, s_su,
                         s_us, s_pol, lo, lo_rev, su_rev, none, KB, SB, POLICY, SHIFT, HIT)
        else:
            tl.store(LOCS + r.to(tl.int64) * K + jk, none, mask=jk < K)


@triton.jit
def _miss_rows_kernel(LOCS, SEL, SEQ, HOT, ROWS, HPT, HOST, KV, K, s_hpt, ROW: tl.constexpr,
                      ROWP: tl.constexpr, J: tl.constexpr):
    """Program (r, b): selection entries [b J, b J + J) of row r (a row the resolve kernel
    resolved: live and hot); each marked miss (loc <= -2) has its row (ROW elements, a token's
    latent) copied from the host pool (UVA loads) into slot -2 - loc, which then goes into locs.
    One [J, ROWP] tile a program: every miss's row in flight at once, K / J programs a row
    (a program a miss, as triton_select._miss_io_kernel does for Quest's pages, made N x K
    programs of one 1 KiB row each, nearly all of them padding rows at one live row; the profile:
    docs/dsa.md, "The decode step on the GPU")."""
    r = tl.program_id(0)
    if (tl.load(SEQ + r) > 0) & (tl.load(HOT + r) != 0):
        j = tl.program_id(1) * J + tl.arange(0, J)
        at = LOCS + r.to(tl.int64) * K + j
        loc = tl.load(at, mask=j < K, other=0)
        miss = (j < K) & (loc <= -2)
        if tl.max(miss.to(tl.int32), 0) > 0:
            slot = -2 - loc
            row = tl.load(ROWS + r).to(tl.int64)
            u = tl.load(SEL + r.to(tl.int64) * K + j, mask=miss, other=0)
            hp = tl.load(HPT + row * s_hpt + u, mask=miss, other=0).to(tl.int64)
            oc = tl.arange(0, ROWP)
            m = miss[:, None] & (oc[None, :] < ROW)
            x = tl.load(HOST + hp[:, None] * ROW + oc[None, :], mask=m)
            tl.store(KV + slot.to(tl.int64)[:, None] * ROW + oc[None, :], x, mask=m)
            tl.store(at, slot, mask=miss)


def resolve_given(sel: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                  locs: torch.Tensor, scratch: torch.Tensor, victims: torch.Tensor,
                  hot: torch.Tensor, rows: torch.Tensor, state, host_pt: torch.Tensor,
                  host: torch.Tensor, kv: torch.Tensor, counts: torch.Tensor) -> None:
    """Launch on checked inputs (ops/resolve_given.py); shapes there; scratch (N, SB) / victims
    (N, KB) int32 (select_widths); host on the device (the pool's CUDA alias on a GPU); state a
    slots.HotBufferState whose policy has a kernel branch (POLICY = its ``kernel`` id)."""
    N, K = sel.shape
    if N == 0 or K == 0:
        return
    su, us, pol = state.kernel_state()
    consts = policy_constants(state)
    S = su.shape[1]
    KB, SB = select_widths(K, S)
    _resolve_given_kernel[(N,)](
        sel, seq, hot, rows, block_table, su, us, pol, scratch, victims, counts, locs, K, S,
        block_table.stride(0), su.stride(0), us.stride(0), pol.stride(0), KB=KB, SB=SB,
        num_warps=4, **consts)
    row = kv[0].numel()
    _miss_rows_kernel[(N, triton.cdiv(K, MISS_ROWS))](
        locs, sel, seq, hot, rows, host_pt, host, kv, K, host_pt.stride(0), ROW=row,
        ROWP=triton.next_power_of_2(row), J=MISS_ROWS, num_warps=4)
