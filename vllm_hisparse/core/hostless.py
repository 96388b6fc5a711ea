"""Host-less requests on the worker (core/residency.py says when the scheduler admits one): a
request the host pool had no room for, held whole in its own GPU blocks, never spilled (the KV
manager skips it: vllm/spill_ledger.py ``SpillLedger.hostless``).

With ``hostless`` "sparse" (the default) it is sparse by the length rule like every request, and
exactly as resident mode runs it: its indexer row (reserved at admission) selects its pages, and
with keep None (resident, nothing given back) RESOLVE reads every selected page through its block
table, so no page is ever fetched; its dense layers read its GPU blocks (``dl_seq``, not the dense
pool). It has no host (or dense-pool) page: its rows of the runtime's page tables stay -1, so
every write-through of its tokens (prefill: ops/write_through.py, decode: ``decode_write``, the
switch's copy) skips it, as the ops skip padding. With "dense" it is never sparse while host-less
(stock vLLM's outputs) and holds no indexer row.

Moving into the host tier (``host_back``, when the scheduler has reserved host pages for its whole
life: the step's metadata ``hosted``): from its next planned step it gets host (and dense-pool)
pages like any sparse request, and that step first copies its KV so far, positions
``[0, start)`` of every layer, from its GPU blocks to them (core/turn_sparse.py ``copy_context``,
without the indexer: its row is up to date). The step's own tokens are then written through by
the usual paths, so from the step after it is an ordinary host-backed request: resident until the
KV manager spills it, then reading the pages it gave back from the host. A "dense" one (or one
still short of ``min_context``) has no indexer state yet: it takes the switch path instead at the
step its context reaches ``min_context`` (at once for a long one), the indexer copy included.
"""
from __future__ import annotations


def runs_dense(cfg, r) -> bool:
    """Whether the runtime request ``r`` runs dense because it is host-less ("dense" only)."""
    return r.hostless and cfg.hostless == "dense"


def host_back(rt, req_id: str) -> None:
    """The host-less request ``req_id`` of the SparseRuntime ``rt`` has host pages (and, "dense",
    an indexer row) reserved now: from its next planned step it takes host pages, and, if it is
    sparse already, that step copies its KV so far to them (``Req.moving``); keep stays None
    (resident) until the KV manager spills it."""
    r = rt.reqs[req_id]
    if not r.hostless:
        return
    r.hostless = False
    r.moving = r.sparse
    rt.steady.forget()                      # a steady FULL step would not plan the copy
