"""Rank-weighted CRF ("combined recency and frequency"): evict the slot whose decayed, rank-weighted
selection count is lowest. Online, bounded per-slot state, no future knowledge.

Each selection of a unit at step t with rank j among the row's n valid entries (0 = the indexer's
best) adds a weight w = 1 + beta * (1 - j / n) to the unit's value, and every value decays by
``decay`` per step:

    value(t) = sum over past selections i of  w_i * decay ** (t - t_i)

``decay`` -> 0 is LRU with "better rank = more recent" inside a step; ``decay`` -> 1 is a
rank-weighted LFU. Units that the indexer selects often and ranks high survive a burst of one-off
selections that would flush an LRU buffer.

State: ``key`` (R, S) float64 = log(value) + t * c with c = -ln(decay): comparing keys at one step
compares values, so nothing has to be decayed in place. Empty slots hold -inf.

In the RESOLVE kernel (one CTA per row): the key is one float per slot next to the page table
(float32 with the step counter rebased, ``key -= t * c``, every few hundred steps); hits update their
key in place with ``log1p``/``exp`` of the old one; the victim scan replaces the LRU list walk by a
block-wide selection of the m smallest keys among non-hit slots (m = misses this step: a radix select
over 32-bit keys, the same shared-memory pass that already skips hit slots); misses write
``log(w) + t * c``. Rank j is the entry's index in the selection and n its valid count, both known in
the kernel; no scores have to be passed.
"""
from __future__ import annotations

import math

import torch

from . import register
from .base import Policy, StepInfo


@register
class CRF(Policy):
    name = "crf"

    def __init__(self, decay: float = 0.5, beta: float = 2.0):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"crf decay={decay} must be in (0, 1); 0.5 is the measured default")
        self.decay, self.beta = decay, beta
        self.c = -math.log(decay)

    def init_state(self, rows, slots, device):
        return {"key": torch.full((rows, slots), float("-inf"), dtype=torch.float64, device=device)}

    def evict_order(self, state, rows, slot_unit, step):
        return torch.argsort(state["key"][rows], dim=1, stable=True)

    def update(self, state, info: StepInfo):
        key = state["key"][info.rows]                                   # (R, S)
        sel = info.hit | info.miss
        n = (info.selection >= 0).sum(1, keepdim=True).clamp(min=1)
        j = torch.arange(sel.shape[1], device=key.device).expand_as(sel)
        w = 1.0 + self.beta * (1.0 - (j / n).clamp(max=1.0)).to(torch.float64)
        now = info.step * self.c
        loc = info.locs.clamp(min=0)
        old = torch.gather(key, 1, loc)                                 # -inf for a fresh fetch
        old = torch.where(info.hit, old, torch.full_like(old, float("-inf")))
        new = torch.logaddexp(old - now, torch.log(w)) + now
        R, S = key.shape
        tmp = torch.cat([key, key.new_zeros(R, 1)], 1)
        tmp.scatter_(1, torch.where(sel, loc, S), new)
        state["key"][info.rows] = tmp[:, :S]
