"""The deployment of a vLLM config: its hisparse config parsed once and resolved against the model
and vLLM's limits (``core.deployment.resolve``), kept on the VllmConfig object itself.

The plugin first sees the config in the platform's ``check_and_update_config`` (front-end
process, setup_check.prepare_config), which calls ``deployment_of``: the one parse of
``additional_config["hisparse"]`` (a dict, a JSON string or a file path) happens there, and the
result is set as an attribute of that VllmConfig. vLLM pickles the config to its engine core and
workers, the attribute with it, so the scheduler's connector and KV manager, the worker's backend,
runtime and pools all read the same object and nothing parses again (a file given with
``--hisparse-config`` is read once). A config whose hisparse settings changed since (only tests do
that) is parsed again; one whose limits changed (vLLM may re-run the config check) is resolved again
from the parsed config, without a parse.

The machine the auto sizes come from (core/auto_size.py: this host's available RAM, one GPU's KV
budget) is measured once too, with the parse, and travels with it: the engine core re-runs the
config check after its workers pinned their pools, when the RAM left is no longer the RAM the pools
were sized from.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError
from vllm_hisparse.core.auto_size import Machine
from vllm_hisparse.core.capacity import DTYPE_BYTES
from vllm_hisparse.core.deployment import Deployment, EngineLimits, resolve
from vllm_hisparse.ops import fp8_ds_mla

ATTR = "_hisparse_deployment"      # the attribute of the VllmConfig that holds it


@dataclass(frozen=True)
class _Held:
    key: str                      # the hisparse settings it was parsed from, as JSON
    cfg: HiSparseConfig
    deployment: Deployment | None
    machine: Machine | None = None


def _source(vllm_config):
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra.get("hisparse") if isinstance(extra, dict) else None


def _key(src) -> str:
    try:
        return json.dumps(src, sort_keys=True)
    except (TypeError, ValueError):
        return repr(src)          # a HiSparseConfig itself (tests), or what load() will refuse


def _held(vllm_config) -> _Held:
    src = _source(vllm_config)
    key = _key(src)
    held = getattr(vllm_config, ATTR, None)
    if held is None or held.key != key:
        held = _Held(key, HiSparseConfig.load(src), None)      # validated: errors name the field
        setattr(vllm_config, ATTR, held)
    return held


def config_of(vllm_config) -> HiSparseConfig:
    """The HiSparseConfig of ``additional_config["hisparse"]`` (defaults when absent), parsed once
    per VllmConfig object; once resolved, with its auto sizes filled in (``Deployment.cfg``)."""
    held = _held(vllm_config)
    return held.deployment.cfg if held.deployment is not None else held.cfg


def deployment_of(vllm_config) -> Deployment:
    """The config resolved for this engine (``core.deployment.resolve``), once per VllmConfig."""
    held = _held(vllm_config)
    if held.machine is None:
        held = replace(held, machine=machine_of(vllm_config))
        setattr(vllm_config, ATTR, held)
    limits = limits_of(vllm_config, held.machine)
    if held.deployment is not None and held.deployment.limits == limits:
        return held.deployment
    if limits is None:
        raise ValueError("hisparse: the engine's config has no model config to size the pools by")
    dep = resolve(held.cfg, limits)
    setattr(vllm_config, ATTR, replace(held, deployment=dep))
    return dep


def limits_of(vllm_config, machine: Machine | None = None) -> EngineLimits | None:
    """The model's shape and vLLM's limits for one tensor-parallel rank (None without a model
    config). Scheduler and parallel settings a partial config lacks count as their defaults."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None
    pc = getattr(vllm_config, "parallel_config", None)
    sc = getattr(vllm_config, "scheduler_config", None)
    hf = getattr(mc, "hf_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    latent = getattr(hf, "kv_lora_rank", None)
    kw = {}
    if latent:                     # MLA: one latent row per token (kv_lora_rank + rope dims)
        kw["latent_row"] = latent + hf.qk_rope_head_dim
        if getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None) == "fp8_ds_mla":
            kw["latent_row_bytes"] = fp8_ds_mla.row_bytes(latent, hf.qk_rope_head_dim)
    else:
        kw["num_kv_heads"], kw["head_dim"] = mc.get_num_kv_heads(pc), mc.get_head_size()
    return EngineLimits(num_layers=mc.get_num_layers(pc), max_model_len=mc.max_model_len,
                        max_num_seqs=getattr(sc, "max_num_seqs", 0) or 0,
                        dtype_bytes=mc.dtype.itemsize,
                        kv_dtype_bytes=kv_dtype_bytes(vllm_config, mc.dtype.itemsize),
                        tensor_parallel_size=getattr(pc, "tensor_parallel_size", 1) or 1,
                        machine=machine,
                        max_num_batched_tokens=getattr(sc, "max_num_batched_tokens", 0) or 0,
                        watermark=getattr(sc, "watermark", 0.0) or 0.0,
                        spec_tokens=getattr(spec, "num_speculative_tokens", 0) or 0, **kw)


SPEC_METHODS = ("ngram",)    # no draft model: only the target model's layers run hisparse


def ngram_drafts(sc, why: str) -> int:
    """The draft tokens of vLLM's speculative_config ``sc`` (0 without one), refusing in one line
    a method other than ngram (``why``: why a draft model cannot run on this path)."""
    if sc is None:
        return 0
    method = getattr(sc, "method", None)
    if method not in SPEC_METHODS:
        raise HiSparseConfigError(f"hisparse: speculative_config method={method!r} is not "
                                  f"supported{why}; use method \"ngram\" or drop "
                                  f"--speculative-config")
    return getattr(sc, "num_speculative_tokens", None) or 0


def kv_dtype_bytes(vllm_config, model_bytes: int) -> int:
    """Bytes of one KV value: vLLM's ``cache_config.cache_dtype`` ("fp8" / "fp8_e4m3": 1;
    "auto": the model dtype's, ``model_bytes``). A cache dtype hisparse does not serve is refused
    at startup (setup_check.check_kv_cache_dtype) and counts as the model's here."""
    dt = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None) or "auto"
    return DTYPE_BYTES.get(str(dt).lower(), model_bytes)


GPU_OVERHEAD = 3 << 30    # guess: what vLLM's profiling finds besides the weights (activations at
                          # max_num_batched_tokens, the CUDA context, NCCL and graph buffers)


def machine_of(vllm_config) -> Machine:
    """This host's RAM available for the host pools (``host_pool.host_room``: MemAvailable, or a
    container limit less its use) with the ranks pinning here, and one GPU's KV budget: an explicit
    KV cache size (``--kv-cache-memory-bytes``; on the CPU ``VLLM_CPU_KVCACHE_SPACE``) as is, else
    on CUDA an estimate: gpu_memory_utilization x the GPU's memory, less the weights of one rank
    (from the model's shape: ``weight_bytes``) and ``GPU_OVERHEAD``."""
    from vllm_hisparse.core.host_pool import host_memory, host_room

    pc = getattr(vllm_config, "parallel_config", None)
    world = getattr(pc, "world_size", 1) or 1
    ranks = getattr(pc, "local_world_size", world) * max(1, getattr(pc, "data_parallel_size_local",
                                                                    1) or 1)
    kv, fixed, source = _kv_budget(vllm_config)
    return Machine(host_available_bytes=host_room(host_memory()), host_ranks=max(ranks, 1),
                   gpu_kv_bytes=kv, gpu_kv_fixed=fixed, gpu_kv_source=source)


def _kv_budget(vllm_config) -> tuple[int | None, bool, str]:
    cc = getattr(vllm_config, "cache_config", None)
    explicit = getattr(cc, "kv_cache_memory_bytes", None)
    if explicit:
        return int(explicit), True, "kv_cache_memory_bytes"
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device == "cpu" and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30, True, "VLLM_CPU_KVCACHE_SPACE"
    mc = getattr(vllm_config, "model_config", None)
    weights = weight_bytes(mc, getattr(vllm_config, "parallel_config", None))
    if device != "cuda" or weights is None:
        return None, False, ""
    from vllm.platforms import current_platform

    total = current_platform.get_device_total_memory(0)
    kv = int(cc.gpu_memory_utilization * total) - weights - GPU_OVERHEAD
    return max(kv, 0), False, "estimate: utilization x memory - weights - overhead"


def weight_bytes(mc, pc) -> int | None:
    """One tensor-parallel rank's weights, from a Llama/Qwen-style shape (embeddings, attention,
    gated MLP); None when the config lacks those fields (MoE, MLA: no estimate)."""
    hf = getattr(mc, "hf_config", None)
    try:
        H, V, L = hf.hidden_size, hf.vocab_size, hf.num_hidden_layers
        heads, inter = hf.num_attention_heads, hf.intermediate_size
    except AttributeError:
        return None
    if getattr(hf, "num_local_experts", None) or getattr(hf, "kv_lora_rank", None):
        return None
    hd = getattr(hf, "head_dim", None) or H // heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    layer = 2 * H * heads * hd + 2 * H * kv * hd + 3 * H * inter + 2 * H
    embed = V * H * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
    tp = getattr(pc, "tensor_parallel_size", 1) or 1
    return (embed + L * layer + H) * mc.dtype.itemsize // tp
