"""fp8 (e4m3) KV: the one quantization step, and what the kernels accept.

vLLM's ``--kv-cache-dtype fp8`` (= ``fp8_e4m3``) stores each K (V) value as
``fp8(x / k_scale)`` (``v_scale``), one fp32 scale per layer (1.0 unless the checkpoint brings
calibrated scales), saturated to e4m3's finite range, and reads it back as ``fp8 * scale``.
hisparse quantizes the step's new K/V once, in the attention backend, with ``quantize`` below
(plain torch, so the CPU and the GPU give the same bytes); from there on every tier (the paged
cache, the host pool, the hot buffers, the dense pool) holds those fp8 bytes, and every copy
between tiers moves them as bytes (RESOLVE, write-through, fetch). The kernels that read values
widen fp8 to the query's dtype (exact: e4m3 fits in fp16/bf16/fp32) and attend the stored values;
the layer's scales act outside them: ``k_scale`` multiplies the softmax scale and ``v_scale`` the
attention output (``vllm/backend.py``). Quest's page bounds are kept over the stored values (keys
/ k_scale, a positive per-layer constant: the same pages rank first up to fp32 rounding).
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                       # e4m3fn's largest finite value


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """fp8 e4m3 of x / scale, saturated to +-448 (vLLM's ``scaled_fp8_conversion``; NaN stays
    NaN), rounded to nearest even. x: any float tensor; returns the same shape in FP8."""
    y = x.float() / scale if scale != 1.0 else x.float()
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def kv_dtype_ok(kv: torch.Tensor, q: torch.Tensor) -> bool:
    """A cache the attention kernels read with queries q: q's dtype, or fp8 e4m3."""
    return kv.dtype == q.dtype or kv.dtype == FP8


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t viewed as uint8 when it is fp8 (torch's CPU build lacks index_copy_ and equal for fp8;
    a byte copy is what a KV copy is), else t."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
