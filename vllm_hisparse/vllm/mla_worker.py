"""LatentWorker: the DSA path's one object per worker process (vllm/worker.py says how vLLM's
pieces reach it). It owns the ``LatentRuntime`` (latent pool, host pool, row sets), which the first
MLA attention impl allocates while vLLM builds the model (``start``: its memory profiling then
counts the pool), the indexer class the config names (``indexer``, looked up in the registry of
core/indexers: its ``mla_selection`` gives each layer's top-k, ``select``), the batch rows'
requests (``rows``), vLLM's host block tables (``host_tables``) and the batch the metadata builder
noted (``note``), which the KV connector plans in ``start_load_kv`` (``plan``), before vLLM runs or
replays the step.

A batch row maps to its request through ``block_table[row, 0]`` (request_rows.py, as on the GQA
path): block 0 of a request is never freed while it lives (nothing of vLLM's blocks is).
Every method runs in the worker process.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core import capacity, capacity_mla, indexers
from vllm_hisparse.core.deployment import LatentSizes
from vllm_hisparse.core.latent_runtime import LatentRuntime

from . import topk_swap
from .cli_check import refuse
from .compat import init_logger
from .deployment import deployment_of
from .request_rows import RequestRows

logger = init_logger(__name__)


def pool_bytes(s: LatentSizes, layers: int, max_model_len: int, buffer: int) -> int:
    """GPU bytes the latent pool allocates: capacity_mla's regions and row sets (newest = 0)
    (checked equal to LatentPool.nbytes by tests/test_dsa_adapter.py)."""
    # capacity_mla sizes a latent row by its bytes alone (latent_bytes): one value of row_bytes B
    m = capacity_mla.MLAShape(layers, kv_lora_rank=s.row_bytes, qk_rope_head_dim=0,
                              dtype_bytes=1)
    sets = 0 if s.resident else s.row_sets
    return (s.regions * capacity_mla.prefill_region_bytes(m, max_model_len)
            + sets * capacity_mla.latent_row_set_bytes(m, buffer, 0, max_model_len))


def refuse_over_budget(need: int, budget: int, s: LatentSizes, buffer: int, max_model_len: int,
                       layers: int) -> None:
    """The latent pool (``need`` bytes) against the GPU memory it may take (``budget``): over it,
    one line naming the settings that size it, left for ``vllm serve``'s front end (cli_check:
    printed, exit 2) and raised (HiSparseConfigError), like kv_room's check after the profile."""
    if need > budget:
        refuse(f"hisparse: the latent pool needs {need / (1 << 30):.2f} GiB (regions={s.regions} "
               f"x max_model_len={max_model_len}, row sets={s.row_sets} x device_buffer_size="
               f"{buffer}, {layers} layers), more than the {budget / (1 << 30):.2f} GiB allowed; "
               f"lower prefill_slots, quest_rows or --max-model-len")


class LatentWorker:
    def __init__(self, runtime: LatentRuntime, indexer: type[indexers.Indexer]):
        self.runtime = runtime
        self.indexer = indexer         # a class serving "mla" (its state lives in vLLM's model)
        self.rows = RequestRows()
        self.host_tables: dict = {}    # vllm/host_block_table.py's finds
        self._noted = None             # (query_start_loc, seq_lens, first_blocks) built last

    @classmethod
    def start(cls, vllm_config, row: int, top_k: int, dtype: torch.dtype) -> "LatentWorker":
        """The worker and its LatentRuntime (first MLA layer's impl, while the model is built). On
        CUDA, first refuse a pool larger than half of the GPU memory vLLM may still use, naming
        the settings that size it."""
        dep = deployment_of(vllm_config)
        cfg, s, layers = dep.cfg, dep.latent, dep.limits.num_layers
        k = dep.limits.spec_tokens      # ngram drafts: verify rows of k + 1 tokens (latent_spec)
        ix = indexers.get(cfg.indexer)
        if ix.serves != "mla":      # mla_setup refused it at startup; a worker built without it
            raise ValueError(f"hisparse: indexer={cfg.indexer!r} does not serve MLA models; use "
                             f"one of {', '.join(indexers.serving('mla'))}")
        topk_swap.install_for(ix)   # dsa_stable: vLLM's top-k kernels -> ops/stable_topk.py
        mc, sc = vllm_config.model_config, vllm_config.scheduler_config
        assert s.row_bytes == row * dtype.itemsize, "the deployment's latent row is the impl's"
        need = pool_bytes(s, layers, mc.max_model_len, cfg.device_buffer_size)
        dev = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
               else "cpu")
        if dev != "cpu":
            free, total = torch.cuda.mem_get_info(dev)
            budget = capacity.reservation_budget_bytes(
                free, total, vllm_config.cache_config.gpu_memory_utilization,
                torch.cuda.memory_reserved(dev))
            refuse_over_budget(need, budget, s, cfg.device_buffer_size, mc.max_model_len, layers)
        max_tokens = max(sc.max_num_batched_tokens,
                         getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0)
                         or 0)
        # built while vLLM constructs the model, under its `with torch.device("cuda")`: a tensor
        # made without a device (the host pool's, its page tables) must stay on the CPU
        with torch.device("cpu"):
            rt = LatentRuntime(layers, mc.max_model_len, cfg.device_buffer_size, s.row_sets,
                               s.regions, s.host_rows, max_tokens, sc.max_num_seqs, top_k, row,
                               dtype, dev, policy=cfg.policy,
                               verify_tokens=k + 1 if k else None, lend=s.lend)
        logger.info("hisparse dsa: latent pool %.2f GiB on %s (%d regions x %d rows, %d row sets "
                    "x B=%d, %d layers, policy %s), host pool %.2f GiB (%d rows)%s%s%s",
                    rt.pool.nbytes / (1 << 30), dev, s.regions, mc.max_model_len,
                    0 if s.resident else s.row_sets, cfg.device_buffer_size, layers,
                    cfg.policy, rt.stats()["host_pool_bytes"] / (1 << 30), s.host_rows,
                    " (resident mode)" if s.resident else "",
                    f", verify rows of {k + 1} tokens a request" if k else "",
                    ", regions lent to decoding (resident_first)" if s.lend else "")
        return cls(rt, ix)

    def get_runtime(self) -> LatentRuntime:
        return self.runtime

    def select(self, layer: int, topk_buffer: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """(T, K) int32 logical positions, -1 = none, the step's T = num_tokens query tokens
        attend in ``layer`` (the indexer's ``mla_selection`` over vLLM's topk_indices_buffer)."""
        return self.indexer.mla_selection(topk_buffer, num_tokens, layer)

    def note(self, query_start_loc: list[int], seq_lens: list[int],
             first_blocks: list[int]) -> None:
        """The builder's batch (query_start_loc (B+1,), seq_lens (B,), first_blocks (B,), -1 =
        padding row), planned in the connector's start_load_kv. Until then (and for a batch that
        never reaches it: vLLM's dummy and capture runs) the plan is a no-op."""
        self.runtime.clear()
        self._noted = (query_start_loc, seq_lens, first_blocks)

    def plan(self) -> None:
        """Plan the noted batch (its requests are bound by now): rows without query tokens are
        padding; a batch of no live request stays a no-op."""
        if self._noted is None:
            return
        qsl, seq, first = self._noted
        self._noted = None
        live = [i for i in range(len(seq)) if qsl[i + 1] > qsl[i]]
        ids = self.rows.ids_of([first[i] for i in live]) if live else None
        if ids is None:
            return
        keys: list = [None] * len(seq)
        for i, rid in zip(live, ids):
            keys[i] = rid
        self.runtime.plan(keys, qsl, seq)

    def forget(self) -> None:
        """A batch noted by a run that never reached start_load_kv (connector get_finished)."""
        self._noted = None
