"""HiSparseWorker: the GQA path's one object per worker process (vllm/worker.py says how vLLM's
pieces reach it). It owns:
  * what is reserved while vLLM builds the model, before its memory profiling sizes the KV cache:
    the indexer's state (Quest: every sparse layer's page bounds) and the GPU pool of the dense
    layers (``reserve_indexer_state``, ``reserve_dense_pool``: the attention impl's __init__);
  * the ``SparseRuntime`` built on them (``start_runtime``: the worker-side connector's __init__);
  * the batch rows' requests (``rows``) and vLLM's host block tables (``host_tables``);
  * a FULL decode graph's step as FlashInfer splits one: ``note`` (the metadata builder marks a
    uniform decode step), ``plan`` once per step (the connector's start_load_kv, after the step's
    requests are bound and before vLLM replays the graph; or the first layer of a run without it),
    ``run`` per layer (the attention impl's forward).
Every method runs in the worker process.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core import capacity, indexers
from vllm_hisparse.core.deployment import Deployment
from vllm_hisparse.core.host_pool import HostPoolPinError
from vllm_hisparse.core.sparse_runtime import SparseRuntime
from vllm_hisparse.sim.recorder_hook import TraceWriter

from .compat import init_logger
from .flash_dense import make_dense_fn
from .request_rows import RequestRows

logger = init_logger(__name__)


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


class HiSparseWorker:
    def __init__(self, dep: Deployment):
        self.dep = dep
        self.indexer_state = None      # Indexer.allocate_state (Quest: per-layer (kmin, kmax))
        self.dense_pool = None         # core.host_pool.HostKVPool on the GPU: dense layers
        self.kv_dtype = None           # the KV tiers' dtype when not the model's (fp8: backend.py)
        self.runtime: SparseRuntime | None = None
        self.rows = RequestRows()
        self.host_tables: dict = {}    # vllm/host_block_table.py's finds
        self._noted = None             # backend.HiSparseMetadata of this step awaiting plan

    # ---- while vLLM builds the model (the attention impl's __init__) --------------------------
    def reserve_indexer_state(self, dtype: torch.dtype,
                              gpu_memory_utilization: float | None = None) -> None:
        """Allocate the indexer's state (core/indexers, ``Indexer.allocate_state``; Quest: every
        sparse layer's page bounds, 2 x rows x cdiv(max_model_len, page) x Hkv x D elements per
        layer), once, so vLLM's memory profiling counts it before it sizes the KV cache; rows =
        ``dep.indexer_rows`` (+ the scratch row). On CUDA,
        first fail with the flags to change when it would take more than half of the GPU memory
        vLLM may still use (``capacity.check_indexer_reservation``)."""
        if self.indexer_state is not None:
            return
        dep = self.dep
        cfg, lim = dep.cfg, dep.limits
        ix = indexers.get(cfg.indexer)
        rows, set_by, row_bytes = dep.indexer_rows, dep.indexer_rows_set_by, dep.indexer_row_bytes
        dev = _device()
        if dev.type != "cpu":
            free, total = torch.cuda.mem_get_info(dev)
            budget = capacity.reservation_budget_bytes(free, total, gpu_memory_utilization,
                                                       torch.cuda.memory_reserved(dev))
            capacity.check_indexer_reservation(rows, row_bytes, budget, lim.max_model_len,
                                               cfg.page_size, set_by, ix.state_name)
        logger.info("hisparse: %s reserve %.2f GiB on %s (%s=%d + 1 scratch row x %.1f MiB: %d "
                    "pages x %d sparse layers)", ix.state_name, (rows + 1) * row_bytes / (1 << 30),
                    "cpu" if dev.type == "cpu" else dev, set_by, rows, row_bytes / (1 << 20),
                    dep.pages_per_request, lim.num_layers - len(dep.dense_layer_ids))
        self.indexer_state = ix.allocate_state(cfg, lim.num_layers, rows, lim.max_model_len,
                                               lim.num_kv_heads, lim.head_dim, dtype,
                                               "cpu" if dev.type == "cpu" else dev)

    def reserve_dense_pool(self, dtype: torch.dtype,
                           gpu_memory_utilization: float | None = None) -> None:
        """Allocate the GPU pool of the dense layers (``dep.dense_pool_pages``: dense_pool_gib, at
        most what the indexer rows' sparse requests can fill), once, like the indexer state. On
        CUDA, first refuse a pool larger than half of the GPU memory vLLM may still use."""
        cfg, lim = self.dep.cfg, self.dep.limits
        if self.dense_pool is not None or not cfg.uses_dense_pool:
            return
        from vllm_hisparse.core.host_pool import HostKVPool

        pages, nbytes = self.dep.dense_pool_pages, self.dep.dense_pool_bytes
        dev = _device()
        if dev.type != "cpu":
            free, total = torch.cuda.mem_get_info(dev)
            budget = capacity.reservation_budget_bytes(free, total, gpu_memory_utilization,
                                                       torch.cuda.memory_reserved(dev))
            if nbytes > budget:
                raise ValueError(
                    f"hisparse: dense_pool_gib={cfg.dense_pool_gib} is more than the "
                    f"{budget / (1 << 30):.2f} GiB allowed (half of the GPU memory vLLM may still "
                    f"use); lower dense_pool_gib (each request of N tokens takes "
                    f"{len(cfg.dense_layers)} dense layers x N tokens of K/V there)")
        where = "cpu" if dev.type == "cpu" else dev
        logger.info("hisparse: the dense pool reserves %.2f GiB on %s (%d pages x %d dense layers)",
                    nbytes / (1 << 30), where, pages, len(cfg.dense_layers))
        self.dense_pool = HostKVPool(len(cfg.dense_layers), pages, cfg.page_size,
                                     lim.num_kv_heads, lim.head_dim, dtype, device=where)

    # ---- once vLLM knows its KV cache (the worker-side connector's __init__) -------------------
    def start_runtime(self, model_config, tensor_parallel_size: int) -> SparseRuntime:
        """The SparseRuntime (host pool + hot-slot state) on what was reserved, with the dense
        FlashAttention paths where vLLM's build has them."""
        dep, cfg, lim, mc = self.dep, self.dep.cfg, self.dep.limits, model_config
        try:
            rt = SparseRuntime(cfg, lim.num_layers, lim.num_kv_heads, lim.head_dim,
                               self.kv_dtype or mc.dtype,
                               _device(), lim.max_num_seqs, lim.max_model_len,
                               host_pages=dep.host_pages, indexer_state=self.indexer_state,
                               dense_pool=self.dense_pool, trace_writer=TraceWriter,
                               deployment=dep)
        except HostPoolPinError as e:      # the pool knows its bytes; name the setting's value
            raise HostPoolPinError(e.nbytes, e.cause, cfg.host_pool_gib, e.pinned,
                                   tensor_parallel_size) from e.__cause__
        fa = make_dense_fn(mc.dtype, mc.get_head_size(), self.kv_dtype)
        if fa is not None:
            rt.dense_fn = fa
        self.runtime = rt
        return rt

    def get_runtime(self) -> SparseRuntime:
        if self.runtime is None:
            raise RuntimeError("hisparse: the attention backend runs without its KV connector; "
                               "start vLLM with --attention-backend hisparse so the plugin "
                               "configures both")
        return self.runtime

    # ---- each step: note (builder), plan (connector), run (each layer) -------------------------
    def note(self, md) -> None:
        """A uniform decode step (``md.full`` rows, maybe padded to a FULL graph's size), planned
        once its requests are bound (metadata builder)."""
        md.pending = True
        self._noted = md

    def plan(self, md=None) -> None:
        """plan_full for the noted step (``md`` None: connector start_load_kv, before vLLM replays
        the FULL graph) or for ``md`` (its first layer, on a run without the connector's call). A
        batch whose rows belong to no live request (vLLM's dummy runs) becomes all padding."""
        md = self._noted if md is None else md
        if md is None or not md.pending:
            return
        md.pending = False
        if self._noted is md:
            self._noted = None
        rt = self.get_runtime()
        n = md.full_rows
        ids = self.rows.ids_of(md.first_blocks[:n]) if n else None
        if ids is None:
            rt.plan_full([], [], md.full)
        else:
            rt.plan_full(ids, md.seq_lens[:n], md.full, md.block_table)

    def plan_capture(self, md) -> None:
        """vLLM's FULL capture of a batch size: an all-padding plan, made outside the capture (the
        plan copies from the host)."""
        md.pending = False
        self._noted = None
        self.get_runtime().plan_full([], [], md.full)

    def forget(self) -> None:
        """A step noted by a run that never reached start_load_kv (a dummy run) must not be
        planned by a later hook (connector get_finished)."""
        self._noted = None

    def run(self, layer: int, md, q, k, v, kv_cache, scale: float, out) -> None:
        """One layer of the step (attention impl's forward). q/out: (T, Hq, D), k/v: (T, Hkv, D),
        T = md.full on a uniform decode step, else md.num_actual_tokens."""
        if md.full:                               # a uniform decode step: the decode batch body
            self.plan(md)
            self.get_runtime().full_layer(layer, md.full, q, k, v, kv_cache, md.block_table,
                                          scale, out)
            return
        if md.plan is None:
            ids = self.rows.ids_of(md.first_blocks)
            if ids is None:                       # dummy batch: nothing to attend to
                return
            md.plan = self.get_runtime().plan(ids, md.query_start_loc, md.seq_lens,
                                              md.block_table, md.slot_mapping)
        self.get_runtime().forward_layer(layer, md.plan, q, k, v, kv_cache, scale, out)
