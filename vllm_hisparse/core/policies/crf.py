"""Rank-weighted CRF ("combined recency and frequency"): evict the slot whose decayed, rank-weighted
selection count is lowest. Online, one float of state per slot, no future knowledge.

Each selection of a unit at step t with rank j among the row's n valid entries (0 = the indexer's
best) adds a weight w = 1 + beta * (1 - j / n) to the unit's value (``fresh`` * w when the unit had
to be fetched, i.e. on its first selection since it entered the buffer: a unit picked once is a weaker
bet than one picked again), and every value decays by ``decay`` per step:

    value(t) = sum over past selections i of  w_i * decay ** (t - t_i)

``decay`` -> 0 is LRU with "better rank = more recent" inside a step; ``decay`` -> 1 is a
rank-weighted LFU. Units that the indexer keeps selecting (sinks, headings, key terms) survive the
stream of one-off selections that flushes an LRU buffer. Defaults (decay 0.93, beta 1, fresh 0.5) were
picked on the SmolLM2 top-k traces (docs/cache-policies.md); decay 0.9-0.95 are within ~0.25 points.

State: ``key`` (R, S) float64 = log(value) + t * c with c = -ln(decay): comparing keys at one step
compares values, so nothing has to be decayed in place. Empty slots hold -inf.

In the RESOLVE kernel (one CTA per row): the key is one float per slot next to the page table
(float32 with the step counter rebased, ``key -= t * c``, every few hundred steps); hits update their
key in place with ``log1p``/``exp`` of the old one; the victim scan replaces the LRU list walk by a
block-wide selection of the m smallest keys among non-hit slots (m = misses this step: a radix select
over 32-bit keys, the same shared-memory pass that already skips hit slots); misses write
``log(fresh * w) + t * c``. Rank j is the entry's index in the selection and n its valid count, both known in
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

    def __init__(self, decay: float = 0.93, beta: float = 1.0, fresh: float = 0.5):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"crf decay={decay} must be in (0, 1); 0.93 is the measured default")
        self.decay, self.beta, self.fresh = decay, beta, fresh
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
        w = torch.where(info.hit, w, w * self.fresh)
        new = torch.logaddexp(old - now, torch.log(w)) + now
        R, S = key.shape
        tmp = torch.cat([key, key.new_zeros(R, 1)], 1)
        tmp.scatter_(1, torch.where(sel, loc, S), new)
        state["key"][info.rows] = tmp[:, :S]
