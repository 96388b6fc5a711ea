"""The policy interface used by the resolve engine (slots/engine.py).

A policy owns per-slot state tensors of shape (rows, slots) and answers two questions per step:
which slots to evict first (``evict_order``) and how its state changes once the step's hits and
misses are known (``update``). The engine never evicts a slot that is hit in the same step, fills
empty slots first, and hands the i-th miss (in selection order) the i-th victim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class StepInfo:
    """What one resolve step tells the policy.

    selection: (R, k) int32 logical units, best first, -1 = padding.
    locs: (R, k) int64 local slot of each selected unit after the step, -1 for padding.
    hit / miss: (R, k) bool.
    rows: (R,) int64 indices of the state rows these selections belong to.
    scores: optional (R, k) float, the indexer's scores of the selected units.
    step: the caller's decode-step counter (used by offline policies).
    """

    selection: torch.Tensor
    locs: torch.Tensor
    hit: torch.Tensor
    miss: torch.Tensor
    rows: torch.Tensor
    scores: Optional[torch.Tensor] = None
    step: int = 0


class Policy:
    name = "base"
    offline = False      # True: needs future knowledge (simulator only)
    retain = True        # False: slots not selected this step are dropped (vanilla)
    kernel = None        # the served RESOLVE kernel's branch id (ops/triton_select.py); None: not served
    kernel_state = None  # the state key the kernel reads and writes, an (R, S) int32 tensor
    kernel_constants: dict = {}   # the kernel branch's compile-time constants (e.g. crf's SHIFT)
    kernel_max_slots = None       # most slots a row may have in the kernel branch (None: no limit)

    def init_state(self, rows: int, slots: int, device) -> dict:
        """Return fresh per-row state tensors, each with leading dims (rows, slots)."""
        return {}

    def reset_rows(self, state: dict, rows: torch.Tensor) -> None:
        """Return the given rows to their initial state (request finished / new request)."""
        fresh = self.init_state(len(rows), next(iter(state.values())).shape[1] if state else 0,
                                rows.device)
        for key, t in state.items():
            t[rows] = fresh[key]

    def seed_state(self, state: dict, row, n: int) -> None:
        """Row ``row`` (fresh; an int or an int64 tensor of rows) now holds units in its slots [0, n) that no step has selected yet
        (HotBufferState.seed). Default: nothing to change (an order over slots, like LRU's, already
        ranks them; its initial order puts slot 0 at the MRU end)."""

    def evict_order(self, state: dict, rows: torch.Tensor, slot_unit: torch.Tensor,
                    step: int) -> torch.Tensor:
        """(R, S) int64 local slot ids of the given rows, the first to evict first."""
        raise NotImplementedError

    def update(self, state: dict, info: StepInfo) -> None:
        """Advance the state of ``info.rows`` after the step (in place)."""


def positions_of(order: torch.Tensor) -> torch.Tensor:
    """Inverse permutation per row: pos[r, order[r, p]] = p."""
    order = order.long()
    pos = torch.empty_like(order)
    ar = torch.arange(order.shape[1], device=order.device).expand_as(order)
    pos.scatter_(1, order, ar)
    return pos


def reorder(order: torch.Tensor, info: StepInfo, hit_key: bool, miss_key: bool) -> torch.Tensor:
    """New MRU-first order: hits first, fetched misses right after them, then the rest in their
    previous order. Within hits and within misses, a later selection entry counts as the more recent
    access (as if the units were touched one by one in selection order): after selecting A B C D
    (all misses) the order is D C B A, so a later step selecting A E evicts B for E.
    ``hit_key``/``miss_key`` say whether hits/misses move to the front at all."""
    R, S = order.shape
    dt, order = order.dtype, order.long()       # int32 in the kernels' state; indices need int64
    zero = torch.zeros_like(info.hit)
    hit = info.hit if hit_key else zero
    miss = info.miss if miss_key else zero
    # Destination position of every slot, computed with prefix sums instead of a sort (same result
    # as sorting the keys hit: k-1-j, miss: 2k-1-j, rest: 2k + old position).
    n_hit = hit.sum(1, keepdim=True)
    n_front = n_hit + miss.sum(1, keepdim=True)
    loc = info.locs.clamp(min=0)
    moved = torch.zeros(R, S + 1, dtype=torch.bool, device=order.device)
    moved.scatter_(1, torch.where(hit | miss, loc, S), True)
    stay = ~torch.gather(moved[:, :S], 1, order)                # by old position
    new = torch.empty(R, S + 1, dtype=order.dtype, device=order.device)
    new.scatter_(1, torch.where(stay, n_front + stay.cumsum(1) - 1, S), order)
    new.scatter_(1, torch.where(hit, n_hit - hit.cumsum(1), S), loc)
    new.scatter_(1, torch.where(miss, n_front - miss.cumsum(1), S), loc)
    return new[:, :S].to(dt).contiguous()

