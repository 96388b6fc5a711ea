"""HotRows: the hot-slot state of every layer of a SparseRuntime (a list indexed by layer:
``slots.HotBufferState``, None for a layer without hot slots) and a row's life over all of them.

A row is emptied when its request starts or restarts from token 0, and *seeded* at its first step
through the hot slots (the first step with pages given back, ``residency.freed_pages``): the floor
keeps a request's pages [0, S) in the blocks of its S slots (slot s is block table entry s, which
holds page s's KV since the prompt, and the blocks given back are pages [S, ...)), so the state
says so, slot s holding page s. Those pages are hits from then on until evicted, where an empty
state made each one's first selection a miss fetched from the host. Residency decides only where
a page is read, never what is attended: outputs are unchanged (tests/test_hot_rows.py).
"""
from __future__ import annotations


class HotRows(list):
    def __init__(self, states: list):
        super().__init__(states)
        self._seeded: set[int] = set()

    def reset(self, row: int) -> None:
        """Empty the row in every layer (a request starts, or restarts from token 0)."""
        self._seeded.discard(row)
        for h in self:
            if h is not None:
                h.reset(row)

    def step(self, row: int, freed: tuple[int, int]) -> None:
        """The row's step with given-back pages ``freed`` (residency.freed_pages): at its first
        step through the hot slots, slot s holds page s for s < S in every layer."""
        if freed[1] <= freed[0] or row in self._seeded:
            return
        self._seeded.add(row)
        for h in self:
            if h is not None:
                h.seed(row, h.slots)
