"""The DSA write path (docs/dsa.md section 3): a step's new latent rows of one layer (in the pool's
format, ``LatentPool.rows_of``: ``[kv_c, k_pe]``, or fp8_ds_mla's packed bytes) through to the host
pool and, for tokens whose request holds a region (in prefill, lent, or resident mode), into the latent
pool at ``region_base + position``.

Both go through ``ops/write_through.py``, a row being one "token" of K and V halves (288 values, or
328 bytes: the host page's layout; the pool viewed as (M, 2, 1, 1, half)): on CUDA its kernel, UVA
stores into the pinned pool and plain stores into the GPU pool, -1 = no-op, no host sync (two
launches a layer, after ``rows_of``'s concatenation or packing).
"""
from __future__ import annotations

import torch

from .write_through import write_through


def write_latent_rows(rows: torch.Tensor, host: torch.Tensor | None, host_row: torch.Tensor,
                      pool: torch.Tensor, pool_row: torch.Tensor) -> None:
    """In place: rows[t] -> host[host_row[t]] where host_row[t] >= 0 and -> pool[pool_row[t]]
    where pool_row[t] >= 0; rows are opaque (bf16 [kv_c, k_pe], or fp8_ds_mla's 656 bytes).

    rows: (T, W) the pool's dtype; host: (P, 2, 1, 1, W / 2) one layer of core/host_pool's pool
    with one token a page (None: resident mode, host_row all -1); host_row, pool_row: (T,) int64
    on rows' device, -1 = none, the valid ones distinct and in range; pool: (M, W) one layer of
    the latent pool (core/latent_pool.py)."""
    T, W = rows.shape
    if pool.dim() != 2 or pool.shape[1] != W:
        raise ValueError(f"rows {tuple(rows.shape)} must be rows of the pool's "
                         f"{tuple(pool.shape[1:])} values, one per token")
    if host_row.shape != (T,) or pool_row.shape != (T,):
        raise ValueError(f"host_row {tuple(host_row.shape)} and pool_row {tuple(pool_row.shape)} "
                         f"must be ({T},): one entry per token")
    if rows.dtype != pool.dtype:
        raise ValueError(f"rows dtype {rows.dtype} must be the pool's {pool.dtype}")
    if T == 0:
        return
    if W % 2:
        raise ValueError(f"latent rows of {W} values cannot be split into a host page's K and V "
                         f"halves; rows must have an even width (576, 656)")
    half = W // 2
    k, v = rows[:, None, :half], rows[:, None, half:]
    tok = torch.arange(T, device=rows.device)
    off = torch.zeros_like(host_row)
    if host is not None:
        if host[0].numel() != W or host.shape[1:3] != (2, 1):
            raise ValueError(f"host layer {tuple(host.shape)} must be (pages, 2, 1, 1, {half}): "
                             f"one latent row a page")
        write_through(host, k, v, tok, host_row, off)
    write_through(pool.view(pool.shape[0], 2, 1, 1, half), k, v, tok, pool_row, off)
