"""The one hisparse worker object of a worker process, and how each vLLM-facing piece reaches it.

A worker object owns the process's runtime (GQA: ``gqa_worker.HiSparseWorker`` around
``core.sparse_runtime.SparseRuntime``; MLA/DSA: ``mla_worker.LatentWorker`` around
``core.latent_runtime.LatentRuntime``), the batch rows' requests (``RequestRows``), the host block
tables the metadata builder found, and the step the builder noted until the connector plans it.
Both kinds answer the small ``Worker`` protocol below, which is all the connector's worker halves
use (vllm/connector.py picks the half of the model's kind).

No module global holds it; it is reached through vLLM's own handles:
  * the first hisparse attention impl makes it while vLLM builds the model (so vLLM's memory
    profiling counts what it reserves) and keeps it as ``impl.hisparse_worker``; the next impls,
    the metadata builders and the worker-side connector find it among the layers vLLM registered
    in ``compilation_config.static_forward_context`` (``find``);
  * the worker-side connector keeps it as ``connector.worker``, so anything in the process (scripts,
    benchmarks, tests: ``worker_state``) reaches it through vLLM's KV-transfer group (``current``).
"""
from __future__ import annotations

from typing import Protocol

from .request_rows import RequestRows

ATTR = "hisparse_worker"          # the attribute of an attention impl that holds the worker


class Worker(Protocol):
    """What the connector's worker halves use (worker process)."""

    rows: RequestRows             # the batch rows' requests (bound by the connector)
    runtime: object               # SparseRuntime or LatentRuntime (None before it is made)
    host_tables: dict             # vllm/host_block_table.py's cache of vLLM's host block tables

    def plan(self) -> None:
        """Plan the step the metadata builder noted, now that its requests are bound
        (connector start_load_kv, before vLLM runs or replays the step)."""

    def forget(self) -> None:
        """Drop a noted step that never reached ``plan`` (a dummy run; connector get_finished)."""


def find(vllm_config):
    """The worker an attention impl of this engine holds (its layers, in vLLM's static forward
    context), or None before the first hisparse impl is built."""
    layers = getattr(getattr(vllm_config, "compilation_config", None),
                     "static_forward_context", None) or {}
    for layer in layers.values():
        w = getattr(getattr(layer, "impl", None), ATTR, None)
        if w is not None:
            return w
    return None


def of_layer(vllm_config, layer_name: str):
    """The worker held by ``layer_name``'s impl (a metadata builder's first layer)."""
    layer = vllm_config.compilation_config.static_forward_context[layer_name]
    return getattr(layer.impl, ATTR)


def current():
    """This process's worker through vLLM's KV-transfer group (the worker-side connector); None
    outside a worker process of a hisparse run, or before vLLM made the connector."""
    from .compat import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "worker", None)
