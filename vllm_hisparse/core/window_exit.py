"""Window exits: a partial request's newest-pages window slides by one page every ``page_size``
steps, and the page leaving it is given back to vLLM after the step (core/residency.py). Its next
selection would be a miss read from the host pool over PCIe. While its block is still held (the
step the window slides, the scheduler frees the block for the next one), the plan copies it into
one of the row's hot slots in every sparse layer, as if it had been selected that step alone
(slots.resolve on a one-page selection: the policy picks the victim and ages its state as for a
miss). A device-to-device copy of one page per layer at one step in ``page_size``, instead of a
host read whenever the page is selected again.

Only slides of a row already through its slots (its freed range not empty) whose exit page was
complete before the step: a fixed buffer's exit is the page this step's token completes (written
inside the step's layers), a spill's pages are freed before the step that first sees them.
Residency decides only where a page is read: outputs are unchanged (tests/test_window_exit.py).
"""
from __future__ import annotations

import torch

from vllm_hisparse.core.residency import freed_pages
from vllm_hisparse.slots import resolve


def exits(rt, steps: list) -> list[tuple[int, int, int]]:
    """(batch index, runtime row, page) of each one-token sparse row whose window gives a page
    back after this step."""
    out = []
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


def insert(rt, steps: list, block_table: torch.Tensor | None) -> int:
    """Copy each exit page (``exits``) into a hot slot of its row in every layer with hot slots;
    returns the number of pages inserted (per layer)."""
    ex = exits(rt, steps)
    if not ex or block_table is None:
        return 0
    dev = rt.device
    idx = torch.tensor([e[0] for e in ex], dtype=torch.int64, device=dev)
    rows = torch.tensor([e[1] for e in ex], dtype=torch.int64, device=dev)
    pages = torch.tensor([e[2] for e in ex], dtype=torch.int64, device=dev)
    bt = block_table.to(dev).long()[idx]                       # (E, W)
    src = torch.gather(bt, 1, pages[:, None])[:, 0]
    for layer, hs in enumerate(rt.hot):
        if hs is None:
            continue
        locs, miss = resolve(hs, pages[:, None].to(torch.int32), rows=rows)
        m = miss[:, 0]
        dst = torch.gather(bt, 1, locs.clamp(min=0))[:, 0]
        kv = rt.kv_cache(layer)
        kv[dst[m]] = kv[src[m]]
    return len(ex)
