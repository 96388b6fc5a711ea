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
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.deployment import Deployment, EngineLimits, resolve

ATTR = "_hisparse_deployment"      # the attribute of the VllmConfig that holds it


@dataclass(frozen=True)
class _Held:
    key: str                      # the hisparse settings it was parsed from, as JSON
    cfg: HiSparseConfig
    deployment: Deployment | None


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
    per VllmConfig object."""
    return _held(vllm_config).cfg


def deployment_of(vllm_config) -> Deployment:
    """The config resolved for this engine (``core.deployment.resolve``), once per VllmConfig."""
    held = _held(vllm_config)
    limits = limits_of(vllm_config)
    if held.deployment is not None and held.deployment.limits == limits:
        return held.deployment
    if limits is None:
        raise ValueError("hisparse: the engine's config has no model config to size the pools by")
    dep = resolve(held.cfg, limits)
    setattr(vllm_config, ATTR, _Held(held.key, held.cfg, dep))
    return dep


def limits_of(vllm_config) -> EngineLimits | None:
    """The model's shape and vLLM's limits for one tensor-parallel rank (None without a model
    config). Scheduler and parallel settings a partial config lacks count as their defaults."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None
    pc = getattr(vllm_config, "parallel_config", None)
    sc = getattr(vllm_config, "scheduler_config", None)
    hf = getattr(mc, "hf_config", None)
    latent = getattr(hf, "kv_lora_rank", None)
    kw = {}
    if latent:                     # MLA: one latent row per token (kv_lora_rank + rope dims)
        kw["latent_row"] = latent + hf.qk_rope_head_dim
    else:
        kw["num_kv_heads"], kw["head_dim"] = mc.get_num_kv_heads(pc), mc.get_head_size()
    return EngineLimits(num_layers=mc.get_num_layers(pc), max_model_len=mc.max_model_len,
                        max_num_seqs=getattr(sc, "max_num_seqs", 0) or 0,
                        dtype_bytes=mc.dtype.itemsize,
                        tensor_parallel_size=getattr(pc, "tensor_parallel_size", 1) or 1, **kw)
