"""The DSA write path (docs/dsa.md section 3): a step's new latent rows of one layer (in the pool's
format: ``[kv_c, k_pe]``, or fp8_ds_mla's packed bytes: ``LatentPool.row_parts``) through to the
host pool and, for tokens whose request holds a region (in prefill, lent, or resident mode), into
the latent pool at ``region_base + position``.

CUDA: one launch a layer (ops/triton_latent_write.py: the row built from its parts in registers,
UVA stores into the pinned pool, plain stores into the GPU pool, -1 = no-op, no host sync); CPU:
the plain-torch reference below.
"""
from __future__ import annotations

import torch


def write_latent_rows(a: torch.Tensor, b: torch.Tensor | None, host: torch.Tensor | None,
                      host_row: torch.Tensor, pool: torch.Tensor, pool_row: torch.Tensor) -> None:
    """In place: row[t] -> host[host_row[t]] where host_row[t] >= 0 and -> pool[pool_row[t]]
    where pool_row[t] >= 0, row[t] = [a[t], b[t]] (or a[t] when b is None); rows are opaque
    (bf16 [kv_c, k_pe], or fp8_ds_mla's 656 bytes).

    a: (T, WA), b: (T, WB) or None, the pool's dtype, unit column stride (rows may be strided);
    host: (P, W) one layer of core/host_pool's pool as rows (pinned; None: resident mode,
    host_row all -1); host_row, pool_row: (T,) int64 on a's device, -1 = none, the valid ones
    distinct and in range; pool: (M, W) one layer of the latent pool (core/latent_pool.py)."""
    T, WA = a.shape
    W = WA + (0 if b is None else b.shape[1])
    if pool.dim() != 2 or pool.shape[1] != W or (b is not None and b.shape[0] != T):
        raise ValueError(f"rows of {tuple(a.shape)} + {None if b is None else tuple(b.shape)} "
                         f"must be rows of the pool's {tuple(pool.shape[1:])} values, one per "
                         f"token")
    if host_row.shape != (T,) or pool_row.shape != (T,):
        raise ValueError(f"host_row {tuple(host_row.shape)} and pool_row {tuple(pool_row.shape)} "
                         f"must be ({T},): one entry per token")
    if a.dtype != pool.dtype or (b is not None and b.dtype != pool.dtype):
        raise ValueError(f"rows dtype {a.dtype} must be the pool's {pool.dtype}")
    if host is not None and (host.dim() != 2 or host.shape[1] != W or host.dtype != pool.dtype):
        raise ValueError(f"host layer {tuple(host.shape)} {host.dtype} must be (pages, {W}) "
                         f"{pool.dtype}: one latent row a page")
    if T == 0:
        return
    if a.is_cuda:
        if a.stride(1) != 1 or (b is not None and b.stride(1) != 1) or not pool.is_contiguous():
            raise ValueError("write_latent_rows: rows need a unit column stride and the pool "
                             "must be contiguous")
        from . import kernels, triton_latent_write
        triton_latent_write.write_rows(a, b, kernels.device_alias(host, a.device), host_row,
                                       pool, pool_row)
        return
    rows = a if b is None else torch.cat([a, b], 1)
    for dst, at in ((host, host_row), (pool, pool_row)):
        if dst is not None:
            m = at >= 0
            dst[at[m]] = rows[m].to(dst.device)
