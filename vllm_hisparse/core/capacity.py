"""Memory per request, stock full KV vs HiSparse: the one formula shared by `hisparse calc`, the
KV-cache spec of the vLLM adapter and the benchmarks.

All sizes are for decode steady state. A request is fully resident while it prefills (bounded by
the few requests prefilling at once), which these per-request figures leave out.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4,
               "float": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class ModelShape:
    """What the KV footprint of a GQA decoder depends on."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def token_bytes_per_layer(self) -> int:
        """K and V of one token of one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, src: str | os.PathLike | dict, dtype: str | None = None) -> "ModelShape":
        """From a HF config.json (dict, file, or model directory)."""
        cfg = src
        if not isinstance(src, dict):
            path = os.fspath(src)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
        if "kv_lora_rank" in cfg:
            raise ValueError("MLA models (kv_lora_rank in config) are not supported by this "
                             "calculator yet; it covers GQA/MHA decoders (Llama/Qwen/Mistral style)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        name = (dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bf16").lower()
        if name not in DTYPE_BYTES:
            raise ValueError(f"--dtype {name!r} is not known; use one of {', '.join(sorted(DTYPE_BYTES))}")
        return cls(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim,
                   DTYPE_BYTES[name])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def baseline_gpu_bytes(m: ModelShape, context: int, block_size: int = 16) -> int:
    """Stock paged KV: every layer holds every token (whole blocks)."""
    return m.num_layers * cdiv(context, block_size) * block_size * m.token_bytes_per_layer


def quest_meta_bytes(m: ModelShape, context: int, page_size: int, meta_bytes: int | None = None) -> int:
    """Per sparse layer: per-page key min and max of every KV head (the indexer's resident state)."""
    eb = m.dtype_bytes if meta_bytes is None else meta_bytes
    return cdiv(context, page_size) * 2 * m.num_kv_heads * m.head_dim * eb


def hisparse_gpu_bytes(m: ModelShape, context: int, buffer_tokens: int, page_size: int,
                       dense_layers: int, quest: bool = True) -> int:
    """Dense layers keep every token; sparse layers keep B tokens (+ Quest page metadata)."""
    sparse = m.num_layers - dense_layers
    per_sparse = min(cdiv(context, page_size) * page_size, buffer_tokens) * m.token_bytes_per_layer
    if quest:
        per_sparse += quest_meta_bytes(m, context, page_size)
    return dense_layers * cdiv(context, page_size) * page_size * m.token_bytes_per_layer + sparse * per_sparse


def hisparse_host_bytes(m: ModelShape, context: int, page_size: int, dense_layers: int) -> int:
    """The host pool holds every token of every sparse layer, in whole pages."""
    return (m.num_layers - dense_layers) * cdiv(context, page_size) * page_size * m.token_bytes_per_layer


def max_requests(gpu_bytes_total: float, gpu_per_req: int, host_bytes_total: float | None = None,
                 host_per_req: int = 0) -> tuple[int, str]:
    """(how many requests fit, "gpu" or "host": which resource bounds it)."""
    n_gpu = int(gpu_bytes_total // gpu_per_req) if gpu_per_req else 1 << 62
    if host_bytes_total is None or host_per_req == 0:
        return n_gpu, "gpu"
    n_host = int(host_bytes_total // host_per_req)
    return (n_gpu, "gpu") if n_gpu <= n_host else (n_host, "host")
