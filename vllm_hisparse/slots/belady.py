"""Bélády's MIN (offline optimal): evict the unit whose next use lies farthest in the future.

Needs the future, so it runs in the simulator only. ``next_use(rows, units, step)`` is supplied by
the caller (the simulator derives it from the trace): for each (row, unit) the first step > step
at which the unit is selected again, or a huge value if never.
"""
from __future__ import annotations

from typing import Callable

import torch

from .base import Policy

NEVER = 1 << 62


class Belady(Policy):
    name = "belady"
    offline = True

    def __init__(self, next_use: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None):
        self.next_use = next_use

    def evict_order(self, state, rows, slot_unit, step):
        if self.next_use is None:
            raise RuntimeError("policy 'belady' needs future knowledge: it runs in the simulator only")
        units = slot_unit[rows].long()
        nxt = self.next_use(rows, units.clamp(min=0), step)
        nxt = torch.where(units < 0, torch.full_like(nxt, NEVER), nxt)
        return torch.argsort(nxt, dim=1, descending=True, stable=True)
