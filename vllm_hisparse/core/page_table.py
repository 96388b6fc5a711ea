"""A pool's pages of each runtime row, mirrored on the device for the kernels.

``table`` is (rows, width) int32, -1 = no page: entry [row, u] is the pool page holding logical page
u of that row's request. It grows as the pool hands pages out (queued during the step's plan, then
one host->device scatter), and a row is cleared when its request finishes, so RESOLVE, the
write-through and the dense-pool attention index it without host work.
"""
from __future__ import annotations

import torch


class DevicePageTable:
    def __init__(self, rows: int, width: int, device, h2d=None):
        """h2d: the runtime's core.staging.HostToDevice (copies that do not wait for the GPU)."""
        self.table = torch.full((rows, width), -1, dtype=torch.int32, device=device)
        self._h2d = h2d or (lambda x, dtype: torch.tensor(x, dtype=dtype).to(device))
        self._len = [0] * rows
        self._queue: tuple[list, list, list] = ([], [], [])

    def grow(self, row: int, pages: list[int]) -> int:
        """Queue the pages a pool handed to ``row`` beyond those already mirrored (``pages`` is the
        row's whole page list); returns how many are new."""
        have = self._len[row]
        new = pages[have:]
        if new:
            self._queue[0].extend([row] * len(new))
            self._queue[1].extend(range(have, have + len(new)))
            self._queue[2].extend(new)
            self._len[row] = have + len(new)
        return len(new)

    def flush(self) -> None:
        """Write the queued pages to the device table (one copy)."""
        if self._queue[0]:
            upd = self._h2d(self._queue, dtype=torch.int64)
            self.table[upd[0], upd[1]] = upd[2].to(torch.int32)
            self._queue = ([], [], [])

    def clear(self, row: int) -> None:
        if self._len[row]:
            self.table[row] = -1
            self._len[row] = 0
