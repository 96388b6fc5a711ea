"""The DSA write path's one launch a layer (Triton): ``ops/latent_write.write_latent_rows`` on CUDA
(its plain-torch reference there). Program t builds token t's row from its two parts (bf16 kv_c
and k_pe, read in place: no concatenation; or fp8_ds_mla's packed bytes, one part) and stores it
at ``pool[pool_row[t]]`` and, over UVA, at ``host[host_row[t]]`` of the pinned host pool; -1 =
no store. Stock's ``concat_and_cache_mla`` is one launch too."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_rows_kernel(A, B, HOST, HOST_ROW, POOL, POOL_ROW, s_a, s_b, WA, WB,
                       HAS_HOST: tl.constexpr, WP: tl.constexpr):
    t = tl.program_id(0)
    c = tl.arange(0, WP)
    W = WA + WB
    a = tl.load(A + t.to(tl.int64) * s_a + c, mask=c < WA)
    b = tl.load(B + t.to(tl.int64) * s_b + (c - WA), mask=(c >= WA) & (c < W))
    x = tl.where(c < WA, a, b)
    pr = tl.load(POOL_ROW + t)
    if pr >= 0:
        tl.store(POOL + pr * W + c, x, mask=c < W)
    if HAS_HOST:
        hr = tl.load(HOST_ROW + t)
        if hr >= 0:
            tl.store(HOST + hr * W + c, x, mask=c < W)


def write_rows(a: torch.Tensor, b: torch.Tensor | None, host: torch.Tensor | None,
               host_row: torch.Tensor, pool: torch.Tensor, pool_row: torch.Tensor) -> None:
    """Checked inputs (ops/latent_write.py); host on the device (the pinned pool's alias)."""
    T, WA = a.shape
    WB = 0 if b is None else b.shape[1]
    if T:
        _write_rows_kernel[(T,)](a, a if b is None else b, pool if host is None else host,
                                 host_row, pool, pool_row, a.stride(0),
                                 0 if b is None else b.stride(0), WA, WB,
                                 HAS_HOST=host is not None,
                                 WP=triton.next_power_of_2(WA + WB), num_warps=4)
