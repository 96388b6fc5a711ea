"""Worker-process state of the DSA path, shared by the MLA attention impl (which allocates the
runtime while vLLM builds the model, so its memory profile counts the latent pool), the metadata
builder (which notes each batch) and the KV connector (which applies the scheduler's admission
events and plans the noted batch in ``start_load_kv``, before vLLM runs or replays the step).

A batch row maps to its request through ``block_table[row, 0]`` (worker_state.bind_request, as on
the GQA path): block 0 of a request is never freed while it lives (nothing of vLLM's blocks is).
"""
from __future__ import annotations

import torch

from vllm_hisparse.core import capacity, capacity_mla
from vllm_hisparse.core.deployment import LatentSizes
from vllm_hisparse.core.latent_runtime import LatentRuntime

from . import worker_state
from .compat import init_logger
from .deployment import deployment_of

logger = init_logger(__name__)

runtime: LatentRuntime | None = None
pending = None          # (query_start_loc, seq_lens, first_blocks) of the batch built last


def pool_bytes(s: LatentSizes, layers: int, max_model_len: int, buffer: int) -> int:
    """GPU bytes the latent pool allocates: capacity_mla's regions and row sets (newest = 0)
    (checked equal to LatentPool.nbytes by tests/test_dsa_adapter.py)."""
    # capacity_mla sizes a latent row by its bytes alone (latent_bytes): one value of row_bytes B
    m = capacity_mla.MLAShape(layers, kv_lora_rank=s.row_bytes, qk_rope_head_dim=0,
                              dtype_bytes=1)
    sets = 0 if s.resident else s.row_sets
    return (s.regions * capacity_mla.prefill_region_bytes(m, max_model_len)
            + sets * capacity_mla.latent_row_set_bytes(m, buffer, 0, max_model_len))


def ensure_runtime(vllm_config, row: int, top_k: int, dtype: torch.dtype) -> LatentRuntime:
    """The worker's LatentRuntime, allocated on the first MLA layer's impl (the model is being
    built: vLLM's memory profiling then counts the pool). On CUDA, first refuse a pool larger than
    half of the GPU memory vLLM may still use, naming the settings that size it."""
    global runtime
    if runtime is not None:
        return runtime
    dep = deployment_of(vllm_config)
    cfg, s, layers = dep.cfg, dep.latent, dep.limits.num_layers
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    assert s.row_bytes == row * dtype.itemsize, "the deployment's latent row is the impl's"
    need = pool_bytes(s, layers, mc.max_model_len, cfg.device_buffer_size)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if dev != "cpu":
        free, total = torch.cuda.mem_get_info(dev)
        budget = capacity.reservation_budget_bytes(free, total,
                                                   vllm_config.cache_config.gpu_memory_utilization,
                                                   torch.cuda.memory_reserved(dev))
        if need > budget:
            raise ValueError(
                f"hisparse: the latent pool needs {need / (1 << 30):.2f} GiB (regions="
                f"{s.regions} x max_model_len={mc.max_model_len}, row sets={s.row_sets} x "
                f"device_buffer_size={cfg.device_buffer_size}, {layers} layers), more than "
                f"the {budget / (1 << 30):.2f} GiB allowed; lower prefill_slots, quest_rows or "
                f"--max-model-len")
    max_tokens = max(sc.max_num_batched_tokens,
                     getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0)
    # built while vLLM constructs the model, under its `with torch.device("cuda")`: a tensor made
    # without a device (the host pool's, its page tables) must stay on the CPU, as in the tests
    with torch.device("cpu"):
        runtime = LatentRuntime(layers, mc.max_model_len, cfg.device_buffer_size,
                                s.row_sets, s.regions, s.host_rows, max_tokens,
                                sc.max_num_seqs, top_k, row, dtype, dev, policy=cfg.policy)
    logger.info("hisparse dsa: latent pool %.2f GiB on %s (%d regions x %d rows, %d row sets x "
                "B=%d, %d layers, policy %s), host pool %.2f GiB (%d rows)%s",
                runtime.pool.nbytes / (1 << 30), dev, s.regions, mc.max_model_len,
                0 if s.resident else s.row_sets, cfg.device_buffer_size, layers,
                cfg.policy, runtime.stats()["host_pool_bytes"] / (1 << 30), s.host_rows,
                " (resident mode)" if s.resident else "")
    return runtime


def get_runtime() -> LatentRuntime:
    if runtime is None:
        raise RuntimeError("hisparse: the DSA KV connector runs without the MLA attention backend; "
                           "start vLLM with --attention-backend hisparse so the plugin configures "
                           "both")
    return runtime


def note_batch(query_start_loc: list[int], seq_lens: list[int], first_blocks: list[int]) -> None:
    """The builder's batch, planned in the connector's start_load_kv. Until then (and for a batch
    that never reaches it: vLLM's dummy and capture runs) the plan is a no-op."""
    global pending
    if runtime is not None:
        runtime.clear()
    pending = (query_start_loc, seq_lens, first_blocks)


def plan_pending() -> None:
    """Plan the noted batch (its requests are bound by now): rows without query tokens are
    padding; a batch of no live request stays a no-op."""
    global pending
    if pending is None or runtime is None:
        return
    qsl, seq, first = pending
    pending = None
    live = [i for i in range(len(seq)) if qsl[i + 1] > qsl[i]]
    ids = worker_state.req_ids_of([first[i] for i in live]) if live else None
    if ids is None:
        return
    keys: list = [None] * len(seq)
    for i, rid in zip(live, ids):
        keys[i] = rid
    runtime.plan(keys, qsl, seq)
