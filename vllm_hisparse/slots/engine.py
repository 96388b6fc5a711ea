"""The slot engine: hot-buffer state and the resolve step (plain torch, batched over rows).

One engine for everything that keeps hot slots: the serving runtime holds one ``HotBufferState`` per
sparse layer (its tensors are what the Triton RESOLVE kernel reads and writes in place), the
plain-torch references of the kernels (ops/reference.py) call ``resolve`` on them, and the
simulator (sim/engine.py) replays traces through the same ``resolve``.

A *row* is one (request, layer) pair, or one request of a per-layer state. Each row owns S slots,
each holding one selection unit (a token for DSA, a page for Quest/NSA). State, all int tensors:

  slot_unit: (R, S) int32   logical unit held by each slot, -1 = empty
  unit_slot: (R, U) int32   page table: logical unit -> local slot, -1 = not resident
  policy state              e.g. LRU ``order`` (R, S) int32, MRU first; crf ``value`` (R, S) int32

``resolve`` maps one step's selection (R, k) to local slots: hits keep their slot; each miss takes
a victim (empty slots first, then in the policy's eviction order, never a slot hit this step); the
i-th miss in selection order gets the i-th victim. The caller copies the missing units' rows from
the host pool into the victims' physical slots (``fetch_misses``). With the LRU policy this is the
exact contract of the CUDA RESOLVE kernel; with every policy that sets ``kernel``, of the Triton
select_resolve kernel's branch for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .registry import make
from .base import Policy, StepInfo


@dataclass
class HotBufferState:
    rows: int
    slots: int
    max_units: int
    policy: Policy
    device: torch.device | str = "cpu"
    slot_unit: torch.Tensor = field(init=False)
    unit_slot: torch.Tensor = field(init=False)
    pstate: dict = field(init=False)

    def __post_init__(self):
        self.slot_unit = torch.full((self.rows, self.slots), -1, dtype=torch.int32, device=self.device)
        self.unit_slot = torch.full((self.rows, self.max_units), -1, dtype=torch.int32, device=self.device)
        self.pstate = self.policy.init_state(self.rows, self.slots, self.device)

    @classmethod
    def create(cls, rows: int, slots: int, max_units: int, policy: str | Policy = "lru",
               device="cpu") -> "HotBufferState":
        pol = make(policy) if isinstance(policy, str) else policy
        return cls(rows, slots, max_units, pol, device)

    @classmethod
    def wrap(cls, slot_unit: torch.Tensor, unit_slot: torch.Tensor, pstate: dict,
             policy: str | Policy = "lru") -> "HotBufferState":
        """A state over existing tensors (no copies): resolve updates them in place."""
        state = cls.__new__(cls)
        state.rows, state.slots = slot_unit.shape
        state.max_units = unit_slot.shape[1]
        state.policy = make(policy) if isinstance(policy, str) else policy
        state.device = slot_unit.device
        state.slot_unit, state.unit_slot, state.pstate = slot_unit, unit_slot, pstate
        return state

    def kernel_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot_unit, unit_slot, the policy's kernel state tensor): what a RESOLVE kernel reads and
        writes in place, all (rows, *) int32."""
        if self.policy.kernel is None:
            raise ValueError(f"policy {self.policy.name!r} has no RESOLVE kernel; served policies: "
                             f"{', '.join(_served())}")
        return self.slot_unit, self.unit_slot, self.pstate[self.policy.kernel_state]

    def reset(self, row: int) -> None:
        """Empty one row (a request starts, or restarts from token 0)."""
        self.slot_unit[row] = -1
        self.unit_slot[row] = -1
        for key, t in self.policy.init_state(1, self.slots, self.slot_unit.device).items():
            self.pstate[key][row] = t[0]

    def seed(self, row, n: int) -> None:
        """An empty row's slots [0, n) hold units [0, n), slot s unit s: the serving runtime's
        floor keeps a request's first S pages in the blocks of its S slots, so at its first step
        through the slots those pages are resident, not misses (core/hot_rows.py). The
        policy's state treats them as present and never selected (``Policy.seed_state``).
        row: an int, or an int64 tensor of rows (all seeded alike)."""
        u = torch.arange(n, dtype=torch.int32, device=self.slot_unit.device)
        self.slot_unit[row, :n] = u
        self.unit_slot[row, :n] = u
        self.policy.seed_state(self.pstate, row, n)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Empty the given rows (a request finished, or a new request takes the row)."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.slot_unit.device)
        if len(rows) == 0:
            return
        self.slot_unit.index_fill_(0, rows, -1)      # (``x[rows] = -1`` copies the -1 to the
        self.unit_slot.index_fill_(0, rows, -1)      # device first: a wait for the GPU)
        if self.pstate:
            self.policy.reset_rows(self.pstate, rows)

    def resident_units(self, row: int) -> set[int]:
        return {int(u) for u in self.slot_unit[row].tolist() if u >= 0}


def resolve(state: HotBufferState, selection: torch.Tensor, rows: torch.Tensor | None = None,
            scores: torch.Tensor | None = None, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Map one step's selection to local slots, updating ``state`` in place.

    selection: (R, k) int32 unique logical units per row, best first, -1 = padding (anywhere).
      k must be <= S. Rows that are all -1 are no-ops.
    rows: (R,) int64 state rows of the selection rows (default 0..R-1).
    scores: optional (R, k) indexer scores, passed to the policy.
    Returns (locs, miss): locs (R, k) int64 local slots aligned with the selection (-1 for padding);
    miss (R, k) bool, True where the unit must be fetched from the host pool into ``locs``.
    """
    R, k = selection.shape
    S = state.slots
    assert k <= S, f"selection of {k} units exceeds the {S} hot-buffer slots"
    dev = state.slot_unit.device
    if rows is None:
        rows = torch.arange(R, device=dev)
    rows = rows.to(device=dev, dtype=torch.int64)
    sel = selection.to(device=dev, dtype=torch.int64)
    valid = sel >= 0
    sel0 = sel.clamp(min=0)
    unit_slot = state.unit_slot[rows]
    slot_unit = state.slot_unit[rows]
    cur = torch.gather(unit_slot, 1, sel0).long()
    hit = valid & (cur >= 0)
    miss = valid & (cur < 0)

    # Victims: empty slots first, then the policy's order, skipping slots hit this step.
    hit_slot = torch.zeros(R, S + 1, dtype=torch.bool, device=dev)
    hit_slot.scatter_(1, torch.where(hit, cur, S), True)
    evict = state.policy.evict_order(state.pstate, rows, state.slot_unit, step)
    evict = _empty_first(evict, torch.gather(slot_unit, 1, evict) < 0)
    ok = ~torch.gather(hit_slot[:, :S], 1, evict)
    rank = ok.long().cumsum(1) - 1                             # candidate rank in eviction order
    victims = torch.full((R, S + 1), -1, dtype=torch.int64, device=dev)
    victims.scatter_(1, torch.where(ok, rank, S), evict)
    miss_idx = miss.long().cumsum(1) - 1
    miss_slot = torch.gather(victims, 1, miss_idx.clamp(min=0))
    locs = torch.where(hit, cur, torch.where(miss, miss_slot, -1))

    # Page-table update: victims forget their old unit, misses take their slot.
    U = state.max_units
    mslot = torch.where(miss, miss_slot, S)                    # S = scratch column
    old_unit = torch.gather(torch.cat([slot_unit, slot_unit.new_full((R, 1), -1)], 1), 1, mslot).long()
    pt = torch.cat([unit_slot, unit_slot.new_full((R, 1), -1)], 1)
    pt.scatter_(1, torch.where(miss & (old_unit >= 0), old_unit, U), -1)
    pt.scatter_(1, torch.where(miss, sel0, U), mslot.to(pt.dtype))
    su = torch.cat([slot_unit, slot_unit.new_full((R, 1), -1)], 1)
    su.scatter_(1, mslot, sel0.to(su.dtype))

    if not state.policy.retain:                                # vanilla: keep only this selection
        keep = torch.zeros(R, S + 1, dtype=torch.bool, device=dev)
        keep.scatter_(1, torch.where(valid, locs, S), True)
        drop = ~keep[:, :S] & (su[:, :S] >= 0)
        pt.scatter_(1, torch.where(drop, su[:, :S].long(), U), -1)
        su[:, :S].masked_fill_(drop, -1)                         # (a mask index would sync)
    state.unit_slot[rows] = pt[:, :U]
    state.slot_unit[rows] = su[:, :S]
    state.policy.update(state.pstate, StepInfo(sel.to(torch.int32), locs, hit, miss, rows, scores, step))
    return locs, miss


def _served() -> list[str]:
    from .registry import served
    return served()


def _empty_first(order: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Stable partition of each row of ``order`` (R, S): entries where ``empty`` first, then the rest,
    both in their previous order (same result as a stable argsort on ``~empty``, without a sort)."""
    n_empty = empty.sum(1, keepdim=True)
    dest = torch.where(empty, empty.cumsum(1) - 1, n_empty + (~empty).cumsum(1) - 1)
    return torch.empty_like(order).scatter_(1, dest, order)


def fetch_misses(buffer: torch.Tensor, slot_map: torch.Tensor, locs: torch.Tensor, miss: torch.Tensor,
                 selection: torch.Tensor, gather_units) -> int:
    """Copy the missing units into their physical slots.

    buffer: (N, *unit_shape) the layer's device buffer; slot_map: (R, S) int physical slot of each
    local slot; gather_units(row_idx (m,), units (m,)) -> (m, *unit_shape) from the host.
    Returns the number of units copied.
    """
    r, j = torch.nonzero(miss, as_tuple=True)
    if len(r) == 0:
        return 0
    phys = slot_map[r, locs[r, j]].long()
    buffer[phys] = gather_units(r, selection[r, j].long()).to(buffer.device, buffer.dtype)
    return len(r)


def write_resident(state: HotBufferState, buffer: torch.Tensor, slot_map: torch.Tensor,
                   rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Write-through of new tokens into the hot buffer where their unit is resident, so a resident
    slot always equals its host page. Non-resident tokens are left to the host pool (a later
    selection fetches them with the rest of their page).

    buffer: (N, 2, unit, Hkv, D); slot_map: (R, S); rows/positions: (n,) int; k/v: (n, Hkv, D).
    Returns (n,) bool: which tokens were written to the buffer.
    """
    unit = buffer.shape[2]
    rows = rows.to(state.unit_slot.device, torch.int64)
    pos = positions.to(state.unit_slot.device, torch.int64)
    slot = state.unit_slot[rows, pos // unit].long()
    hit = slot >= 0
    if bool(hit.any()):
        phys = slot_map[rows[hit], slot[hit]].long().to(buffer.device)
        off = (pos[hit] % unit).to(buffer.device)
        buffer[phys, 0, off] = k[hit.to(k.device)].to(buffer.dtype)
        buffer[phys, 1, off] = v[hit.to(v.device)].to(buffer.dtype)
    return hit
