"""Random replacement, seeded: each step the victims are a uniformly random subset of the
non-hit slots (empty slots still go first, as for every policy)."""
from __future__ import annotations

import torch

from .base import Policy


class Random(Policy):
    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._gen = None

    def evict_order(self, state, rows, slot_unit, step):
        if self._gen is None or self._gen.device != slot_unit.device:
            self._gen = torch.Generator(device=slot_unit.device).manual_seed(self.seed)
        noise = torch.rand(slot_unit[rows].shape, generator=self._gen, device=slot_unit.device)
        return torch.argsort(noise, dim=1)
