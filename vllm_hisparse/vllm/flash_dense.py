"""FlashAttention for the dense rows of the hisparse backend (prefill chunks, short requests, dense
layers) on the GPU: vLLM's own ``flash_attn_varlen_func`` over the paged cache, with the signature
of ``core.sparse_layer.paged_dense_reference`` (the CPU twin).

``num_splits=1`` turns off split-KV: a request's result then depends only on its own queries, keys
and page size, never on which other requests share the batch or on which call attends it (hisparse
mode reads a dense layer's freed pages from a scratch copy) — what keeps hisparse == resident bit
for bit.

``make_decode_fn`` is the other choice, for an engine where no request can be sparse
(``SparseRuntime.use_decode_fn``): FlashAttention picking its own split-KV, like stock vLLM's
decode (whose FULL graphs also cap the splits; here FlashAttention's heuristic sees the block
table's width as the keys bound). Under FA3 the function has a ``plan``: the scheduler metadata,
computed once a step (decode_body.stock_layer, the first layer) and passed to every layer's call,
as stock vLLM's builder does, instead of FlashAttention's prepare kernel inside each call.
Rows are then never attended apart from their batch in one mode and not the other.
"""
from __future__ import annotations

import torch

from .compat import init_logger

logger = init_logger(__name__)


def usable(dtype: torch.dtype, head_size: int) -> bool:
    """FlashAttention runs this dtype and head size (given a CUDA device)."""
    return dtype in (torch.float16, torch.bfloat16) and head_size % 8 == 0 and head_size <= 256


def _flash(num_splits: int):
    """vLLM's paged FlashAttention as paged_dense_reference's signature, with num_splits fixed;
    ``plan``: FA3 scheduler metadata from the function's ``plan`` (None: FlashAttention computes
    it inside the call)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    version = get_flash_attn_version()

    def fn(q, k_cache, v_cache, block_table, cu_q, seq_k, max_q, max_k, scale, out, plan=None):
        flash_attn_varlen_func(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q,
                               max_seqlen_q=max_q, seqused_k=seq_k, max_seqlen_k=max_k,
                               softmax_scale=scale, causal=True, block_table=block_table,
                               fa_version=version, num_splits=num_splits,
                               scheduler_metadata=plan)

    fn.version = version
    return fn


def _planner(num_splits: int):
    """FA3's scheduler metadata for a call of ``_flash(num_splits)`` with these arguments (the
    prepare kernel FlashAttention otherwise runs inside every call): once a step, passed to every
    layer's call, as stock vLLM's metadata builder does (a 4K step profile: FlashAttention's
    prepare kernel once a layer cost 75 us a step at 32 rows x 32 layers, docs/gpu-results.md)."""
    from vllm.v1.attention.backends.fa_utils import get_scheduler_metadata

    def plan(q, k_cache, cu_q, seq_k, max_q, max_k):
        return get_scheduler_metadata(
            batch_size=seq_k.shape[0], max_seqlen_q=max_q, max_seqlen_k=max_k,
            num_heads_q=q.shape[1], num_heads_kv=k_cache.shape[2], headdim=q.shape[2],
            cache_seqlens=seq_k, qkv_dtype=q.dtype, cu_seqlens_q=cu_q,
            page_size=k_cache.shape[1], causal=True, num_splits=num_splits)

    return plan


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
    fn = _flash(1)
    logger.info("hisparse: dense/prefill attention through FlashAttention %s", fn.version)
    return fn


def stock_decode(cfg, model_config) -> bool:
    """This engine decodes every layer through make_decode_fn's FlashAttention
    (decode_body.stock_layer): no request can be sparse and FlashAttention runs the model's dtype
    and head size. The connector plugs it in, graph_mode lets its FULL graphs run: one rule."""
    from vllm_hisparse.core import gpu_pools

    return (not gpu_pools.sparse_possible(cfg, model_config.max_model_len)
            and usable(model_config.dtype, model_config.get_head_size()))


def make_decode_fn(dtype: torch.dtype, head_size: int, kv_dtype: torch.dtype | None = None):
    """FlashAttention over the paged cache with its own split-KV choice (num_splits=0), the
    signature of make_dense_fn's function; None where FlashAttention cannot run (then the decode
    body's kernels decode every row)."""
    if not torch.cuda.is_available() or not usable(dtype, head_size):
        return None
    if kv_dtype is not None and kv_dtype != dtype:
        return None
    fn = _flash(0)
    if fn.version == 3:          # FA2 takes no scheduler metadata
        fn.plan = _planner(0)
    return fn
