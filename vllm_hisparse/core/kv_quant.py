"""An fp8 KV cache at the runtime's door (ops/fp8.py says what is stored and why).

The runtime and its kernels take K/V already in the cache's dtype and attend the stored values;
``run_quantized`` is the one place that turns the model's K/V and a layer's scales into that:
the step's new K (V) quantized once with the layer's ``k_scale`` (``v_scale``), ``k_scale`` folded
into the softmax scale (q . (k8 * ks) * scale == q . k8 * (scale * ks)) and ``v_scale`` applied
to the output (sum p * (v8 * vs) == vs * sum p * v8; in the output's dtype, after the kernels,
one more rounding than inside them: a no-op at vLLM's default scale 1.0). The vLLM backend calls
it for every layer; the runtime exactness tests call it as the backend does.
"""
from __future__ import annotations

from typing import Callable

import torch

from vllm_hisparse.ops.fp8 import quantize


def run_quantized(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv: torch.Tensor, scale: float, out: torch.Tensor, k_scale: float,
                  v_scale: float) -> None:
    """fn(q, k8, v8, kv, scale * k_scale, out) (the runtime's forward_layer / full_layer
    arguments after the layer and plan), then out *= v_scale. q/out (T, Hq, D) model dtype;
    k/v (T, Hkv, D) model dtype; kv the layer's fp8 cache (N, 2, P, Hkv, D)."""
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"fp8 KV: k_scale={k_scale}, v_scale={v_scale} must be > 0 (vLLM's "
                         f"per-layer scales; 1.0 when the checkpoint has none)")
    fn(q, quantize(k, k_scale), quantize(v, v_scale), kv, scale * k_scale, out)
    if v_scale != 1.0:
        out.mul_(v_scale)
