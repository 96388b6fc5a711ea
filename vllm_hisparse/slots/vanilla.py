"""Vanilla: the buffer holds only the previous step's selection (rebuilt every step); a unit is a
hit only if the previous step selected it too. The comparison point of the paper's replay."""
from __future__ import annotations

import torch

from .base import Policy


class Vanilla(Policy):
    name = "vanilla"
    retain = False

    def evict_order(self, state, rows, slot_unit, step):
        S = slot_unit.shape[1]
        return torch.arange(S, device=slot_unit.device, dtype=torch.int64).repeat(len(rows), 1)
