"""Quest behind the indexer interface (core/indexers/base.py).

State, per sparse layer: ``kmin``/``kmax`` (rows + 1, U, Hkv, D) in the model dtype, the min and
max key of every page (``page_size`` tokens) of every KV head, one row per sparse request admitted
at once + the scratch row. A page's score is the upper bound of q.k (ops/quest.py); new keys fold
in with ops/quest_update.py (prefill, a request turning sparse) or inside the fused decode write,
which in a sparse layer also scores the pages (ops/decode_ops.decode_write_score: one launch).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_hisparse.core.indexers.base import Indexer
from vllm_hisparse.ops import decode_ops
from vllm_hisparse.ops.quest import quest_scores_rows
from vllm_hisparse.ops.quest_update import quest_update_pages


class QuestIndexer(Indexer):
    name = "quest"
    state_name = "Quest page bounds"

    @staticmethod
    def unit_tokens(cfg) -> int:
        return cfg.page_size

    @classmethod
    def row_bytes(cls, sparse_layers, num_kv_heads, head_dim, dtype_bytes, max_model_len,
                  page_size):
        """Key min and max per page of every KV head, ``cdiv(max_model_len, page)`` pages, every
        sparse layer; model dtype."""
        pages = -(-max_model_len // page_size)
        return sparse_layers * 2 * pages * num_kv_heads * head_dim * dtype_bytes

    @classmethod
    def allocate_state(cls, cfg, num_layers, rows, max_model_len, num_kv_heads, head_dim, dtype,
                       device):
        shape = (rows + 1, -(-max_model_len // cfg.page_size), num_kv_heads, head_dim)
        mk = lambda i: (None if i in cfg.dense_layers  # noqa: E731
                        else torch.zeros(shape, dtype=dtype, device=device))
        return ([mk(i) for i in range(num_layers)], [mk(i) for i in range(num_layers)])

    def check_state(self, state) -> None:
        if any(t is not None and t.shape[0] != self.rows + 1 for t in state[0]):
            raise ValueError(f"the Quest state must have rows + 1 = {self.rows + 1} rows")

    @property
    def kmin(self) -> list:
        return self.state[0]

    @property
    def kmax(self) -> list:
        return self.state[1]

    def plan_tokens(self, start, seq, row):
        P, U = self.P, self.U
        n = seq - start                                  # tokens per request
        k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)      # index within its request
        pos = np.repeat(start, n) + k
        p0 = start // P
        m = (seq - 1) // P - p0 + 1                      # pages each request touches
        mbase = np.cumsum(m) - m
        page = np.repeat(p0, m) + np.arange(m.sum()) - np.repeat(mbase, m)
        return {"tok_page": pos // P - np.repeat(p0, n) + np.repeat(mbase, n),
                "page": np.repeat(row, m) * U + page,
                "new": (page * P >= np.repeat(start, m)).astype(np.int64)}

    def device_update(self, arrays):
        return arrays["page"], arrays["new"].bool(), arrays["tok_page"]

    def update(self, layer, upd, k):
        if self.kmin[layer] is not None:
            page, new, tok_page = upd
            quest_update_pages(self.kmin[layer], self.kmax[layer], page, new, tok_page, k)

    def decode_unit(self, row, seq):
        return row * self.U + (seq - 1) // self.P

    def decode_write_kwargs(self, layer, i_unit):
        return {"kmin": self.kmin[layer], "kmax": self.kmax[layer], "q_page": i_unit}

    def score(self, layer, q, rows, num_units, out):
        quest_scores_rows(q, self.kmin[layer], self.kmax[layer], rows, num_units, out,
                          live_only=True)

    def write_and_score(self, layer, write, i_unit, q, rows, num_units, out):
        decode_ops.decode_write_score(*write, self.kmin[layer], self.kmax[layer], i_unit, q, rows,
                                      num_units, out)
