"""A third indexer, for tests only (issue 44 item 3): the newest pages win, a sliding window over
the context (StreamingLLM-like, without sinks). It keeps Quest's page bounds as its state (the
decode write folds each new key into them) and replaces the scores: unit u of a row scores u, so
the top-k is the row's last k pages. This file and one ``indexers.register`` line serve it through
vLLM (tests/test_third_indexer.py); nothing else in the package names it."""
from __future__ import annotations

import torch

from vllm_hisparse.core.indexers.base import Indexer
from vllm_hisparse.core.indexers.quest.indexer import QuestIndexer


class RecentIndexer(QuestIndexer):
    name = "recent"
    state_name = "recent-window page bounds"
    scored = 0               # score calls in this process (the test reads it)

    def score(self, layer, q, rows, num_units, out):
        """out (R, U) fp32: unit u scores u (units past num_units[r] are ignored)."""
        out.copy_(torch.arange(out.shape[1], dtype=out.dtype, device=out.device).expand_as(out))
        RecentIndexer.scored += 1

    def write_and_score(self, layer, write, i_unit, q, rows, num_units, out):
        Indexer.write_and_score(self, layer, write, i_unit, q, rows, num_units, out)
