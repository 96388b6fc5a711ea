"""FlashAttention for the dense rows of the hisparse backend (prefill chunks, short requests, dense
layers) on the GPU: vLLM's own ``flash_attn_varlen_func`` over the paged cache, with the signature
of ``core.sparse_layer.paged_dense_reference`` (the CPU twin).

``num_splits=1`` turns off split-KV: a request's result then depends only on its own queries, keys
and page size, never on which other requests share the batch or on which call attends it (hisparse
mode reads a dense layer's freed pages from a scratch copy) — what keeps hisparse == resident bit
for bit.
"""
from __future__ import annotations

import torch

from .compat import init_logger

logger = init_logger(__name__)


def usable(dtype: torch.dtype, head_size: int) -> bool:
    """FlashAttention runs this dtype and head size (given a CUDA device)."""
    return dtype in (torch.float16, torch.bfloat16) and head_size % 8 == 0 and head_size <= 256


def _flash():
    """vLLM's paged FlashAttention as paged_dense_reference's signature, split-KV off
    (num_splits=1: the module docstring says why)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    version = get_flash_attn_version()

    def fn(q, k_cache, v_cache, block_table, cu_q, seq_k, max_q, max_k, scale, out):
        flash_attn_varlen_func(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q,
                               max_seqlen_q=max_q, seqused_k=seq_k, max_seqlen_k=max_k,
                               softmax_scale=scale, causal=True, block_table=block_table,
                               fa_version=version, num_splits=1)

    fn.version = version
    return fn


def make_dense_fn(dtype: torch.dtype, head_size: int, kv_dtype: torch.dtype | None = None):
    """The FlashAttention dense function (num_splits=1), or None (with the reason logged once) where
    it cannot run: no CUDA, fp32 models, head sizes FlashAttention lacks, an fp8 cache (kv_dtype:
    the cache's dtype when it is not the model's)."""
    if not torch.cuda.is_available():
        return None
    if kv_dtype is not None and kv_dtype != dtype:
        logger.warning("hisparse: dense/prefill attention runs in plain torch over the %s KV cache "
                       "(FlashAttention's fp8 path needs an fp8 query, not wired up yet); expect "
                       "slow prefill", kv_dtype)
        return None
    if not usable(dtype, head_size):
        logger.warning("hisparse: dense/prefill attention runs in plain torch (dtype %s, head size "
                       "%d: FlashAttention needs fp16/bf16 and head size <= 256, multiple of 8); "
                       "expect slow prefill", dtype, head_size)
        return None
    fn = _flash()
    logger.info("hisparse: dense/prefill attention through FlashAttention %s", fn.version)
    return fn
