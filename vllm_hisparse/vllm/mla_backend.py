"""The hisparse backend of MLA models with a DSA indexer (DeepSeek-V3.2 style; docs/dsa.md): vLLM
0.26's FLASH_ATTN_MLA_SPARSE with the latent in the plugin's pool.

Registered as CUSTOM like the GQA backend (plugin.route picks this class for MLA layers with a
sparse indexer). vLLM's blocks of these layers hold a stub (vllm/mla_spec.py), never read; the
impl forwards to the ``core.latent_runtime.LatentRuntime`` of the process's worker object
(``mla_worker.LatentWorker``, vllm/worker.py):

- ``do_kv_cache_update``: the step's latent rows to the host pool (write-through) and, for requests
  holding a region (prefill; resident mode: always), to the region (``LatentRuntime.write``);
- ``forward_mqa``: the stock method with ``triton_convert_req_index_to_global_index`` replaced by
  ``LatentRuntime.convert`` (region rows for prefill, RESOLVE of the indexer's selection into the
  row set's hot slots for decode), then the same FA3 call over ``pool.rows[layer]``, with FA3's
  ``num_splits`` from the config (``mla_num_splits``; 0 = stock's). The selection is the
  configured indexer's (core/indexers, ``Indexer.mla_selection`` through ``LatentWorker.select``;
  DSA's is vLLM's ``topk_indices_buffer`` as its lightning indexer wrote it).

The plan both read lives in fixed-address buffers (core/latent_graph.py), loaded by the KV
connector's ``start_load_kv`` from the batch this builder notes, so vLLM's FULL decode CUDA graphs
(the stock builder's UNIFORM_BATCH support) replay each step with that step's plan.
Importing this module needs vLLM's CUDA flash-attention build.
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.mla.flashattn_mla_sparse import (
    FlashAttnMLASparseBackend,
    FlashAttnMLASparseImpl,
    FlashAttnMLASparseMetadataBuilder,
)
from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

from .compat import get_current_vllm_config
from .deployment import config_of
from .mla_impl import LatentBackend, LatentBuilder, LatentImpl


class HiSparseMLASparseBackend(LatentBackend, FlashAttnMLASparseBackend):
    @staticmethod
    def get_impl_cls():
        return HiSparseMLASparseImpl

    @staticmethod
    def get_builder_cls():
        return HiSparseMLASparseMetadataBuilder


class HiSparseMLASparseMetadataBuilder(LatentBuilder, FlashAttnMLASparseMetadataBuilder):
    """The stock builder (its metadata, its CUDA-graph support), which also notes the batch's
    host-side shape for the connector to plan (``LatentBuilder``)."""


class HiSparseMLASparseImpl(LatentImpl, FlashAttnMLASparseImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vc = get_current_vllm_config()
        self.num_splits = config_of(vc).mla_num_splits
        self._start_hisparse(self.kv_lora_rank + self.qk_rope_head_dim, vc.model_config.dtype)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if not isinstance(q, tuple):
            raise NotImplementedError("HiSparseMLASparseImpl expects split (q_nope, q_rope) input")
        q_nope, q_rope = q
        T = q_rope.shape[0]
        rt = self.hisparse_worker.runtime
        li = self._layer_index()
        topk = self.hisparse_worker.select(li, self.topk_indices_buffer, T)   # the indexer's
        idx, valid = rt.convert(li, topk)
        kv = rt.pool.rows[li]                                  # (M, kv_lora_rank + rope)
        k_cache = kv[:, self.kv_lora_rank:].view(-1, 1, 1, self.qk_rope_head_dim)
        v_cache = kv[:, :self.kv_lora_rank].view(-1, 1, 1, self.kv_lora_rank)
        cu_seqlens_q = torch.arange(0, T + 1, dtype=torch.int32, device=q_rope.device)
        out = flash_attn_varlen_func(
            q=q_rope, k=k_cache, v=v_cache, q_v=q_nope, max_seqlen_q=1,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_k=idx.shape[1], seqused_k=valid,
            block_table=idx, softmax_scale=self.scale, causal=True,
            num_splits=self.num_splits, fa_version=3)
        return out, None
