"""The DSA read path's index glue in three Triton launches a layer (CUDA), for what
``ops/latent_index.py`` writes in plain torch (its ``region_rows``, ``decode_selections`` and
``valid_counts``, the references these kernels must equal): three launches a layer where the
torch version made about twenty (the decode step's profile: docs/dsa.md, "The decode step on the
GPU").

- ``_region_rows_kernel`` (T programs): out[t, j] = base[t] + topk[t, j] when base[t] >= 0 and
  0 <= topk[t, j] < region_len, else -1;
- ``_decode_selections_kernel`` (n programs): sel[d] = topk[min(gather[d], T - 1)] with entries
  >= region_len made -1 (stock's range rule), locs[d] = -1;
- ``_valid_counts_kernel`` (T programs): valid[t] = entries of out[t] >= 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _region_rows_kernel(TOPK, BASE, OUT, K, s_topk, REGION_LEN, KB: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, KB)
    u = tl.load(TOPK + t.to(tl.int64) * s_topk + j, mask=j < K, other=-1).to(tl.int64)
    base = tl.load(BASE + t)
    ok = (base >= 0) & (u >= 0) & (u < REGION_LEN)
    tl.store(OUT + t.to(tl.int64) * K + j, tl.where(ok, base + u, -1).to(tl.int32), mask=j < K)


@triton.jit
def _decode_selections_kernel(TOPK, GATHER, SEL, LOCS, T, K, s_topk, REGION_LEN,
                              KB: tl.constexpr):
    d = tl.program_id(0)
    j = tl.arange(0, KB)
    t = tl.minimum(tl.load(GATHER + d), T - 1)
    u = tl.load(TOPK + t.to(tl.int64) * s_topk + j, mask=j < K, other=-1)
    tl.store(SEL + d.to(tl.int64) * K + j, tl.where(u < REGION_LEN, u, -1), mask=j < K)
    tl.store(LOCS + d.to(tl.int64) * K + j, tl.full([KB], -1, tl.int32), mask=j < K)


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


def region_rows(topk: torch.Tensor, base: torch.Tensor, region_len: int, out: torch.Tensor) -> None:
    """Shapes: ops/latent_index.region_rows (topk's rows may be strided)."""
    T, K = topk.shape
    _rows(out, i64=(base,))
    _selections(topk)
    if T:
        _region_rows_kernel[(T,)](topk, base, out, K, topk.stride(0), region_len,
                                  KB=triton.next_power_of_2(K), num_warps=4)


def decode_selections(topk: torch.Tensor, gather: torch.Tensor, region_len: int,
                      sel: torch.Tensor, locs: torch.Tensor) -> None:
    """Shapes: ops/latent_index.decode_selections."""
    T, K = topk.shape
    n = gather.shape[0]
    _rows(sel, locs, i64=(gather,))
    _selections(topk)
    if n and T:
        _decode_selections_kernel[(n,)](topk, gather, sel, locs, T, K, topk.stride(0), region_len,
                                        KB=triton.next_power_of_2(K), num_warps=4)


def valid_counts(out: torch.Tensor, valid: torch.Tensor) -> None:
    """Shapes: ops/latent_index.valid_counts."""
    T, K = out.shape
    _rows(out, valid)
    if T:
        _valid_counts_kernel[(T,)](out, valid, K, KB=triton.next_power_of_2(K), num_warps=4)
