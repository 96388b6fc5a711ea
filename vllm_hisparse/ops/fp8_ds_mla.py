"""The fp8_ds_mla latent row (vLLM ``--kv-cache-dtype fp8_ds_mla``, FLASHMLA_SPARSE's cache, the
DeepSeek-V3.2 "FP8 with scale" format): one token of one layer in ``ROW_BYTES = 656`` bytes,

    [ 512 x float8_e4m3 nope | 4 x float32 scale (one per 128 nope values) | 64 x bf16 rope ]

nope value i of tile t = ``fp8(c[i] / scale[t])`` with ``scale[t] = max(amax(|c| over the tile) /
448, FLT_MIN)`` (the tile's largest value maps to e4m3's largest finite 448; an all-zero tile gets
the smallest normal float, vLLM's ``concat_and_cache_ds_mla_kernel``); the rope part is kept as it
came (bf16, unquantized). Read back: ``c[i] = float(fp8[i]) * scale[t]``.

For hisparse a row is opaque bytes (RESOLVE, write-through and the host pool move 656 B as they
move 1152 B bf16 rows); what writes the bytes is ``pack`` here on the CPU (the plain-torch
reference) and, served on a GPU, vLLM's own ``concat_and_cache_mla`` (the adapter's), so that stock
and hisparse hold the same bytes. ``unpack`` is the reference reader: sparse MLA attention over
packed rows is ``sparse_mla_decode`` over ``unpack``'s values (what FlashMLA's fp8 kernel widens).
"""
from __future__ import annotations

import torch

from .fp8 import FP8, FP8_MAX
from .sparse_mla import KV_LORA_RANK, ROPE_DIM

TILE = 128
TILES = KV_LORA_RANK // TILE                       # 4 scales
SCALE_AT = KV_LORA_RANK                            # byte offset of the scales
ROPE_AT = SCALE_AT + TILES * 4                     # byte offset of the rope part (528)
ROW_BYTES = ROPE_AT + ROPE_DIM * 2                 # 656


def row_bytes(kv_lora_rank: int = KV_LORA_RANK, rope_dim: int = ROPE_DIM) -> int:
    """Bytes of one packed row (656 for DeepSeek-V3.2's 512 + 64)."""
    return kv_lora_rank + kv_lora_rank // TILE * 4 + rope_dim * 2


def _check_shapes(kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    if kv_c.dim() != 2 or kv_c.shape[1] != KV_LORA_RANK or k_pe.shape != (kv_c.shape[0], ROPE_DIM):
        raise ValueError(f"fp8_ds_mla packs kv_c (T, {KV_LORA_RANK}) and k_pe (T, {ROPE_DIM}); got "
                         f"{tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
    if k_pe.dtype != torch.bfloat16:
        raise ValueError(f"fp8_ds_mla keeps the rope part in bf16; k_pe is {k_pe.dtype}")


def pack(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """(T, ROW_BYTES) uint8 rows of kv_c (T, 512) and k_pe (T, 64) bf16 (the reference packer;
    vLLM's CUDA kernel divides in fp32 and rounds to nearest even the same way; a GPU run checks
    its bytes against this, tests/test_fp8_ds_mla.py)."""
    _check_shapes(kv_c, k_pe)
    T = kv_c.shape[0]
    c = kv_c.float().view(T, TILES, TILE)
    scale = (c.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (T, 4)
    q = c / scale[..., None]
    out = torch.empty(T, ROW_BYTES, dtype=torch.uint8, device=kv_c.device)
    out[:, :SCALE_AT] = q.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(T, KV_LORA_RANK).view(torch.uint8)
    out[:, SCALE_AT:ROPE_AT] = scale.contiguous().view(torch.uint8).view(T, TILES * 4)
    out[:, ROPE_AT:] = k_pe.contiguous().view(torch.uint8).view(T, ROPE_DIM * 2)
    return out


def unpack(rows: torch.Tensor) -> torch.Tensor:
    """(M, 576) float32 latent values [c, k_pe] of packed rows (M, ROW_BYTES) uint8."""
    if rows.dim() != 2 or rows.shape[1] != ROW_BYTES or rows.dtype != torch.uint8:
        raise ValueError(f"fp8_ds_mla rows must be (M, {ROW_BYTES}) uint8; got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    M = rows.shape[0]
    r = rows.contiguous()
    nope = r[:, :SCALE_AT].view(FP8).float().view(M, TILES, TILE)
    scale = r[:, SCALE_AT:ROPE_AT].view(torch.float32).view(M, TILES, 1)
    rope = r[:, ROPE_AT:].view(torch.bfloat16).float()
    return torch.cat([(nope * scale).view(M, KV_LORA_RANK), rope], 1)
