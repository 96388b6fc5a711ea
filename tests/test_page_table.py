"""core/page_table.py: the device page tables equal a plain table built from each row's whole page
list, after random growth (a few pages at a time: scalar writes; many: one copy for every table)
and clears, flushing one table or two at once."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_hisparse.core import page_table
from vllm_hisparse.core.page_table import DevicePageTable, flush_tables
from vllm_hisparse.core.staging import HostToDevice


def expected(pages: dict, rows: int, width: int) -> np.ndarray:
    out = np.full((rows, width), -1, dtype=np.int32)
    for r, p in pages.items():
        out[r, :len(p)] = p
    return out


@pytest.mark.parametrize("seed", range(4))
def test_tables_equal_the_page_lists(seed):
    rng = random.Random(seed)
    rows, width = 5, 64
    h2d = HostToDevice("cpu")
    tabs = [DevicePageTable(rows, width, "cpu", h2d), DevicePageTable(rows, width, "cpu", h2d)]
    lists = [{r: [] for r in range(rows)} for _ in tabs]
    free = list(range(100_000))
    rng.shuffle(free)
    for step in range(60):
        for t, pages in zip(tabs, lists):
            for r in rng.sample(range(rows), rng.randint(0, rows)):
                n = rng.choice([1, 1, 1, 2, 17])             # decode pages, or a prompt's
                n = min(n, width - len(pages[r]))
                pages[r].extend(free.pop() for _ in range(n))
                assert t.grow(r, pages[r]) == n
                assert t.grow(r, pages[r]) == 0             # nothing new the second time
        if rng.random() < 0.5:
            flush_tables([tabs[0], None, tabs[1]])
        else:
            tabs[0].flush()
            tabs[1].flush()
        if rng.random() < 0.2:                               # a request finishes
            r = rng.randrange(rows)
            for t, pages in zip(tabs, lists):
                t.clear(r)
                pages[r] = []
        for t, pages in zip(tabs, lists):
            assert np.array_equal(t.table.numpy(), expected(pages, rows, width)), f"step {step}"


def test_few_pages_are_written_without_a_copy(monkeypatch):
    """A decode step's new pages (up to FEW) go as scalar writes: no host->device copy."""
    calls = []
    h2d = HostToDevice("cpu")
    t = DevicePageTable(2, 8, "cpu", lambda x, dtype: calls.append(1) or h2d(x, dtype))
    t.grow(0, [7, 3])
    t.grow(1, [5])
    flush_tables([t])
    assert calls == [] and t.table[0, :2].tolist() == [7, 3] and t.table[1, 0] == 5
    more = list(range(10, 11 + page_table.FEW))              # FEW + 1: one copy
    t.grow(1, [5] + more)
    flush_tables([t])
    assert calls == [1] and t.table[1, :len(more) + 1].tolist() == [5] + more
