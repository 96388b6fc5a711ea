"""Replay a selection trace through the runtime's own resolve engine and policies.

Nothing here re-implements caching: every step calls ``slots.engine.resolve`` on a
``HotBufferState`` built by ``slots.make``. To stay fast on a CPU, one resolve call per step
covers every trace row (layer, or layer x KV head) of every configuration that has the same slot
count (e.g. k=64,B=4k and k=128,B=2k), for write-allocate on and off: rows of a smaller k are padded
with -1 (a no-op in resolve).

Write-allocate: the runtime writes each decoded token's KV into the hot buffer as it is produced.
Modelled by appending the unit of the current token (position context_len[t] - 1) as one extra,
last column to step t's selection (-1 when the selection already holds it): it takes a slot like
any miss and, being the latest entry, enters as the most recent of the step's fetched units (LRU puts
the step's hits before them; when the indexer selects the token itself, >99% of rows on the SmolLM2
traces, it enters at its own rank). It is written, not fetched, so it never counts as a miss. The one call per step also serves non-retaining policies
(vanilla keeps the selection plus the new unit). Needs B > k.

Window (``Config.window`` = W units, default 0): the request's W newest units (the current one
included) stay resident beside the hot buffer, as the partial rows of ``resident_first`` keep
their newest pages in the block table (core/residency.py). A selected unit in the window is a hit
that never touches the buffer; the others keep their rank order and resolve through it. The
current unit is in the window, so with a window write-allocate means the unit that *leaves* it:
on, the unit that ages out of the window at step t + 1 is written into the buffer at step t
(while its block is still held: one extra, last column, as above, never a miss; only where the
context grows by one unit, as in a decode trace); off, it is not in the buffer (its next
selection is a miss). Window hits count as selected units.

Lookahead (``Config.lookahead`` = m units, default 0): after step t's selection, the indexer's
next m candidates of step t (ranks k .. k + m - 1 of the trace, best first) resolve into the same
buffer as a prefetch: the ones not resident are fetched off the step's critical path
(``Replay.prefetched``, never misses) and may be hits at step t + 1. Models a copy that runs while
the rest of the step computes; whether the link has the time is the caller's arithmetic
(prefetched against missed units). They go in the step's one resolve call, after the selection
(and the written unit), so they take victims as misses do and never the slot of a unit the step
selected; under LRU they enter as the step's most recent (a prefetch that does not refresh
recency, or enters at the LRU end, is not modelled), and under Bélády the oracle is no longer a
bound (it must keep what is prefetched). Needs a trace recorded with k_max >= k + m, and B >= k +
m (+1 with write-allocate).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_hisparse.slots.engine import HotBufferState, resolve
from vllm_hisparse.slots import make
from vllm_hisparse.slots.belady import NEVER

from .trace import Trace


@dataclass(frozen=True)
class Config:
    """One simulated buffer: top-k size ``k`` (units), ``slots`` = B (units), write-allocate on/off
    (with a window: of the unit leaving it), a window of the ``window`` newest units resident
    beside it (0: none), the ``lookahead`` next candidates prefetched after each step (0: none)."""
    k: int
    slots: int
    write_allocate: bool = True
    window: int = 0
    lookahead: int = 0


@dataclass
class Replay:
    """Misses of one (trace, policy) replay.

    misses[c]: (steps, rows) int32 fetched units per step and trace row for configs[c];
    selected[c]: (steps, rows) int32 valid selected units (the miss-rate denominator);
    prefetched[c]: (steps, rows) int32 units fetched by the lookahead (0 without one).
    """
    trace: Trace
    policy: str
    configs: list
    misses: list
    selected: list
    prefetched: list


class NextUse:
    """Bélády's oracle for a batch of rows: ``table[r, u]`` = the next step (> the current one) at
    which row r selects unit u, NEVER if none; advanced after every step with ``advance(t)``.

    sel: (steps, R, k) int64 selections, -1 = padding; U: page-table width.
    """

    def __init__(self, sel: np.ndarray, U: int):
        steps, R, K = sel.shape
        t = np.broadcast_to(np.arange(steps)[:, None, None], sel.shape).ravel()
        r = np.broadcast_to(np.arange(R)[None, :, None], sel.shape).ravel()
        u = sel.ravel()
        key = np.where(u >= 0, r * U + u, -1)
        order = np.lexsort((t, key))
        ks, ts = key[order], t[order]
        same = ks[1:] == ks[:-1]
        nxt = np.full(ks.shape, NEVER, np.int64)
        nxt[:-1][same] = ts[1:][same]
        after = np.empty_like(nxt)
        after[order] = nxt
        self.after = torch.from_numpy(after.reshape(steps, R, K))
        first = np.ones(ks.shape, bool)
        first[1:] = ~same
        first &= ks >= 0
        table = np.full(R * U, NEVER, np.int64)
        table[ks[first]] = ts[first]
        self.table = torch.from_numpy(table.reshape(R, U))
        self.sel = torch.from_numpy(sel)

    def __call__(self, rows: torch.Tensor, units: torch.Tensor, step: int) -> torch.Tensor:
        return self.table[rows[:, None], units]

    def advance(self, t: int) -> None:
        s = self.sel[t]
        ok = s >= 0
        r = torch.arange(s.shape[0])[:, None].expand_as(s)
        self.table[r[ok], s[ok]] = self.after[t][ok]


def replay(trace: Trace, policy: str, configs: list[Config], seed: int = 0, bar=None) -> Replay:
    """Run every config through ``policy``; ``bar`` (tqdm-like) is advanced by steps x groups."""
    misses = [None] * len(configs)
    selected = [None] * len(configs)
    prefetched = [None] * len(configs)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(configs):
        if c.k + c.lookahead + c.write_allocate > c.slots:
            raise ValueError(f"buffer B={c.slots} too small for k={c.k}"
                             f"{f' + lookahead {c.lookahead}' if c.lookahead else ''}: the hot buffer "
                             f"must hold one selection"
                             f"{' and its prefetch' if c.lookahead else ''}"
                             f"{' plus the new token (write-allocate)' if c.write_allocate else ''}"
                             f"; use a larger --buffer")
        if c.k + c.lookahead > trace.k_max:
            raise ValueError(f"--lookahead {c.lookahead} at k={c.k} needs ranks up to "
                             f"{c.k + c.lookahead} of each selection; the trace {trace.name} holds "
                             f"{trace.k_max} (record it with a larger k_max, or a smaller lookahead)")
        groups.setdefault(c.slots, []).append(i)
    for slots, idx in groups.items():
        m, n, f = _replay_group(trace, policy, [configs[i] for i in idx], slots, seed, bar)
        for j, i in enumerate(idx):
            misses[i], selected[i], prefetched[i] = m[j], n[j], f[j]
    return Replay(trace, policy, list(configs), misses, selected, prefetched)


def _replay_group(trace, policy, cfgs, slots, seed, bar):
    L, T = trace.layers, trace.steps
    kg = max(c.k for c in cfgs)
    U = trace.max_units()
    mg = max(c.lookahead for c in cfgs)
    sel = np.full((T, len(cfgs) * L, kg), -1, np.int64)
    pre = np.full((T, len(cfgs) * L, mg), -1, np.int64)    # ranks k .. k + lookahead - 1
    new_unit = (trace.context_len.astype(np.int64) - 1) // trace.unit
    for j, c in enumerate(cfgs):
        sel[:, j * L:(j + 1) * L, :c.k] = trace.first_k(c.k)
        pre[:, j * L:(j + 1) * L, :c.lookahead] = trace.positions[:, :, c.k:c.k + c.lookahead]
    valid = (sel >= 0).sum(-1).astype(np.int32)       # the denominator: window hits included
    for j, c in enumerate(cfgs):
        if c.window:
            sel[:, j * L:(j + 1) * L] = _outside_window(sel[:, j * L:(j + 1) * L], new_unit, c.window)
            if mg:
                pre[:, j * L:(j + 1) * L] = _outside_window(pre[:, j * L:(j + 1) * L], new_unit,
                                                            c.window)
    R = sel.shape[1]
    kw = {}
    oracle = None
    if policy == "belady":
        oracle = kw["next_use"] = NextUse(sel, U)
    elif policy == "random":
        kw["seed"] = seed
    state = HotBufferState.create(R, slots, U, make(policy, **kw))
    wa = torch.zeros(R, 1, dtype=torch.bool)           # the new unit into the buffer
    exit_wa = torch.zeros(R, 1, dtype=torch.bool)      # the unit leaving the window
    win = torch.zeros(R, 1, dtype=torch.int64)
    for j, c in enumerate(cfgs):
        wa[j * L:(j + 1) * L] = c.write_allocate and not c.window
        exit_wa[j * L:(j + 1) * L] = c.write_allocate and bool(c.window)
        win[j * L:(j + 1) * L] = c.window
    writes = int(bool(wa.any() or exit_wa.any()))        # a column for the written unit
    if kg + writes + mg > slots:          # configs of one B, the widest k with the widest lookahead
        raise ValueError(f"buffer B={slots}: one resolve call of k={kg}"
                         f"{' + the new token' if writes else ''} + lookahead {mg} exceeds it; "
                         f"replay these configs separately or use a larger --buffer")
    new_unit = torch.from_numpy(new_unit)
    sel_t = torch.from_numpy(sel)
    miss_count = torch.zeros(T, R, dtype=torch.int32)
    pre_count = torch.zeros(T, R, dtype=torch.int32)
    pre_t = torch.from_numpy(pre)
    for t in range(T):
        s = sel_t[t]
        is_new = wa & (s == new_unit[t])                          # selected and written this step
        extra = torch.where(wa & ~is_new.any(1, keepdim=True), new_unit[t], -1)
        if t + 1 < T and new_unit[t + 1] == new_unit[t] + 1:    # one unit leaves the window
            gone = new_unit[t + 1] - win
            extra = torch.where(exit_wa & (gone >= 0), gone, extra)
        cols = [s, extra] if writes else [s]
        if mg:        # the prefetch in the same call: it takes victims like a miss, never a slot
            p = pre_t[t]                                          # the step's selection holds
            cols.append(torch.where(p == extra, -1, p))          # (the new unit written once)
        _, miss = resolve(state, torch.cat(cols, 1).to(torch.int32), step=t)
        miss_count[t] = (miss[:, :kg] & ~is_new).sum(1, dtype=torch.int32)
        pre_count[t] = miss[:, kg + writes:].sum(1, dtype=torch.int32)
        if oracle is not None:
            oracle.advance(t)
        if bar is not None:
            bar.update(1)
    mc, pc = miss_count.numpy(), pre_count.numpy()
    return ([mc[:, j * L:(j + 1) * L] for j in range(len(cfgs))],
            [valid[:, j * L:(j + 1) * L] for j in range(len(cfgs))],
            [pc[:, j * L:(j + 1) * L] for j in range(len(cfgs))])


def _outside_window(sel: np.ndarray, new_unit: np.ndarray, window: int) -> np.ndarray:
    """sel (steps, rows, k) without the units of step t's window (unit > new_unit[t] - window),
    the rest moved to the front in their rank order, -1 after."""
    keep = (sel >= 0) & (sel <= (new_unit - window)[:, None, None])
    order = np.argsort(~keep, axis=-1, kind="stable")
    return np.take_along_axis(np.where(keep, sel, -1), order, axis=-1)
