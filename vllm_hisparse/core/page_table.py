"""A pool's pages of each runtime row, mirrored on the device for the kernels.

``table`` is (rows, width) int32, -1 = no page: entry [row, u] is the pool page holding logical page
u of that row's request. It grows as the pool hands pages out (queued during the step's plan, then
written by ``flush_tables``: one host->device copy for every table, one scatter a table), and a row
is cleared when its request finishes, so RESOLVE, the write-through and the dense-pool attention
index it without host work.
"""
from __future__ import annotations

import numpy as np
import torch


class DevicePageTable:
    def __init__(self, rows: int, width: int, device, h2d=None):
        """h2d: the runtime's core.staging.HostToDevice (copies that do not wait for the GPU)."""
        self.table = torch.full((rows, width), -1, dtype=torch.int32, device=device)
        self.width = width
        self._h2d = h2d or (lambda x, dtype: torch.tensor(x, dtype=dtype).to(device))
        self._len = [0] * rows
        self._idx: list[int] = []          # queued: flat index row * width + u of each new page
        self._val: list[int] = []          # and its pool page

    def grow(self, row: int, pages: list[int]) -> int:
        """Queue the pages a pool handed to ``row`` beyond those already mirrored (``pages`` is the
        row's whole page list); returns how many are new."""
        have = self._len[row]
        new = pages[have:]
        if new:
            base = row * self.width + have
            self._idx.extend(range(base, base + len(new)))
            self._val.extend(new)
            self._len[row] = have + len(new)
        return len(new)

    def flush(self) -> None:
        """Write the queued pages to the device table."""
        flush_tables([self])

    def clear(self, row: int) -> None:
        if self._len[row]:
            self.table[row] = -1
            self._len[row] = 0


FEW = 4      # queued pages up to which each is written on its own (a decode step's new pages)


def flush_tables(tables: list) -> None:
    """Write the queued pages of every table (None entries skipped) to its device table. A few
    (a decode step's new pages, one a row at its page boundary): each written as a scalar, one
    small launch each, no copy. More (a prompt's): one host->device copy of one byte buffer (every
    table's flat indices as int64, then every table's pages as int32, so each part is aligned for
    its view on the device), then one scatter a table. Nothing waits for the GPU."""
    todo = [t for t in tables if t is not None and t._idx]
    if not todo:
        return
    if sum(len(t._idx) for t in todo) <= FEW:
        for t in todo:
            flat = t.table.view(-1)
            for i, v in zip(t._idx, t._val):
                flat.narrow(0, i, 1).fill_(v)      # a launch (`flat[i] = v` copies: a sync)
            t._idx, t._val = [], []
        return
    idx = np.concatenate([np.asarray(t._idx, dtype=np.int64) for t in todo])
    val = np.concatenate([np.asarray(t._val, dtype=np.int32) for t in todo])
    dev = todo[0]._h2d(np.concatenate([idx.view(np.uint8), val.view(np.uint8)]), torch.uint8)
    di, dv = dev[:idx.nbytes].view(torch.int64), dev[idx.nbytes:].view(torch.int32)
    off = 0
    for t in todo:
        k = len(t._idx)
        t.table.view(-1).index_put_((di[off:off + k],), dv[off:off + k])
        off += k
        t._idx, t._val = [], []
