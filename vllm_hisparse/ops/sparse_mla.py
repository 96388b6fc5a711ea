"""Sparse MLA decode attention, plain torch: what vLLM 0.26's FLASH_ATTN_MLA_SPARSE computes for one
query row over the token rows its indexer selected (v1/attention/backends/mla/
flashattn_mla_sparse.py ``forward_mqa``).

The MLA cache holds one *latent row* per token per layer: ``LATENT_ROW = 576`` values,
``kv_lora_rank = 512`` compressed KV ``c`` then ``qk_rope_head_dim = 64`` rotated key ``k_pe``
(bf16: ``LATENT_ROW_BYTES = 1152`` B). The query arrives absorbed (mla_attention.py: ``q_nope``
(T, H, 128) @ ``W_UK_T`` -> ``ql_nope`` (T, H, 512)) next to ``q_pe`` (T, H, 64); vLLM calls
FlashAttention 3 with ``q=q_pe, k=k_pe, q_v=ql_nope, v=c``, one token per page and the selected
rows as the page table, so per head h and selected token j:

    s[h, j] = scale * (ql_nope[h] . c[j] + q_pe[h] . k_pe[j])
    out[h]  = sum_j softmax_j(s[h, :]) * c[j]                       (T, H, 512): the latent output

``c`` is both the nope key and the value (vLLM then up-projects ``out`` with ``W_UV``); ``scale``
is the layer's softmax scale (``qk_head_dim ** -0.5``, times ``mscale ** 2`` with YaRN). Index -1
(padding, and out-of-range positions, which ``triton_convert_req_index_to_global_index`` turns into
-1) attends nothing; a row with no valid index gives 0.
"""
from __future__ import annotations

import torch

KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT_ROW = KV_LORA_RANK + ROPE_DIM            # 576 values per token per layer
LATENT_ROW_BYTES = LATENT_ROW * 2               # bf16/fp16: 1152 B


def sparse_mla_decode(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                      idx: torch.Tensor, scale: float) -> torch.Tensor:
    """(R, H, L) latent attention output of each query row over the latent rows idx selects.

    ql_nope: (R, H, L) absorbed nope query; q_pe: (R, H, Rd) rope query; kv: (M, L + Rd) latent
    rows (any float dtype; one row per token slot); idx: (R, K) int rows of kv, -1 = none; scale:
    softmax scale. Computed in fp32 in the order of idx's columns; returned in ql_nope's dtype."""
    R, H, L = ql_nope.shape
    if kv.dim() != 2 or kv.shape[1] != L + q_pe.shape[2]:
        raise ValueError(f"kv must be (M, {L + q_pe.shape[2]}) latent rows; got {tuple(kv.shape)}")
    if idx.dim() != 2 or idx.shape[0] != R:
        raise ValueError(f"idx must be ({R}, K); got {tuple(idx.shape)}")
    valid = idx >= 0
    rows = kv[idx.long().clamp(min=0)].float()               # (R, K, L + Rd)
    c, k_pe = rows[..., :L], rows[..., L:]
    s = (torch.einsum("rhl,rkl->rhk", ql_nope.float(), c)
         + torch.einsum("rhd,rkd->rhk", q_pe.float(), k_pe)) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)             # all -inf (no valid index): 0
    return torch.einsum("rhk,rkl->rhl", p, c).to(ql_nope.dtype)
