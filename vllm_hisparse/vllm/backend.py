"""The hisparse attention backend for vLLM 0.26 (registered as AttentionBackendEnum.CUSTOM).

KV cache per layer: (num_blocks, 2, block_size, Hkv, D), FlashInfer's NHD paged layout, with
block_size == HiSparseConfig.page_size (one block = one page = one hot slot). The backend writes
K/V itself (``forward_includes_kv_cache_update``) and forwards every layer to the vLLM-free
``core.sparse_runtime.SparseRuntime`` through the process's worker object
(``gqa_worker.HiSparseWorker``, vllm/worker.py); the metadata builder only copies what that needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_hisparse.core.kv_quant import run_quantized
from vllm_hisparse.ops.fp8 import FP8
from vllm_hisparse.ops.kernels import DENSE_DECODE_HEAD_SIZES

from . import graph_mode, worker
from .gqa_worker import HiSparseWorker
from .host_block_table import host_block_table
from .compat import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    extract_layer_index,
    get_current_vllm_config,
)
from .deployment import deployment_of
from .profile_span import span


FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")     # e4m3 with vLLM's per-layer k/v scales (ops/fp8.py)


def kv_cache_dtype_error(kv_cache_dtype: str | None) -> str | None:
    """Why hisparse cannot serve this ``--kv-cache-dtype`` (None: it can): the model's dtype
    ("auto") or fp8 e4m3 in every tier."""
    if kv_cache_dtype in (None, "auto", *FP8_CACHE_DTYPES):
        return None
    if kv_cache_dtype == "fp8_ds_mla":
        return ("kv_cache_dtype='fp8_ds_mla' is DeepSeek's MLA cache (indexer 'dsa' only); use "
                "--kv-cache-dtype fp8 (e4m3) or auto")
    return (f"kv_cache_dtype={kv_cache_dtype!r} is not supported (hisparse keeps K/V in the model "
            f"dtype or in fp8 e4m3 with vLLM's per-layer scales); use --kv-cache-dtype fp8 (e4m3) "
            f"or auto")


class HiSparseBackend(AttentionBackend):
    is_hisparse: ClassVar[bool] = True
    forward_includes_kv_cache_update: ClassVar[bool] = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"            # must be an AttentionBackendEnum member (attention.py:434)

    @staticmethod
    def get_impl_cls():
        return HiSparseImpl

    @staticmethod
    def get_builder_cls():
        return HiSparseMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []                  # any head size (the reference ops are generic)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                               has_sink, use_sparse, use_mm_prefix, use_per_head_quant_scales,
                               device_capability, attn_type, has_sliding_window=False,
                               use_non_causal=False, use_batch_invariant=False,
                               use_kv_connector=False, use_pcp=False) -> list[str]:
        why = []
        if use_mla:
            why.append("MLA models are not supported (hisparse supports GQA/MHA decoder models)")
        if use_sparse:
            why.append("models with their own sparse indexer are not supported (Quest only)")
        if has_sink or has_sliding_window or use_non_causal:
            why.append("attention sinks / sliding windows / non-causal layers are not supported")
        if attn_type != AttentionType.DECODER:
            why.append("only decoder self-attention is supported (no encoder-decoder)")
        if dtype not in cls.supported_dtypes:
            why.append(f"dtype {dtype} not supported")
        if (kv_why := kv_cache_dtype_error(kv_cache_dtype)):
            why.append(kv_why)
        return why


@dataclass
class HiSparseMetadata:
    num_actual_tokens: int
    query_start_loc: list[int]        # (B+1,) token offsets
    seq_lens: list[int]               # (B,) including this step's tokens
    first_blocks: list[int]           # (B,) block 0 of each request = its identity
    block_table: torch.Tensor         # (B, W) int32
    slot_mapping: torch.Tensor        # (T,) int64, -1 = padding
    plan: Any = None                  # core.sparse_runtime.StepPlan, made by the first layer
    full: int = 0                     # a uniform decode step: N, its (padded) single-token batch size
    full_rows: int = 0                # its real rows (the first ones; vLLM pads after them)
    pending: bool = False             # plan_full not yet run (HiSparseWorker.plan)


def _host_seq_lens(cm: CommonAttentionMetadata, B: int) -> list[int]:
    """The batch's sequence lengths from the host copy vLLM keeps (exact unless it runs async
    speculative decoding, when it leaves it None and the device copy is read, with a GPU sync)."""
    host = getattr(cm, "_seq_lens_cpu", None)
    return (host if host is not None else cm.seq_lens)[:B].tolist()


def _host_first_blocks(bt: torch.Tensor, qsl: list[int], found: dict) -> list[int]:
    """Block 0 of each row (its request's identity) from vLLM's host block table; -1 (no request)
    for rows without query tokens, vLLM's padding of a FULL-graph batch, whose host rows may be
    stale. Without the host table, the device copy (a GPU sync). found: the worker's
    ``host_tables``."""
    host = host_block_table(bt, found)
    if host is None:
        return bt[:, 0].cpu().tolist()
    first = host[:bt.shape[0], 0].tolist()
    return [b if qsl[i + 1] > qsl[i] else -1 for i, b in enumerate(first)]


class HiSparseMetadataBuilder(AttentionMetadataBuilder[HiSparseMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.worker: HiSparseWorker = worker.of_layer(vllm_config, layer_names[0])

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """FULL graphs of single-token decode steps when full_decode_graphs resolves on
        (vllm/graph_mode.py); vLLM runs other steps (and every step otherwise) PIECEWISE."""
        if graph_mode.full_graphs(vllm_config):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> HiSparseMetadata:
        with span("hisparse.note"):         # the step's host work, named in a profile
            return self._build(common_attn_metadata)

    def _build(self, common_attn_metadata: CommonAttentionMetadata) -> HiSparseMetadata:
        cm = common_attn_metadata
        B = cm.num_reqs
        bt = cm.block_table_tensor[:B]
        qsl = cm.query_start_loc_cpu[:B + 1].tolist()
        md = HiSparseMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl,
            seq_lens=_host_seq_lens(cm, B),
            first_blocks=_host_first_blocks(bt, qsl, self.worker.host_tables),
            block_table=bt,
            slot_mapping=cm.slot_mapping[:cm.num_actual_tokens],
        )
        if B and cm.max_query_len == 1 and self.worker.runtime is not None:
            # A uniform decode step (one query token per row), maybe padded by vLLM to a FULL
            # graph's size (padding rows: no query token, seq_len 0, after the real rows): one
            # decode batch of B rows whatever vLLM then does (replay a graph, or call us eagerly).
            # Its requests are known only once the connector has bound this step's metadata, so
            # the worker plans it there (start_load_kv, still before a graph replay) or, on a run
            # without it, in the first layer. (No runtime yet: vLLM's memory profiling runs before
            # the connector exists; those runs attend nothing.)
            md.full = B
            md.full_rows = sum(1 for i in range(B) if qsl[i + 1] > qsl[i] and md.seq_lens[i] > 0)
            self.worker.note(md)
        return md

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        """vLLM's FULL capture of a batch size: the body records on an all-padding batch (planned
        here, outside the capture: the plan copies from the host)."""
        md = self.build(0, common_attn_metadata)
        if md.full:
            self.worker.plan_capture(md)
        return md


class HiSparseImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 **extra):
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError("hisparse: ALiBi, sliding windows and logit soft-capping "
                                      "are not supported")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("hisparse: cross-layer KV sharing is not supported")
        vc = get_current_vllm_config()
        dep = deployment_of(vc)
        if (dep.cfg.split_dense_decode
                and torch.cuda.is_available() and head_size not in DENSE_DECODE_HEAD_SIZES):
            raise NotImplementedError(
                f"hisparse: split_dense_decode supports head sizes {DENSE_DECODE_HEAD_SIZES} on the "
                f"GPU, this model has {head_size}; set split_dense_decode false (or leave it unset: "
                f"then it is off for this head size)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        why = kv_cache_dtype_error(kv_cache_dtype)
        if why:
            raise NotImplementedError(f"hisparse: {why}")
        self.fp8 = kv_cache_dtype in FP8_CACHE_DTYPES
        # the process's worker object: made by the first layer, found by the next ones
        self.hisparse_worker: HiSparseWorker = worker.find(vc) or HiSparseWorker(dep)
        dtype, util = vc.model_config.dtype, vc.cache_config.gpu_memory_utilization
        kv_dtype = FP8 if self.fp8 else dtype          # every KV tier; Quest bounds stay in dtype
        if self.fp8:
            self.hisparse_worker.kv_dtype = FP8
        self.hisparse_worker.reserve_indexer_state(dtype, gpu_memory_utilization=util)
        self.hisparse_worker.reserve_dense_pool(kv_dtype, gpu_memory_utilization=util)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:                 # profile, warm-up or vLLM's graph-capture run
            return output
        md: HiSparseMetadata = attn_metadata
        T = md.full or md.num_actual_tokens       # a uniform decode step: its N rows
        q = query[:T].view(T, self.num_heads, self.head_size)
        k = key[:T].view(T, self.num_kv_heads, self.head_size)
        v = value[:T].view(T, self.num_kv_heads, self.head_size)
        out = output[:T].view(T, self.num_heads, self.head_size)
        i = extract_layer_index(layer.layer_name)
        if self.fp8:     # the cache e4m3 (HiSparseSpec; a uint8 one viewed so), scales per layer
            run_quantized(lambda q8, k8, v8, kv8, s, o: self.hisparse_worker.run(
                i, md, q8, k8, v8, kv8, s, o), q, k, v, kv_cache.view(FP8), self.scale, out,
                layer._k_scale_float, layer._v_scale_float)
            return output
        self.hisparse_worker.run(i, md, q, k, v, kv_cache, self.scale, out)
        return output
