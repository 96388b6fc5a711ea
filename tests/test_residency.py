"""core/residency.py's resident-first pieces: freed_pages of a resident, partial and floor
request, and spill_order on scripted pools (which requests the scheduler takes blocks from to get
its reserve back)."""
from __future__ import annotations

import pytest

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.residency import freed_pages, resident_pages, spill_order

CFG = HiSparseConfig(top_k=32, device_buffer_size=64, page_size=16, min_context=100,
                     resident_first=True, host_tier=True)


def test_nothing_freed_until_spilled():
    S = CFG.num_slots
    for processed in (0, 99, 100, 160, 1000):
        assert freed_pages(CFG, processed, 120, keep=None) == (S, S)
        assert resident_pages(CFG, processed, 120, None) == max(0, processed // 16 - S)
    assert freed_pages(CFG, 1000, 120, keep=0) == (S, 1000 // 16)
    assert freed_pages(CFG, 1000, 120) == (S, 1000 // 16)           # default: the floor, as before


def test_partial_keeps_a_sliding_window_of_the_newest_pages():
    """keep = complete pages beyond the floor still held, counted back from the newest: the
    oldest pages go first, and the window slides as pages complete (its size never grows)."""
    S = CFG.num_slots                                                # 4
    assert freed_pages(CFG, 1000, 120, keep=10) == (S, 62 - 10)     # 62 complete pages
    assert resident_pages(CFG, 1000, 120, 10) == 10
    assert freed_pages(CFG, 1016, 120, keep=10) == (S, 53)          # one more page: slides
    assert resident_pages(CFG, 1016, 120, 10) == 10
    assert freed_pages(CFG, 1000, 120, keep=58) == (S, S)           # keeps all 58: nothing freed
    assert freed_pages(CFG, 1000, 120, keep=500) == (S, S)
    assert resident_pages(CFG, 1000, 120, 500) == 58
    assert freed_pages(CFG, 1000, 120, keep=57) == (S, S + 1)       # one given back: page S
    assert freed_pages(CFG, 110, 120, keep=0) == (S, S)             # prompt not processed yet
    for keep in (0, 3, 20, 58, None):                               # freed + held = complete
        lo, hi = freed_pages(CFG, 1000, 120, keep)
        assert (hi - lo) + resident_pages(CFG, 1000, 120, keep) == 62 - S


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
