"""The online-softmax step and the partial-result store shared by the split-KV decode kernels
(ops/triton_attention.py: sparse; ops/triton_dense_decode.py: dense). Inlined by Triton into each
kernel, so both keep their bits: the same operations in the same order as when each kernel had its
own copy. And the partial results' buffers of a call (``partials``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def partials(R: int, Hq: int, ns: int, D: int, device, work: tuple | None):
    """The (po (R, Hq, ns, D), pml (R, Hq, ns, 2)) fp32 partial results of a split-KV call: new
    tensors, or the caller's preallocated ``work`` (flat buffers of at least as many elements)."""
    if work is None:
        return (torch.empty(R, Hq, ns, D, dtype=torch.float32, device=device),
                torch.empty(R, Hq, ns, 2, dtype=torch.float32, device=device))
    po, pml = work
    assert po.numel() >= R * Hq * ns * D and pml.numel() >= R * Hq * ns * 2, "work too small"
    return po, pml


@triton.jit
def online_softmax_step(q, kt, vt, valid, scale, m_i, l_i, acc):
    """One block of keys kt / values vt (BLOCK, D) for the query group q (GP, D); valid (BLOCK,)
    masks the keys that count. Returns the running (max, sum, weighted values). An fp8 cache's
    keys and values are widened to q's dtype first (exact: e4m3 fits in fp16/bf16/fp32), so the
    products run as with a cache in q's dtype; a no-op when the cache has q's dtype."""
    kt = kt.to(q.dtype)
    vt = vt.to(q.dtype)
    s = tl.dot(q, tl.trans(kt)) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc


@triton.jit
def store_partials(PO, PML, base, acc, m_i, l_i, gmask, od, D: tl.constexpr):
    """A split's partial result: acc (GP, D) at PO[base], (max, sum) at PML[base] (base per query
    head of the group, in units of one split)."""
    tl.store(PO + base[:, None] * D + od[None, :], acc, mask=gmask[:, None])
    tl.store(PML + base * 2, m_i, mask=gmask)
    tl.store(PML + base * 2 + 1, l_i, mask=gmask)
