"""The KV-cache spec of a hisparse MLA layer (docs/dsa.md section 1): vLLM's ``MLAAttentionSpec``
with a stub head of ``STUB_BYTES`` per token in place of the 1152 B latent row.

The latent lives in the plugin's pool (core/latent_pool.py), so vLLM's blocks of these layers are
never read or written; the layers stay ``MLAAttentionSpec`` with block 64 so that vLLM keeps them in
the one KV-cache group with the indexer K (``DeepseekV32IndexerCache``, 132 B per token), still
builds their metadata (block table, ``req_id_per_token``) and sizes the group's page per layer as
64 x (16 + 132) B instead of 64 x (1152 + 132) B: the KV budget goes to the indexer K.
"""
from __future__ import annotations

from dataclasses import replace

from vllm_hisparse.core.capacity_mla import STUB_BYTES


def stub_head_size(itemsize: int) -> int:
    """Values per token of the stub for a cache dtype of ``itemsize`` bytes (8 for bf16)."""
    return STUB_BYTES // itemsize


def stub_spec(spec):
    """``spec`` (an MLAAttentionSpec of a hisparse layer) with the stub head size; an fp8_ds_mla
    spec also loses its cache_dtype_str, which would size its page at 656 B a token."""
    import torch

    kw = {"cache_dtype_str": None} if getattr(spec, "cache_dtype_str", None) == "fp8_ds_mla" else {}
    return replace(spec, head_size=stub_head_size(torch.empty((), dtype=spec.dtype).element_size()),
                   **kw)
