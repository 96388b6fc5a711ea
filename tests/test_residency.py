"""core/residency.py's resident-first pieces: freed_pages while a request is not spilled, and
spill_order on scripted pools (which requests the scheduler spills to get its reserve back)."""
from __future__ import annotations

import pytest

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.residency import freed_pages, spill_order

CFG = HiSparseConfig(top_k=32, device_buffer_size=64, page_size=16, min_context=100,
                     resident_first=True, host_tier=True)


def test_nothing_freed_until_spilled():
    S = CFG.num_slots
    for processed in (0, 99, 100, 160, 1000):
        assert freed_pages(CFG, processed, 120, spilled=False) == (S, S)
    assert freed_pages(CFG, 1000, 120, spilled=True) == (S, 1000 // 16)
    assert freed_pages(CFG, 1000, 120) == (S, 1000 // 16)           # default: spilled, as before


@pytest.mark.parametrize("surplus, free, reserve, want", [
    ({"a": 10, "b": 30, "c": 20}, 50, 40, []),                      # reserve already free
    ({"a": 10, "b": 30, "c": 20}, 30, 40, ["b"]),                   # the largest covers it
    ({"a": 10, "b": 30, "c": 20}, 0, 45, ["b", "c"]),               # largest first until covered
    ({"a": 10, "b": 30, "c": 20}, 0, 100, ["b", "c", "a"]),         # never enough: all
    ({"x": 5, "w": 5}, 0, 3, ["w"]),                                # ties by id
    ({"a": 0, "b": 4}, 0, 10, ["b"]),                               # no surplus: never picked
    ({}, 0, 10, []),
])
def test_spill_order(surplus, free, reserve, want):
    assert spill_order(surplus, free, reserve) == want
