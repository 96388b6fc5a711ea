"""Least recently used: hits move to the MRU end in selection order, fetched misses right after
them; victims come from the LRU end. Identical to the CUDA RESOLVE kernel's metadata update."""
from __future__ import annotations

import torch

from .base import Policy, StepInfo, reorder


class LRU(Policy):
    name = "lru"
    kernel = 0
    kernel_state = "order"

    def init_state(self, rows, slots, device):
        # order[r, p] = local slot at recency position p, MRU first.
        return {"order": torch.arange(slots, device=device, dtype=torch.int32).repeat(rows, 1)}

    def evict_order(self, state, rows, slot_unit, step):
        return state["order"][rows].flip(1).long()

    def update(self, state, info: StepInfo):
        order = state["order"]
        order[info.rows] = reorder(order[info.rows], info, hit_key=True, miss_key=True)
