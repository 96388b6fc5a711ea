"""HiSparseConnector: the one vLLM-facing KV connector of hisparse, for GQA and MLA/DSA models.
vLLM makes one instance per role; like vLLM's OffloadingConnector, this class only forwards each
call to the half of its role, and the deployment (core/deployment.py: the model's attention kind,
``limits.mla``) picks the pair of halves (``HALVES``):

  * GQA/MHA models: ``connector_scheduler.ConnectorScheduler`` (scheduler process: admission into
    the host pool and the indexer rows, the step's metadata for the worker, the delayed free of
    requests that may be sparse, the scheduler's metrics) and ``connector_worker.ConnectorWorker``
    (worker process: the worker object and its ``SparseRuntime``, requests registered and
    dropped, each FULL decode step planned in ``start_load_kv``, the rank's metrics); metadata
    ``HiSparseConnectorMetadata``;
  * MLA models with a DSA indexer (docs/dsa.md): ``mla_connector.LatentConnectorScheduler``
    (admission through the latent ledger, its events and first blocks in the step's metadata) and
    ``mla_connector.LatentConnectorWorker`` (the events applied to the ``LatentRuntime``, the
    noted step planned in ``start_load_kv``); metadata ``HiSparseMLAConnectorMetadata``.

A half implements the connector methods of its role under vLLM's names (``request_finished``
also answers ``request_finished_all_groups``, ``stats`` answers ``get_kv_connector_stats``); a
per-layer hook a half leaves out is vLLM's default, nothing (``_optional``). Nothing else happens
here: tests/test_connector_seam.py calls every method with stand-in halves.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

import torch

from vllm_hisparse.core.deployment import Deployment

from . import metrics
from .compat import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    get_tensor_model_parallel_rank,
)
from .connector_metadata import HiSparseConnectorMetadata
from .connector_scheduler import ConnectorScheduler
from .connector_worker import STATS_ENV, ConnectorWorker
from .deployment import deployment_of
from .mla_connector import LatentConnectorScheduler, LatentConnectorWorker
from .profile_span import span

__all__ = ["HALVES", "HiSparseConnector", "HiSparseConnectorMetadata", "STATS_ENV", "kind_of"]


@dataclass(frozen=True)
class Halves:
    """What serves one attention kind: the scheduler half and the worker half, each made from
    (vllm_config, deployment), and whether vllm/metrics.py's Prometheus series are exported."""
    scheduler: Callable[[Any, Deployment], Any]
    worker: Callable[[Any, Deployment], Any]
    prom_metrics: bool


def _gqa_worker(vllm_config, dep: Deployment) -> ConnectorWorker:
    return ConnectorWorker(vllm_config, dep, get_tensor_model_parallel_rank())


HALVES = MappingProxyType({          # read-only: the adapter keeps no mutable module state
    "gqa": Halves(ConnectorScheduler, _gqa_worker, prom_metrics=True),
    "mla": Halves(LatentConnectorScheduler, LatentConnectorWorker, prom_metrics=False),
})


def kind_of(dep: Deployment) -> str:
    """The key of ``HALVES`` serving this deployment: "mla" on a model with latent rows."""
    return "mla" if dep.limits.mla else "gqa"


def _optional(half, name: str, *args, **kwargs):
    """A hook vLLM's base class makes a no-op, which a half may leave out."""
    fn = getattr(half, name, None)
    return None if fn is None else fn(*args, **kwargs)


class HiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        dep = deployment_of(vllm_config)
        halves = HALVES[kind_of(dep)]
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = halves.scheduler(vllm_config, dep)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = halves.worker(vllm_config, dep)

    @property
    def worker(self):
        """The process's worker object (worker role; vllm/worker.py ``current`` reads it through
        vLLM's KV-transfer group), else None."""
        return self.connector_worker.worker if self.connector_worker is not None else None

    def __getattr__(self, name: str):
        """Anything else is the role's half's (its state, read by tests and tools)."""
        for half in (self.__dict__.get("connector_scheduler"),
                     self.__dict__.get("connector_worker")):
            if half is not None and hasattr(half, name):
                return getattr(half, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ---- scheduler process -------------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        return self.connector_scheduler.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                                 num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        """reset_prefix_cache(reset_connector=True): the scheduler's host page index."""
        return _optional(self.connector_scheduler, "reset_cache")   # None: nothing to reset

    def update_connector_output(self, connector_output) -> None:
        return self.connector_scheduler.update_connector_output(connector_output)

    # ---- worker process ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)     # vLLM's own record of it
        with span("hisparse.bind"):
            return self.connector_worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        with span("hisparse.plan"):
            return self.connector_worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return _optional(self.connector_worker, "wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return _optional(self.connector_worker, "save_kv_layer", layer_name, kv_layer,
                         attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        return _optional(self.connector_worker, "wait_for_save")

    def get_finished(self, finished_req_ids: set[str]):
        return self.connector_worker.get_finished(finished_req_ids)

    # ---- metrics (vllm/metrics.py): vLLM asks both roles every step ----------------------------
    def get_kv_connector_stats(self):
        half = self.connector_worker or self.connector_scheduler
        return half.stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return metrics.build_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        if not HALVES[kind_of(deployment_of(vllm_config))].prom_metrics:
            return None                   # the DSA path reports no KV-connector stats
        return metrics.HiSparsePromMetrics(vllm_config, metric_types, labelnames,
                                           per_engine_labelvalues)
