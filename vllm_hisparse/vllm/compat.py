"""Every version-dependent vLLM import of the adapter, in one place (vLLM 0.26.x).

Importing this module fails with one clear line on any other vLLM version.
"""
from __future__ import annotations

import vllm

SUPPORTED = "0.26."
VERSION = getattr(vllm, "__version__", "unknown")
if not VERSION.startswith(SUPPORTED):
    raise ImportError(f"vllm-hisparse supports vLLM 0.26.x; found {VERSION}")

from vllm.config import VllmConfig, get_current_vllm_config  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # noqa: E402
from vllm.logger import init_logger as _vllm_init_logger  # noqa: E402
from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
from vllm.model_executor.models.utils import extract_layer_index  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402
from vllm.v1.engine.input_processor import InputProcessor  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402
from vllm.v1.metrics.utils import create_metric_per_engine  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

__all__ = [
    "VERSION", "VllmConfig", "get_current_vllm_config", "CUDAGraphMode", "KVTransferConfig", "KVConnectorFactory", "KVConnectorBase_V1", "KVConnectorMetadata",
    "KVConnectorRole", "SupportsHMA", "get_kv_transfer_group", "has_kv_transfer_group", "KVConnectorStats", "KVConnectorPromMetrics",
    "create_metric_per_engine", "get_tensor_model_parallel_rank", "init_logger", "Attention", "MLAAttention", "extract_layer_index",
    "AttentionBackend", "AttentionCGSupport", "AttentionImpl", "AttentionMetadataBuilder",
    "AttentionType", "CommonAttentionMetadata", "MultipleOf", "AttentionBackendEnum",
    "register_backend", "FullAttentionManager", "FullAttentionSpec", "KVCacheSpecRegistry",
    "InputProcessor",
    "current_platform_cls", "gpu_worker_cls", "StatLoggerBase",
]


def init_logger(name: str):
    """vLLM's logger, placed under the ``vllm`` logger so it shares vLLM's handler and level: a
    logger outside that tree (``vllm_hisparse.*``) prints nothing below WARNING."""
    return _vllm_init_logger(name if name.startswith("vllm.") else f"vllm.{name}")


def current_platform_cls():
    from vllm.platforms import current_platform

    return type(current_platform)


def gpu_worker_cls():
    """vLLM's GPU ``Worker`` (imported on demand: only a DSA worker process on CUDA wraps it,
    kv_room.py)."""
    from vllm.v1.worker.gpu_worker import Worker

    return Worker
