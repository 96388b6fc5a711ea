"""The DSA lightning indexer's decode top-k, plain torch (DeepSeek-V3.2 as vLLM 0.26 runs it:
model_executor/models/deepseek_v2.py ``Indexer``, layers/sparse_attn_indexer.py, and the torch
twin ``fp8_paged_mqa_logits_torch`` in v1/attention/ops/rocm_aiter_mla_sparse.py).

Indexer K cache, per token per layer: ``index_head_dim`` (128) fp8 e4m3 values and one fp32 scale
per 128 values (``quant_block_size``): ``k_token_bytes(128) = 132`` B (vLLM's spec:
``MLAAttentionSpec(head_size=132, uint8)``). The decode logits of a query row over its tokens j:

    logit[j] = k_scale[j] * sum_h w[h] * relu(q[h] . k_fp8[j])

with q (H = index_n_heads = 64, 128) the fp8 query and w (H,) fp32 the per-head weights already
multiplied by q's scale, ``index_head_dim ** -0.5`` and ``index_n_heads ** -0.5``. The selection is
the ``index_topk`` (2048) tokens of largest logit among [0, seq_len), written as logical token
positions, -1 after them when seq_len < top_k (vLLM fills the buffer with -1 first).
"""
from __future__ import annotations

import torch

QUANT_BLOCK = 128
FP8_MAX = 448.0                                  # float8_e4m3fn's largest finite value


def k_token_bytes(index_head_dim: int = 128) -> int:
    """Indexer K cache bytes of one token of one layer: fp8 values + one fp32 scale per block."""
    return index_head_dim + index_head_dim // QUANT_BLOCK * 4


def quantize_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_fp8 (T, D) float8_e4m3fn, scale (T,) fp32) of keys k (T, D = 128), one power-of-two scale
    per token (vLLM's ``scale_fmt="ue8m0"``: 2 ** ceil(log2(amax / 448)))."""
    if k.shape[-1] != QUANT_BLOCK:
        raise ValueError(f"indexer keys must have {QUANT_BLOCK} values; got {tuple(k.shape)}")
    amax = k.float().abs().amax(-1).clamp(min=1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return (k.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def indexer_logits(q: torch.Tensor, w: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor,
                   seq_lens: torch.Tensor) -> torch.Tensor:
    """(R, N) fp32 logits of query rows over key rows, -inf at and past seq_lens[r].

    q: (R, H, D) (fp8 or float); w: (R, H) fp32; k_fp8: (R, N, D) or (N, D) (shared by the rows);
    k_scale: (R, N) or (N,) fp32; seq_lens: (R,) int."""
    kf = k_fp8.float()
    if kf.dim() == 2:
        kf, k_scale = kf[None].expand(q.shape[0], -1, -1), k_scale[None].expand(q.shape[0], -1)
    s = torch.einsum("rhd,rnd->rhn", q.float(), kf).relu()
    logits = (s * w.float()[:, :, None]).sum(1) * k_scale.float()
    n = torch.arange(logits.shape[1], device=logits.device)
    return logits.masked_fill(n[None] >= seq_lens.long()[:, None].to(logits.device), float("-inf"))


def indexer_topk(logits: torch.Tensor, seq_lens: torch.Tensor, top_k: int) -> torch.Tensor:
    """(R, top_k) int32 logical positions: the min(top_k, seq_len) largest logits of each row (in
    descending logit order, ties to the lower position), -1 after them."""
    R, N = logits.shape
    k = min(top_k, N)
    order = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :k]
    out = torch.full((R, top_k), -1, dtype=torch.int32, device=logits.device)
    live = torch.arange(k, device=logits.device)[None] < seq_lens.long()[:, None].to(logits.device)
    out[:, :k] = torch.where(live, order, -1).to(torch.int32)
    return out
