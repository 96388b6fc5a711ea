"""First in, first out: misses enter at the front in selection order; hits do not move."""
from __future__ import annotations

import torch

from . import register
from .base import Policy, StepInfo, reorder


@register
class FIFO(Policy):
    name = "fifo"

    def init_state(self, rows, slots, device):
        return {"order": torch.arange(slots, device=device, dtype=torch.int32).repeat(rows, 1)}

    def evict_order(self, state, rows, slot_unit, step):
        return state["order"][rows].flip(1).long()

    def update(self, state, info: StepInfo):
        order = state["order"]
        order[info.rows] = reorder(order[info.rows], info, hit_key=False, miss_key=True)
