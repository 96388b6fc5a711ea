"""Pages given back, copied into hot slots first. A partial request gives pages back to vLLM in two
ways (core/residency.py): its window slides by one page every ``page_size`` steps, and a spill
shrinks its window (from *resident*: most of its pages at once). Either way the next selection of
such a page would be a miss read from the host pool over PCIe. While its block still holds it, the
plan copies it (device to device) into one of the row's hot slots in every sparse layer, resolved
as a selection of those pages alone (slots.resolve: the policy picks the victims and ages its
state as for misses):

- a *window exit*: the page leaves at the end of this step (the scheduler frees its block for the
  next one), so it is copied at this step's plan;
- a *spill*: the scheduler freed the pages when it scheduled this step, but no kernel of this step
  has run yet, so their blocks still hold them at its plan (the worker's block table keeps their
  ids). Of those pages, the ones the row selected at its previous step in that layer are copied
  (the previous step's selections stay in the decode batch's ``sel`` buffers): at most top_k
  pages a layer, into S >= top_k slots.

A fixed buffer's exit is the page this step's token completes (written inside the step's layers):
not copied. Residency decides only where a page is read: outputs are unchanged
(tests/test_give_back.py).

One step's inserts are one resolve over every sparse layer's rows at once (core/hot_rows.py's
stacked state) and one fixed-size block copy per layer, with no host sync: ~120 launches a step
that has any, where a resolve per layer took ~3,400 torch ops and a sync per layer (CPU count,
30 layers). Window exits come at one step in ``page_size`` for every partial row; they stay an
A/B knob, ``HISPARSE_WINDOW_EXITS=1``, off by default, until a GPU run weighs their host time
against the misses they save (docs/cache-policies.md: -6% misses more on the CPU).
"""
from __future__ import annotations

import torch

from vllm_hisparse.knobs import env_flag
from vllm_hisparse.core.residency import freed_pages
from vllm_hisparse.slots import resolve


def _window_exits() -> bool:
    return env_flag("HISPARSE_WINDOW_EXITS", False,
                    "copy each page leaving a window into a hot slot", "leave it to the host pool")


WINDOW_EXITS = _window_exits()


def exits(rt, steps: list) -> list[tuple[int, int, int]]:
    """(batch index, runtime row, page) of each one-token sparse row whose window gives a page
    back after this step (none unless WINDOW_EXITS)."""
    out = []
    if not WINDOW_EXITS:
        return out
    for s in steps:
        if s.t1 - s.t0 != 1 or not s.sparse or s.freed[1] <= s.freed[0]:
            continue
        r = rt.reqs[s.req_id]
        if r.keep is None or r.keep <= 0:
            continue
        hi = freed_pages(rt.cfg, s.start + 1, r.num_prompt, r.keep)[1]
        for page in range(s.freed[1], min(hi, s.start // rt.P)):
            out.append((s.idx, s.row, page))
    return out


class GiveBack:
    """The runtime's record of what the inserts need across steps: the previous decode batch
    (its rows' requests) and the requests spilled since the last plan (their keep before)."""

    def __init__(self):
        self.prev_db, self.prev_steps = None, []
        self.spilled: dict[str, int | None] = {}
        self._count = None          # (row, page, layer) copies requested so far, on the device

    def count(self, pages: torch.Tensor) -> None:
        n = (pages >= 0).sum()
        self._count = n if self._count is None else self._count + n

    def inserts(self) -> int:
        """(row, page, layer) copies requested so far (reads the device: a host sync)."""
        return 0 if self._count is None else int(self._count)

    def spill(self, req_id: str, keep_before: int | None) -> None:
        self.spilled.setdefault(req_id, keep_before)

    def decoded(self, db, steps: list) -> None:
        self.prev_db, self.prev_steps = db, steps          # (the row map only when it is needed)

    def spills(self, rt, steps: list) -> list[tuple[int, int, torch.Tensor]]:
        """(batch index, runtime row, pages (L, k) of the previous step's selection that this
        step's spill gives back, -1 elsewhere) of each one-token sparse row spilled since the last
        plan and decoded in the previous step."""
        out = []
        if not self.spilled:
            return out
        spilled, self.spilled = self.spilled, {}
        prev_rows = {s.req_id: i for i, s in enumerate(self.prev_steps)}
        for s in steps:
            if s.req_id not in spilled or s.t1 - s.t0 != 1 or not s.sparse:
                continue
            i = prev_rows.get(s.req_id)
            if i is None:
                continue
            r = rt.reqs[s.req_id]
            lo = freed_pages(rt.cfg, s.start, r.num_prompt, spilled[s.req_id])[1]
            hi = s.freed[1]
            sel = self.prev_db.sel[:, i]                              # (L, k)
            out.append((s.idx, s.row, torch.where((sel >= lo) & (sel < hi), sel, -1)))
        return out


def _insert(rt, bt: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor) -> None:
    """pages (len(hot layers), E, k) int32 (-1 = none) of runtime rows ``rows`` (E,) into every hot
    layer's slots (layers in ``rt.hot.layers`` order): one resolve over the stacked state, then one
    fixed-size block copy per layer; bt (E, W) the rows' block tables. Nothing waits for the GPU:
    an entry that copies nothing (a hit, padding) repeats its layer's first real copy (the same
    bytes to the same block), or copies a block onto itself in a layer without one."""
    hot = rt.hot
    nL, E, k = pages.shape
    locs, miss = resolve(hot.stacked, pages.reshape(nL * E, k),
                         rows=hot.stacked_rows(rows).reshape(-1))
    b = bt.unsqueeze(0).expand(nL, -1, -1)
    src = torch.gather(b, 2, pages.long().clamp(min=0)).view(nL, E * k)
    dst = torch.gather(b, 2, locs.view(nL, E, k).clamp(min=0)).view(nL, E * k)
    miss = miss.view(nL, E * k)
    first = miss.int().argmax(1, keepdim=True)               # a layer's first real copy (or 0)
    src_f, dst_f = src.gather(1, first), dst.gather(1, first)
    dst_f = torch.where(miss.any(1, keepdim=True), dst_f, src_f)       # none: src_f onto itself
    src, dst = torch.where(miss, src, src_f), torch.where(miss, dst, dst_f)
    for i, layer in enumerate(hot.layers):
        kv = rt.kv_cache(layer)
        kv[dst[i]] = kv[src[i]]
    rt.given_back.count(pages)


def insert(rt, steps: list, block_table: torch.Tensor | None) -> None:
    """Copy this step's window exits and the pages its spills give back into hot slots (their
    number: ``GiveBack.inserts``). No host sync."""
    ex = exits(rt, steps)
    sp = rt.given_back.spills(rt, steps)
    if (not ex and not sp) or block_table is None or not rt.hot.layers:
        return                                    # (no layer with hot slots: nothing to keep)
    bt = block_table.to(rt.device).long()
    nL = len(rt.hot.layers)
    if ex:                         # one selection row per batch row: its exits, -1 padded
        by_row: dict[tuple[int, int], list[int]] = {}
        for idx, row, page in ex:
            by_row.setdefault((idx, row), []).append(page)
        width = max(len(p) for p in by_row.values())
        pages = rt.h2d([p + [-1] * (width - len(p)) for p in by_row.values()], torch.int32)
        idx, rows = rt.h2d([list(k) for k in by_row], torch.int64).T
        _insert(rt, bt[idx], rows, pages.expand(nL, -1, -1))
    if sp:
        idx, rows = rt.h2d([[e[0], e[1]] for e in sp], torch.int64).T
        pages = torch.stack([e[2] for e in sp], 1).to(rt.device, torch.int32)   # (L, E, k)
        _insert(rt, bt[idx], rows, pages[rt.hot.layer_ids])
