"""CRF ("combined recency and frequency"): evict the slot whose decayed selection count is lowest.
Online, one int32 of state per slot, integer arithmetic only, so the served RESOLVE kernel
(ops/triton_select.py, branch ``kernel = 1``) and this reference agree bit for bit.

Per resolve of a row (rows whose selection is all -1 are left alone, as by every policy):

  value of every occupied slot   v <- v - (v >> shift)        decay 1 - 2**-shift per step
  a hit                          v <- decayed v + HIT
  a miss (the unit is fetched)   v <- HIT // 2                a unit picked once is a weaker bet
  an empty slot                  v = -1

Victims are the non-hit slots in ascending (value, slot index) order, empty slots (-1) first;
the i-th miss in selection order takes the i-th victim (the engine's rule). The values stay below
2**15 (with shift 4 they never pass 16399, the fixed point of ``v = v - v//16 + HIT``), so the
kernel sorts the key ``(v + 1) << 16 | slot`` in 32 bits.

Defaults: shift 4 (decay 0.9375) and fresh 1/2, no rank weight: on the SmolLM2 top-k traces decay
0.9-0.95 lie within ~0.25 points of each other, and the rank inside the top-k (beta 0 / 1 / 8) within
0.2 (docs/cache-policies.md). Units that the indexer keeps selecting (sinks, headings, key terms)
survive the stream of one-off selections that flushes an LRU buffer.
"""
from __future__ import annotations

import torch

from .base import Policy, StepInfo

HIT = 1024          # fixed-point weight of one selection (so decay rounding stays small)


class CRF(Policy):
    name = "crf"
    kernel = 1
    kernel_state = "value"
    kernel_max_slots = 1 << 16    # the kernel's victim sort key packs the slot in its low 16 bits

    def __init__(self, shift: int = 4):
        if not 1 <= shift <= 4:      # values < 16 * HIT: the kernel's 32-bit sort key
            raise ValueError(f"crf shift={shift} must be in 1..4 (decay 1 - 2**-shift); 4 is the default")
        self.shift = shift
        self.kernel_constants = {"SHIFT": shift, "HIT": HIT}

    def init_state(self, rows, slots, device):
        return {"value": torch.full((rows, slots), -1, dtype=torch.int32, device=device)}

    def seed_state(self, state, row, n):
        v = state["value"][:, :n]            # present, never selected: the lowest occupied value
        if isinstance(row, torch.Tensor):    # (``v[rows] = 0`` would wait for the GPU)
            v.index_fill_(0, row, 0)
        else:
            v[row] = 0

    def evict_order(self, state, rows, slot_unit, step):
        return torch.argsort(state["value"][rows], dim=1, stable=True)

    def update(self, state, info: StepInfo):
        v = state["value"][info.rows]                                   # (R, S) int32
        live = (info.selection >= 0).any(1, keepdim=True)
        v = torch.where(live & (v >= 0), v - (v >> self.shift), v)
        R, S = v.shape
        loc = torch.where(info.hit | info.miss, info.locs, S)
        old = torch.gather(v, 1, info.locs.clamp(min=0))
        new = torch.where(info.hit, old + HIT, HIT // 2).to(v.dtype)
        tmp = torch.cat([v, v.new_zeros(R, 1)], 1)
        tmp.scatter_(1, loc, new)
        state["value"][info.rows] = tmp[:, :S]
