"""DSA behind the indexer interface (core/indexers/base.py), plain torch (ops/dsa_indexer.py).

Unit = one token. State, per sparse layer: the indexer's own K cache of every token of a row,
``k_fp8`` (rows + 1, U, D) float8_e4m3fn and ``k_scale`` (rows + 1, U) fp32 with D =
``index_head_dim`` (128): ``k_token_bytes(D) = 132`` B per token per layer, as vLLM keeps it. A
decode row's scores are the lightning indexer's logits over its tokens; their top-k is the DSA
selection (``dsa_indexer.indexer_topk``, or the runtime's select_resolve on the same logits).

On the GPU the indexer K stays where vLLM 0.26 puts it (its paged cache, in the latent's KV-cache
group; docs/dsa.md) and vLLM's indexer writes it and selects: the served path (vllm/mla_backend.py,
through the registry) asks this class only for ``mla_selection``, vLLM's top-k buffer as it is;
instances are the CPU reference of that state and of the selection. The GQA-shaped interface
arguments read as: ``head_dim`` = index_head_dim, ``k`` (T, D) or (T, 1, D) the indexer keys,
``q`` of ``score`` the pair (q (R, H, D), w (R, H)).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_hisparse.core.indexers.base import Indexer
from vllm_hisparse.ops.dsa_indexer import indexer_logits, k_token_bytes, quantize_k


class DSAIndexer(Indexer):
    name = "dsa"
    state_name = "DSA indexer K cache"
    serves = "mla"

    @staticmethod
    def unit_tokens(cfg) -> int:
        return 1

    @classmethod
    def mla_selection(cls, topk_buffer, num_tokens, layer):
        """The served path: vLLM's lightning indexer (the model's ``Indexer`` module) selected
        already; its top-k rows of the step's tokens, as written (a view, no copy)."""
        return topk_buffer[:num_tokens]

    @classmethod
    def row_bytes(cls, sparse_layers, num_kv_heads, head_dim, dtype_bytes, max_model_len,
                  page_size):
        """Indexer K of every token of a max_model_len request, every sparse layer (head_dim =
        index_head_dim; the model's KV heads and dtype do not enter)."""
        return sparse_layers * max_model_len * k_token_bytes(head_dim)

    @classmethod
    def allocate_state(cls, cfg, num_layers, rows, max_model_len, num_kv_heads, head_dim, dtype,
                       device):
        def mk(i, shape, dt):
            return None if i in cfg.dense_layers else torch.zeros(shape, dtype=dt, device=device)
        return ([mk(i, (rows + 1, max_model_len, head_dim), torch.float8_e4m3fn)
                 for i in range(num_layers)],
                [mk(i, (rows + 1, max_model_len), torch.float32) for i in range(num_layers)])

    def check_state(self, state) -> None:
        if any(t is not None and t.shape[0] != self.rows + 1 for t in state[0]):
            raise ValueError(f"the DSA state must have rows + 1 = {self.rows + 1} rows")

    def plan_tokens(self, start, seq, row):
        n = seq - start
        k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        return {"flat": np.repeat(row, n) * self.U + np.repeat(start, n) + k}

    def device_update(self, arrays):
        return arrays["flat"]

    def update(self, layer, upd, k):
        kf8, ks = self.state[0][layer], self.state[1][layer]
        if kf8 is None:
            return
        q8, s = quantize_k(k.reshape(k.shape[0], -1))
        kf8.view(-1, kf8.shape[-1])[upd] = q8
        ks.view(-1)[upd] = s

    def decode_unit(self, row, seq):
        return row * self.U + seq - 1

    def decode_write_kwargs(self, layer, i_unit):
        raise NotImplementedError(
            "the DSA indexer's keys are written by vLLM's own indexer on the GPU (docs/dsa.md), "
            "not by the page-cache decode write; serve indexer='quest' with this runtime")

    def score(self, layer, q, rows, num_units, out):
        qi, w = q
        out.copy_(indexer_logits(qi, w, self.state[0][layer][rows], self.state[1][layer][rows],
                                 num_units))
