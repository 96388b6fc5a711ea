"""The decode batch: every row of a step that has one query token, with what its layers need,
decided once per step on the host and copied to the device in one go.

A uniform decode step of vLLM (each row one token, padded by vLLM to a CUDA-graph size N) is one
decode batch of N rows; in a mixed step the one-token rows form it (N = their number) and the
prefill rows go their own way. Every layer of the step runs ``core/decode_body.py`` on it — eagerly,
or recorded once into vLLM's FULL CUDA graph of size N and replayed: so everything the body reads
per step lives in buffers of fixed address per N (``meta``, ``newest``), rewritten by ``fill``
before the forward. Per row (one int64 field each, ``FIELDS``):

- ``seq``: keys including the new token; 0 = padding (the row writes and reads nothing);
- ``full``, ``sp_seq``: a sparse row's complete pages and its seq (0 for any other row: the sparse
  kernels skip it); ``hot``: pages [0, hot) resolve through its hot slots (its pages given back
  and the floor's blocks), pages [hot, full) through the block table (0: a resident row);
- ``row``, ``irow``: runtime row (hot-slot state, host / dense-pool page tables) and indexer row
  (scratch rows for rows that own none);
- ``host_page``, ``dpool_page``: where the new token goes besides the cache (-1: not);
- ``i_unit``: where it goes in the indexer's state (``Indexer.decode_unit``; -1: not);
- ``dn_seq``: keys of a dense row in sparse layers; ``dl_seq`` / ``pool_seq``: keys read in dense
  layers from the cache / the dense pool (0 where the row reads the other).

and four host-side batch flags (``KINDS``): any sparse row, any dense row, any dense-layer row on
the cache, on the pool. An eager run launches only the kernels of the kinds the batch holds; a
graph records them all (it serves any batch of its size, and each kernel returns at once for rows
not of its kind: conditional graph nodes that skipped them were slower, docs/gpu-results.md).
The flags of an all-padding batch (vLLM's warm-up before a capture) are all set, so that run
compiles every kernel.
"""
from __future__ import annotations

import numpy as np
import torch

FIELDS = ("seq", "full", "sp_seq", "hot", "row", "irow", "host_page", "dpool_page", "i_unit",
          "dn_seq", "dl_seq", "pool_seq")
KINDS = ("has_sparse", "has_dense", "has_dl", "has_pool")
_KIND_OF = {"has_sparse": "sp_seq", "has_dense": "dn_seq", "has_dl": "dl_seq",
            "has_pool": "pool_seq"}


class DecodeBatch:
    """The buffers of one batch size N (fixed addresses: a FULL graph of size N reads them)."""

    def __init__(self, N: int, device, sel: tuple[int, int] | None = None):
        self.N = N
        # sel (layers, k): every layer's selected pages of each row, kept until the next step of
        # this size (core/give_back.py reads a spilled row's previous selection)
        self.sel = (None if sel is None else
                    torch.full((sel[0], N, sel[1]), -1, dtype=torch.int32, device=device))
        F = len(FIELDS)
        self.meta = torch.zeros(F * N, dtype=torch.int64, device=device)
        self.newest = torch.full((N,), -1, dtype=torch.int32, device=device)
        self._f = {name: self.meta[i * N:(i + 1) * N] for i, name in enumerate(FIELDS)}
        self.flags = dict.fromkeys(KINDS, False)
        self.steps: list = []                         # core.step_plan.ReqStep of rows 0..n-1
        self.freed: list = []                         # dense layers read these rows from the host
        self.host_meta = None                         # meta's host copy (core/steady_step.py)

    def field(self, name: str) -> torch.Tensor:
        return self._f[name]

    def holds(self, kind: str) -> bool:
        """Whether the batch holds rows of ``kind`` (KINDS); always while a CUDA graph is being
        captured (the graph serves every batch of its size)."""
        return self.flags[kind] or (self.meta.is_cuda and torch.cuda.is_current_stream_capturing())

    def run_kinds(self, names: tuple, fns: list) -> None:
        """fns[i]() if the batch ``holds`` rows of kind names[i]."""
        for name, fn in zip(names, fns):
            if self.holds(name):
                fn()

    @property
    def n(self) -> int:
        return len(self.steps)


def fill(rt, db: DecodeBatch, steps: list, host_pages: dict) -> None:
    """Rows 0..n-1 of db = ``steps`` (core.step_plan.ReqStep, one query token each), the rest
    padding; one host->device copy. rt: the SparseRuntime (page size, scratch rows, indexer, pools,
    whether dense layers read sparse rows from the dense pool); host_pages: req_id -> (host page
    list, dense-pool page list or None) of the sparse rows, as the plan just grew them."""
    N, n, P = db.N, len(steps), rt.P
    if n > N:
        raise ValueError(f"{n} one-token rows do not fit a decode batch of {N}")
    m = np.zeros((len(FIELDS), N), dtype=np.int64)
    F = dict(zip(FIELDS, m))
    F["row"][:] = rt.scratch_row
    F["irow"][:] = rt.ix.scratch
    F["host_page"][:] = F["dpool_page"][:] = F["i_unit"][:] = -1
    freed = []
    for i, s in enumerate(steps):
        seq = s.seq_len
        page = (seq - 1) // P
        F["seq"][i] = seq
        F["row"][i] = s.row
        if s.sparse:
            F["full"][i], F["sp_seq"][i] = page, seq
            F["hot"][i] = s.freed[1] if s.freed[1] > s.freed[0] else 0
            F["irow"][i] = s.irow
            F["i_unit"][i] = rt.ix.decode_unit(s.irow, seq)
            hp, dp = host_pages.get(s.req_id, (None, None))
            if hp is not None:
                F["host_page"][i] = hp[page]
            if dp is not None:
                F["dpool_page"][i], F["pool_seq"][i] = dp[page], seq
            elif s.freed[1] > s.freed[0]:
                freed.append(s)                       # dense layers: the host read-back path
            else:
                F["dl_seq"][i] = seq
        else:
            F["dn_seq"][i] = F["dl_seq"][i] = seq
    ir = F["irow"][F["sp_seq"] > 0]
    if len(np.unique(ir)) != len(ir):   # the fused write + scores launch relies on it
        raise RuntimeError(f"hisparse: two sparse rows of one decode batch share an indexer row "
                           f"({sorted(ir.tolist())}); every sparse request must own its row")
    on = [bool(F[_KIND_OF[c]].any()) for c in KINDS]
    rt.h2d(m.reshape(-1), out=db.meta)
    db.host_meta = m
    # the host's flags of an all-padding batch (vLLM's warm-up and capture runs) are all set: its
    # rows are inert, but an eager run then compiles every kernel before a capture records it
    db.flags = {c: n == 0 or f for c, f in zip(KINDS, on)}
    db.steps, db.freed = list(steps), freed


def row_counts(steps: list, P: int) -> dict:
    """The runtime's row counts of a decode batch of one-token rows ``steps`` (P: page size):
    sparse rows; dense ones past their prompt's start; sparse rows with every page on the GPU
    (block table, no misses) and with some of them (the rest go through hot slots)."""
    sp = [s for s in steps if s.sparse]
    return {"decode_rows": len(sp),
            "dense_decode_rows": sum(not s.sparse and s.start > 0 for s in steps),
            "resident_rows": sum(s.freed[1] <= s.freed[0] for s in sp),
            "partial_rows": sum(s.freed[0] < s.freed[1] < (s.seq_len - 1) // P for s in sp)}
