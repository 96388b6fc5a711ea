"""The decode rows' new tokens of every sparse layer into the pinned host pool, in one launch at the
step's last sparse layer (Triton), instead of a host store in each layer's write kernel.

Why (an A/B, ``HISPARSE_WRITE_THROUGH=step``; docs/kernels.md): on the H200 a replayed one-row
decode graph with the write-through on ran ~1.5 us a layer slower than without a host tier while
the write kernel's own time did not show the store (docs/gpu-results.md, fifth session). The
suspect is the completion of a kernel that stored to system memory over PCIe; one launch a step
pays it once. The host pool must be current only before a later step reads a page from it (a miss
of a complete page, a spill, a switch to sparse), and a decode row never selects its newest page
((seq - 1) // page is its first unselectable page), so a copy at the step's end is as exact as
the per-layer one.

Program (r, i) copies row r's token of layer i: the K and V rows at offset (seq - 1) % P of block
newest[r] of layer i's cache (its address from a table of the caches' data pointers: vLLM gives
every layer a tensor of its own) into host page host_page[r] of host layer host_idx[i]. Rows with
seq 0 or host_page -1 copy nothing. The plain-torch twin is ``reference.write_through_step``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_through_step_kernel(HOST, PTRS, HIDX, NEWEST, SEQ, HPAGE,
                               s_hl, s_hp, s_hc, s_ho, s_hh, s_cb, s_cc, s_cp, s_ch,
                               PAGE: tl.constexpr, HKV: tl.constexpr, HB: tl.constexpr,
                               D: tl.constexpr, DP: tl.constexpr):
    r = tl.program_id(0)
    i = tl.program_id(1)
    seq = tl.load(SEQ + r)
    hp = tl.load(HPAGE + r)
    if seq > 0:
        if hp >= 0:
            off = (seq - 1) % PAGE
            blk = tl.load(NEWEST + r).to(tl.int64)
            cache = tl.load(PTRS + i).to(tl.pointer_type(HOST.dtype.element_ty))
            hl = tl.load(HIDX + i)
            oh = tl.arange(0, HB)
            od = tl.arange(0, DP)
            m = (oh < HKV)[:, None] & (od < D)[None, :]
            c = cache + blk * s_cb + off * s_cp + oh[:, None] * s_ch + od[None, :]
            k = tl.load(c, mask=m)
            v = tl.load(c + s_cc, mask=m)
            d = HOST + hl * s_hl + hp * s_hp + off * s_ho + oh[:, None] * s_hh + od[None, :]
            tl.store(d, k, mask=m)
            tl.store(d + s_hc, v, mask=m)


def write_through_step(host: torch.Tensor, like: torch.Tensor, ptrs: torch.Tensor,
                       host_idx: torch.Tensor, newest: torch.Tensor, seq: torch.Tensor,
                       host_page: torch.Tensor) -> None:
    """Launch on checked inputs (ops/write_through.write_through_step); also runs under
    TRITON_INTERPRET=1. host: the pool on the device (the pinned pool's UVA alias); like: one of
    the caches (every cache has its shape and strides); ptrs, host_idx (L,) int64 on the device."""
    N, L = seq.shape[0], ptrs.shape[0]
    if N == 0 or L == 0:
        return
    P, Hkv, D = like.shape[2], like.shape[3], like.shape[4]
    _write_through_step_kernel[(N, L)](
        host, ptrs, host_idx, newest, seq, host_page,
        host.stride(0), host.stride(1), host.stride(2), host.stride(3), host.stride(4),
        like.stride(0), like.stride(1), like.stride(2), like.stride(3),
        PAGE=P, HKV=Hkv, HB=triton.next_power_of_2(Hkv), D=D, DP=triton.next_power_of_2(D),
        num_warps=2)
