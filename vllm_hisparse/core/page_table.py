"""A pool's pages of each runtime row, mirrored on the device for the kernels.

``table`` is (rows, width) int32, -1 = no page: entry [row, u] is the pool page holding logical page
u of that row's request. It grows as the pool hands pages out (queued during the step's plan, then
written by ``flush_tables``: one host->device copy for every table, one scatter a table), and a row
is cleared when its request finishes, so RESOLVE, the write-through and the dense-pool attention
index it without host work.

``fetch`` is the table the fetches read (pages copied from the pool into the GPU), and
``host_reads`` the pages the one read on the host side takes (dense layers reading freed pages
back); writes index ``table``. They are one tensor, except under
``HISPARSE_TEST_CORRUPT_FETCH=1``: the negative control of the exactness harnesses
(scripts/exact_verdict.py), refused by ``vllm serve``. Then ``fetch`` is a second tensor in which
entry [row, u] holds the page of u's neighbour (u ^ 1) where both have one, and ``host_reads``
swaps the same pairs: every page read from the pool is the wrong one, nothing else changes, so a
harness that compares a run with misses against resident mode must report a mismatch.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_hisparse.knobs import env_flag

CORRUPT_FETCH_ENV = "HISPARSE_TEST_CORRUPT_FETCH"


def corrupt_fetch() -> bool:
    """The negative control's knob (read when a table is built)."""
    return env_flag(CORRUPT_FETCH_ENV, False,
                    on="every page fetched from the host pool read from its neighbour: wrong "
                       "outputs by design, a negative control for exactness harnesses",
                    off="fetches read their own page")


class DevicePageTable:
    def __init__(self, rows: int, width: int, device, h2d=None):
        """h2d: the runtime's core.staging.HostToDevice (copies that do not wait for the GPU)."""
        self.table = torch.full((rows, width), -1, dtype=torch.int32, device=device)
        self.fetch = self.table.clone() if corrupt_fetch() else self.table
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
            self._corrupt()

    def host_reads(self, pages: list[int]) -> list[int]:
        """The pool pages a read on the host side takes for a request's logical pages 0..n-1
        (``pages``; core/prefill.attend_from_host): ``pages``, or under the negative control the
        same neighbour swap as ``fetch`` (``swap_neighbours``)."""
        if self.fetch is self.table or not pages:
            return pages
        return swap_neighbours(torch.tensor(pages, dtype=torch.int64)).tolist()

    def _corrupt(self) -> None:
        """Under the negative control: ``fetch`` = ``swap_neighbours(table)`` (in place: a CUDA
        graph keeps its address)."""
        if self.fetch is not self.table:
            self.fetch.copy_(swap_neighbours(self.table))


def swap_neighbours(t: torch.Tensor) -> torch.Tensor:
    """The negative control's wrong pages: t (..., n) with entries 2i and 2i + 1 of the last
    dimension swapped where both hold a page (>= 0); a trailing odd entry and lone pages kept."""
    n = t.shape[-1]
    w = n - n % 2
    pairs = t[..., :w].reshape(*t.shape[:-1], w // 2, 2)
    swapped = pairs.flip(-1)
    out = t.clone()
    out[..., :w] = torch.where((pairs >= 0) & (swapped >= 0), swapped, pairs).reshape(
        *t.shape[:-1], w)
    return out


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
            t._corrupt()
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
        t._corrupt()
