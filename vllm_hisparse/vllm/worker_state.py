"""Worker-process state shared by the connector (request lifecycle) and the attention backend.

The backend's batch rows carry no request ids; the connector learns each request's first GPU
block from the scheduler (block 0 is a hot slot, never freed while the request lives), so a batch
row maps to its request through ``block_table[row, 0]``.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core import capacity, indexers
from vllm_hisparse.core.deployment import Deployment, EngineLimits, resolve
from vllm_hisparse.core.sparse_runtime import SparseRuntime

from .compat import init_logger

logger = init_logger(__name__)

runtime: SparseRuntime | None = None
indexer_state = None        # Indexer.allocate_state (Quest: per-layer (kmin, kmax))
_block_to_req: dict[int, str] = {}
_req_to_block: dict[str, int] = {}


def ensure_indexer_state(cfg, num_layers: int, rows: int, max_model_len: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype,
                         gpu_memory_utilization: float | None = None) -> None:
    """``reserve_indexer_state`` for an engine of these limits (rows: max_num_seqs)."""
    reserve_indexer_state(resolve(cfg, EngineLimits(num_layers, max_model_len, rows, num_kv_heads,
                                                     head_dim, dtype.itemsize)),
                          dtype, gpu_memory_utilization)


def reserve_indexer_state(dep: Deployment, dtype: torch.dtype,
                          gpu_memory_utilization: float | None = None) -> None:
    """Allocate the indexer's state (core/indexers, ``Indexer.allocate_state``; Quest: every
    sparse layer's page bounds, 2 x rows x cdiv(max_model_len, page) x Hkv x D elements per layer)
    while the model is being built, so vLLM's memory profiling counts it before it sizes the KV
    cache; rows = ``dep.indexer_rows`` (none but the scratch row when no request can turn
    sparse). On CUDA, first fail with the flags to change when it would take more than half of the
    GPU memory vLLM may still use (``capacity.check_indexer_reservation``)."""
    global indexer_state
    if indexer_state is not None:
        return
    cfg, lim = dep.cfg, dep.limits
    ix = indexers.get(cfg.indexer)
    rows, set_by, row_bytes = dep.indexer_rows, dep.indexer_rows_set_by, dep.indexer_row_bytes
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if dev != "cpu":
        free, total = torch.cuda.mem_get_info(dev)
        budget = capacity.reservation_budget_bytes(free, total, gpu_memory_utilization,
                                                   torch.cuda.memory_reserved(dev))
        capacity.check_indexer_reservation(rows, row_bytes, budget, lim.max_model_len,
                                           cfg.page_size, set_by, ix.state_name)
    logger.info("hisparse: %s reserve %.2f GiB on %s (%s=%d + 1 scratch row x %.1f MiB: %d pages "
                "x %d sparse layers)", ix.state_name, (rows + 1) * row_bytes / (1 << 30), dev,
                set_by, rows, row_bytes / (1 << 20), dep.pages_per_request,
                lim.num_layers - len(dep.dense_layer_ids))
    indexer_state = ix.allocate_state(cfg, lim.num_layers, rows, lim.max_model_len,
                                      lim.num_kv_heads, lim.head_dim, dtype, dev)


def get_runtime() -> SparseRuntime:
    if runtime is None:
        raise RuntimeError("hisparse: the attention backend runs without its KV connector; start "
                           "vLLM with --attention-backend hisparse so the plugin configures both")
    return runtime


def bind_request(req_id: str, first_block: int) -> None:
    old = _req_to_block.pop(req_id, None)
    if old is not None and _block_to_req.get(old) == req_id:
        del _block_to_req[old]
    _req_to_block[req_id] = first_block
    _block_to_req[first_block] = req_id


def unbind_request(req_id: str) -> None:
    old = _req_to_block.pop(req_id, None)
    if old is not None and _block_to_req.get(old) == req_id:
        del _block_to_req[old]


def req_ids_of(first_blocks: list[int]) -> list[str] | None:
    """Request ids of the batch rows; None for a dummy batch (profiling, warm-up, graph capture)
    in which no row belongs to a live request."""
    ids = [_block_to_req.get(b) for b in first_blocks]
    if all(i is None for i in ids):
        return None
    if any(i is None for i in ids):
        bad = [b for b, i in zip(first_blocks, ids) if i is None]
        raise RuntimeError(f"hisparse: batch rows with first blocks {bad} have no request")
    return ids


pending_full = None     # backend.HiSparseMetadata of this step awaiting plan_full, if any


def resolve_full(md) -> None:
    """Run plan_full for a uniform decode step the builder marked: from the connector's
    start_load_kv, after this step's requests are bound and before vLLM replays its FULL graph; or
    from the first layer of a run without it. A batch whose rows belong to no live request (vLLM's
    dummy runs) becomes all padding."""
    global pending_full
    if md is None or not md.pending:
        return
    md.pending = False
    if pending_full is md:
        pending_full = None
    rt = get_runtime()
    n = md.full_rows
    ids = req_ids_of(md.first_blocks[:n]) if n else None
    if ids is None:
        rt.plan_full([], [], md.full)
    else:
        rt.plan_full(ids, md.seq_lens[:n], md.full, md.block_table)


dense_pool = None       # core.host_pool.HostKVPool on the GPU: dense layers of sparse requests


def ensure_dense_pool(cfg, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      max_num_seqs: int, max_model_len: int,
                      gpu_memory_utilization: float | None = None) -> None:
    """``reserve_dense_pool`` for an engine of these limits (the layer count is not known here:
    enough layers to hold every dense layer)."""
    layers = max(cfg.dense_layers, default=0) + 1
    reserve_dense_pool(resolve(cfg, EngineLimits(layers, max_model_len, max_num_seqs,
                                                 num_kv_heads, head_dim, dtype.itemsize)),
                       dtype, gpu_memory_utilization)


def reserve_dense_pool(dep: Deployment, dtype: torch.dtype,
                       gpu_memory_utilization: float | None = None) -> None:
    """Allocate the GPU pool of the dense layers (``dep.dense_pool_pages``: dense_pool_gib, at
    most what the indexer rows' sparse requests can fill) while the model is being built, like
    the indexer state, so vLLM's memory profiling counts it before sizing the KV cache. On CUDA,
    first refuse a pool larger than half of the GPU memory vLLM may still use."""
    global dense_pool
    cfg, lim = dep.cfg, dep.limits
    if dense_pool is not None or not cfg.uses_dense_pool:
        return
    from vllm_hisparse.core.host_pool import HostKVPool

    pages, nbytes = dep.dense_pool_pages, dep.dense_pool_bytes
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if dev != "cpu":
        free, total = torch.cuda.mem_get_info(dev)
        budget = capacity.reservation_budget_bytes(free, total, gpu_memory_utilization,
                                                   torch.cuda.memory_reserved(dev))
        if nbytes > budget:
            raise ValueError(
                f"hisparse: dense_pool_gib={cfg.dense_pool_gib} is more than the "
                f"{budget / (1 << 30):.2f} GiB allowed (half of the GPU memory vLLM may still use); "
                f"lower dense_pool_gib (each request of N tokens takes "
                f"{len(cfg.dense_layers)} dense layers x N tokens of K/V there)")
    logger.info("hisparse: the dense pool reserves %.2f GiB on %s (%d pages x %d dense layers)",
                nbytes / (1 << 30), dev, pages, len(cfg.dense_layers))
    dense_pool = HostKVPool(len(cfg.dense_layers), pages, cfg.page_size, lim.num_kv_heads,
                            lim.head_dim, dtype, device=dev)
