"""HiSparseConnector: the GQA path's request lifecycle of the host KV pool, through vLLM's KV
connector API. vLLM makes one instance per role; like vLLM's OffloadingConnector, this class only
forwards each call to the half of its role:

  * scheduler process (role SCHEDULER): ``connector_scheduler.ConnectorScheduler`` — admission
    into the host pool and the indexer rows, the step's metadata for the worker, the delayed free
    of requests that may be sparse, the scheduler's metrics;
  * worker process (role WORKER): ``connector_worker.ConnectorWorker`` — the process's worker
    object (vllm/worker.py) and its runtime, requests registered and dropped, each FULL decode
    step planned in ``start_load_kv``, the rank's metrics.

The metadata between them is ``HiSparseConnectorMetadata`` (connector_scheduler.py).
"""
from __future__ import annotations

from typing import Any

import torch

from . import metrics
from .compat import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    get_tensor_model_parallel_rank,
)
from .connector_scheduler import ConnectorScheduler, HiSparseConnectorMetadata
from .connector_worker import STATS_ENV, ConnectorWorker
from .deployment import deployment_of

__all__ = ["HiSparseConnector", "HiSparseConnectorMetadata", "STATS_ENV"]


class HiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        dep = deployment_of(vllm_config)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ConnectorScheduler(vllm_config, dep)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = ConnectorWorker(vllm_config, dep,
                                                    get_tensor_model_parallel_rank())

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
        self.connector_scheduler.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                                 num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> HiSparseConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    # ---- worker process ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.connector_worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.connector_worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None                       # write-through happens inside the attention backend

    def wait_for_save(self) -> None:
        return None

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
        return metrics.HiSparsePromMetrics(vllm_config, metric_types, labelnames,
                                           per_engine_labelvalues)
