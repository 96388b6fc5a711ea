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

Spills are rare (a few per request's life), so their copies run as plain torch ops per layer at
the plan (with host syncs: the boolean index of the pages to copy, their count). Window exits
come at one step in ``page_size`` for every partial row: per-layer torch ops at that rate cost too much host
time on a GPU, so they are an A/B knob, ``HISPARSE_WINDOW_EXITS=1``, off by default, until one
launch does every layer (docs/cache-policies.md: -6% misses more on the CPU).
"""
from __future__ import annotations

import os

import torch

from vllm_hisparse.core.residency import freed_pages
from vllm_hisparse.slots import resolve


def _window_exits() -> bool:
    v = os.environ.get("HISPARSE_WINDOW_EXITS", "0")
    if v not in ("0", "1"):
        raise ValueError(f"HISPARSE_WINDOW_EXITS={v!r}: use 1 (copy each page leaving a window "
                         f"into a hot slot) or 0 (the default)")
    return v == "1"


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


def _insert(rt, layer: int, bt: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor) -> None:
    """pages (E, k) int32 (-1 = none) of rows ``rows`` into layer's hot slots; bt (E, W)."""
    locs, miss = resolve(rt.hot[layer], pages, rows=rows)
    src = torch.gather(bt, 1, pages.long().clamp(min=0))
    dst = torch.gather(bt, 1, locs.clamp(min=0))
    kv = rt.kv_cache(layer)
    kv[dst[miss]] = kv[src[miss]]


def insert(rt, steps: list, block_table: torch.Tensor | None) -> int:
    """Copy this step's window exits and the pages its spills give back into hot slots; returns
    the number of (row, page, layer) copies requested."""
    ex = exits(rt, steps)
    sp = rt.given_back.spills(rt, steps)
    if (not ex and not sp) or block_table is None:
        return 0
    dev = rt.device
    bt = block_table.to(dev).long()
    layers = [i for i, hs in enumerate(rt.hot) if hs is not None]
    # the rows' tensors once for every layer: (block table rows, runtime rows, pages)
    jobs, n = [], 0
    if ex:
        idx = torch.tensor([e[0] for e in ex], dtype=torch.int64, device=dev)
        rows = torch.tensor([e[1] for e in ex], dtype=torch.int64, device=dev)
        pages = torch.tensor([[e[2]] for e in ex], dtype=torch.int32, device=dev)
        jobs.append((bt[idx], rows, pages.expand(rt.num_layers, -1, -1)))
        n += len(ex) * len(layers)
    if sp:
        idx = torch.tensor([e[0] for e in sp], dtype=torch.int64, device=dev)
        rows = torch.tensor([e[1] for e in sp], dtype=torch.int64, device=dev)
        pages = torch.stack([e[2] for e in sp], 1).to(dev, torch.int32)         # (L, E, k)
        jobs.append((bt[idx], rows, pages))
        n += int((pages[layers] >= 0).sum())
    for layer in layers:
        for b, rows, pages in jobs:
            _insert(rt, layer, b, rows, pages[layer])
    return n
