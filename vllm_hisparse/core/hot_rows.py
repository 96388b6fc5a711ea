"""HotRows: the hot-slot state of every layer of a SparseRuntime (a list indexed by layer:
``slots.HotBufferState``, None for a layer without hot slots) and a row's life over all of them.

Every hot layer's state is a view of one *stacked* state (``stacked``: rows ``[i * rows, (i + 1) *
rows)`` are hot layer ``layers[i]``'s), so work on a row in every layer is one call over the
stacked state instead of one per layer: a row's reset and seeding here, the inserts of pages given
back (core/give_back.py). Each layer's state keeps its own tensors' addresses (views), which the
kernels read and write in place.

A row is emptied when its request starts or restarts from token 0, and *seeded* at its first step
through the hot slots (the first step with pages given back, ``residency.freed_pages``): the floor
keeps a request's pages [0, S) in the blocks of its S slots (slot s is block table entry s, which
holds page s's KV since the prompt, and the blocks given back are pages [S, ...)), so the state
says so, slot s holding page s. Those pages are hits from then on until evicted, where an empty
state made each one's first selection a miss fetched from the host. Residency decides only where
a page is read, never what is attended: outputs are unchanged (tests/test_hot_rows.py).
"""
from __future__ import annotations

import torch

from vllm_hisparse.slots import HotBufferState


class HotRows(list):
    def __init__(self, num_layers: int, hot_layers, rows: int, slots: int, units: int, policy,
                 device):
        """hot_layers: the layers with hot slots (each ``rows`` rows of ``slots`` slots over
        ``units`` logical units, replacement ``policy``); the others are None."""
        self.layers = sorted(hot_layers)
        self.layer_ids = torch.tensor(self.layers, dtype=torch.int64, device=device)
        self.rows = rows
        self._base = torch.arange(len(self.layers), dtype=torch.int64, device=device) * rows
        self.stacked = None
        states: list = [None] * num_layers
        if self.layers:
            big = self.stacked = HotBufferState.create(len(self.layers) * rows, slots, units,
                                                       policy, device)
            for i, layer in enumerate(self.layers):
                part = slice(i * rows, (i + 1) * rows)
                states[layer] = HotBufferState.wrap(
                    big.slot_unit[part], big.unit_slot[part],
                    {k: t[part] for k, t in big.pstate.items()}, big.policy)
        super().__init__(states)
        self._seeded: set[int] = set()

    def stacked_rows(self, rows) -> torch.Tensor:
        """The stacked state's rows of ``rows`` in each hot layer, in ``layers`` order: (len(layers),
        E) int64 for a device tensor of rows (E,), (len(layers),) for one row (an int). Built on the
        device: a host tensor copied there would wait for the GPU."""
        if isinstance(rows, int):
            return self._base + rows
        return self._base[:, None] + rows.to(torch.int64)[None, :]

    def reset(self, row: int) -> None:
        """Empty the row in every layer (a request starts, or restarts from token 0)."""
        self._seeded.discard(row)
        if self.stacked is not None:
            self.stacked.reset_rows(self.stacked_rows(row))

    def step(self, row: int, freed: tuple[int, int]) -> None:
        """The row's step with given-back pages ``freed`` (residency.freed_pages): at its first
        step through the hot slots, slot s holds page s for s < S in every layer."""
        if freed[1] <= freed[0] or row in self._seeded or self.stacked is None:
            return
        self._seeded.add(row)
        self.stacked.seed(self.stacked_rows(row), self.stacked.slots)
