"""A steady decode step: planned as the previous one plus a token.

Most FULL-graph decode steps change nothing but every row's length: the batch holds the previous
step's requests in the same order, each one token longer, and no row's new token starts a page.
Then nothing the full plan decides can change: no host or dense-pool page is handed out, no window
slides (``residency.freed_pages`` moves only when a page completes), no hot-slot state is seeded
or reset, nothing is inserted, no request turns sparse. The decode batch (core/decode_batch.py)
differs from the previous one only in its length fields (``seq``, ``sp_seq``, ``dn_seq``,
``dl_seq``, ``pool_seq``: a row's seq or 0), so ``SteadyStep.advance`` adds one to those in the
host copy of the batch and sends it with the one host->device copy: no per-request bookkeeping and
no batch assembly. (The indexer's unit of the new token moves only at a page's end for a page
indexer; a token indexer's moves every step, so such a runtime always plans in full.) Anything
else — a page boundary, a spill since the last plan, a new batch, a trace, window exits, the host
read-back of dense layers — returns False and the runtime runs its full plan, which records the
batch again.

It cuts a 32K row's plan to under half its host time, in resident mode and elastic alike
(docs/gpu-results.md); the host time shows in a step whenever the host, not the GPU, bounds it.
tests/test_steady_step.py checks that both plans send the same bytes step by step.
``HISPARSE_STEADY_PLAN=0`` turns it off (an A/B knob).
"""
from __future__ import annotations

import numpy as np

from vllm_hisparse.core import give_back
from vllm_hisparse.knobs import env_flag
from vllm_hisparse.core.decode_batch import FIELDS, row_counts
from vllm_hisparse.core.hostless import runs_dense
from vllm_hisparse.core.residency import is_sparse_at

LENGTHS = [FIELDS.index(f) for f in ("seq", "sp_seq", "dn_seq", "dl_seq", "pool_seq")]


def steady_plan_on() -> bool:
    """The A/B knob of both runtimes' steady plans (this one's, GQA; core/latent_runtime.py's,
    DSA)."""
    return env_flag("HISPARSE_STEADY_PLAN", True,
                    "plan a steady decode step as the previous one plus a token", "always in full")


class _Last:
    """The last FULL-graph step planned: its batch, requests and lengths, the positions in the
    batch's host copy that grow by one each step, the dense rows, and the row counts each step
    adds to the stats."""
    __slots__ = ("db", "flat", "req_ids", "seq_lens", "grow", "dense", "counts")

    def __init__(self, db, req_ids, seq_lens, steps, P):
        n, N = len(steps), db.N
        self.db, self.flat = db, db.host_meta.reshape(-1)
        self.req_ids, self.seq_lens = list(req_ids), list(seq_lens)
        pos = np.array([f * N + i for f in LENGTHS for i in range(n)], dtype=np.int64)
        self.grow = pos[self.flat[pos] > 0]               # a row's seq where it has one, not 0
        self.dense = [(i, s.req_id) for i, s in enumerate(steps) if not s.sparse]
        self.counts = row_counts(steps, P)          # the same at each step within the page, but
        self.counts["dense_decode_rows"] = len(self.dense)    # every dense row is past its start
        self.counts["steady_steps"] = 1


class SteadyStep:
    def __init__(self, enabled: bool | None = None):
        self.enabled = steady_plan_on() if enabled is None else enabled
        self._last: _Last | None = None

    def forget(self) -> None:
        """Something changed outside a FULL-graph step's plan (a mixed step, a spill): the next
        step gets the full plan."""
        self._last = None

    def remember(self, rt, db, req_ids: list, seq_lens: list, steps: list) -> None:
        """After the full plan of a FULL-graph step: its decode batch and one-token rows. (What
        holds for the runtime's whole life — a trace, window exits, a token indexer — is checked
        here, not at every step.)"""
        ok = (self.enabled and steps and db.host_meta is not None and rt.cfg.unit_tokens > 1
              and rt.trace is None and not give_back.WINDOW_EXITS
              and not (db.freed and rt.dense_layers))   # (dense layers reading the host)
        self._last = _Last(db, req_ids, seq_lens, steps, rt.P) if ok else None

    def advance(self, rt, req_ids: list, seq_lens: list, db) -> bool:
        """Plan this FULL-graph step (decode batch ``db`` of its padded size) as the previous one
        plus a token, if it is steady; False: run the full plan."""
        last = self._last
        if last is None or last.db is not db or last.req_ids != req_ids or rt.given_back.spilled:
            return False
        P = rt.P
        for s, p in zip(seq_lens, last.seq_lens):
            if s != p + 1 or (s - 1) % P == 0:          # a new page: handed out, windows slide
                return False
        cfg = rt.cfg                                    # a dense row turning sparse:
        reqs = rt.reqs
        if any(not runs_dense(cfg, reqs[rid]) and is_sparse_at(cfg, reqs[rid].num_prompt, seq_lens[i])
               for i, rid in last.dense):
            return False
        flat = last.flat
        flat[last.grow] += 1
        rt.h2d(flat, out=db.meta)
        for rid, s in zip(req_ids, seq_lens):
            rt.reqs[rid].start = s - 1
        last.seq_lens[:] = seq_lens
        for k, v in last.counts.items():
            rt.stats[k] += v
        return True
