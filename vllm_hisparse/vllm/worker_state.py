"""This worker process's hisparse state, read-only, for scripts, benchmarks and tests: the worker
object (vllm/worker.py) as vLLM's KV-transfer group holds it (the worker-side connector's
``worker``). Nothing is kept here; the names below are looked up on each access.

``get_runtime()`` and the attributes ``runtime``, ``indexer_state``, ``dense_pool`` (None outside
a worker process of a GQA hisparse run) and ``_req_to_block`` (the batch rows' requests).
"""
from __future__ import annotations

from . import worker


def get_runtime():
    """The worker's runtime (SparseRuntime on the GQA path, LatentRuntime on the DSA path)."""
    w = worker.current()
    if w is None or w.runtime is None:
        raise RuntimeError("hisparse: no hisparse worker in this process (vLLM has not made its KV "
                           "connector here, or the run does not select --attention-backend "
                           "hisparse)")
    return w.runtime


def __getattr__(name: str):
    w = worker.current()
    if name in ("runtime", "indexer_state", "dense_pool"):
        return getattr(w, name, None)
    if name == "_req_to_block":
        return dict(w.rows.req_to_block) if w is not None else {}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
