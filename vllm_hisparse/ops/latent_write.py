"""The DSA write path (docs/dsa.md section 3): a step's new latent rows ``[kv_c, k_pe]`` of one
layer through to the host pool and, for tokens whose request holds a region (in prefill, or
resident mode), into the latent pool at ``region_base + position``.

Both go through ``ops/write_through.py``, a row being one "token" of K and V halves of 288 values
(the host page's layout; the pool viewed as (M, 2, 1, 1, 288)): on CUDA its kernel, UVA stores into
the pinned pool and plain stores into the GPU pool, -1 = no-op, no host sync (two launches and one
concatenation a layer: a fused kernel could take kv_c and k_pe as they come).
"""
from __future__ import annotations

import torch

from .write_through import write_through


def write_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, host: torch.Tensor | None,
                 host_row: torch.Tensor, pool: torch.Tensor, pool_row: torch.Tensor) -> None:
    """In place: row t = [kv_c[t], k_pe[t]] -> host[host_row[t]] where host_row[t] >= 0 and ->
    pool[pool_row[t]] where pool_row[t] >= 0.

    kv_c: (T, L) and k_pe: (T, Rd), the latent rows' dtype (vLLM's do_kv_cache_update inputs; the
    token stride may be wider); host: (P, 2, 1, 1, (L + Rd) / 2) one layer of core/host_pool's
    pool with one token a page (None: resident mode, host_row all -1); host_row, pool_row: (T,)
    int64 on kv_c's device, -1 = none, the valid ones distinct and in range; pool: (M, L + Rd) one
    layer of the latent pool (core/latent_pool.py)."""
    T, W = kv_c.shape[0], kv_c.shape[1] + k_pe.shape[1]
    if k_pe.shape[0] != T or pool.dim() != 2 or pool.shape[1] != W:
        raise ValueError(f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)} must make rows "
                         f"of the pool's {tuple(pool.shape[1:])} values, one per token")
    if host_row.shape != (T,) or pool_row.shape != (T,):
        raise ValueError(f"host_row {tuple(host_row.shape)} and pool_row {tuple(pool_row.shape)} "
                         f"must be ({T},): one entry per token")
    if kv_c.dtype != pool.dtype or k_pe.dtype != pool.dtype:
        raise ValueError(f"kv_c/k_pe dtype {kv_c.dtype}/{k_pe.dtype} must be the pool's "
                         f"{pool.dtype}; cast them first")
    if T == 0:
        return
    if W % 2:
        raise ValueError(f"latent rows of {W} values cannot be split into a host page's K and V "
                         f"halves; rows must have an even width (576)")
    half = W // 2
    row = torch.cat([kv_c, k_pe], 1)              # the halves straddle kv_c | k_pe: one copy
    k, v = row[:, None, :half], row[:, None, half:]
    tok = torch.arange(T, device=row.device)
    off = torch.zeros_like(host_row)
    if host is not None:
        if host[0].numel() != W or host.shape[1:3] != (2, 1):
            raise ValueError(f"host layer {tuple(host.shape)} must be (pages, 2, 1, 1, {half}): "
                             f"one latent row a page")
        write_through(host, k, v, tok, host_row, off)
    write_through(pool.view(pool.shape[0], 2, 1, 1, half), k, v, tok, pool_row, off)
