"""The DSA latent pool against vLLM's own KV-cache budget (issue 46), checked in the worker process
right after vLLM's memory profile.

The pool is allocated while vLLM builds the model (mla_worker.LatentWorker.start), so the profile
counts it as model memory. When it leaves vLLM's KV cache (the indexer K and the stub latent pages)
less than one request, vLLM 0.26 stops with "No available memory for the cache blocks. Try
increasing `gpu_memory_utilization`" (or its one-request error), which never names hisparse. The
wrap of ``Worker.determine_available_memory`` that ``install`` makes (patches/README.md) raises
instead, before vLLM's own check (``get_kv_cache_configs`` in the engine core), one line naming
the hisparse fields to lower and values that fit (core/latent_fit.py); cli_check.refuse carries it
to ``vllm serve``'s front end, which prints it and exits 2.

No plugin point sees vLLM's available KV memory: vLLM's connector is built after the KV-cache
config, our KV spec is vLLM's own MLA spec on this path, and the number exists only as the return
value of this method (kept on the worker as ``available_kv_cache_memory_bytes``).
"""
from __future__ import annotations

import functools
from dataclasses import replace

from vllm_hisparse.core.latent_fit import LatentFit, message

from .cli_check import refuse
from .deployment import deployment_of


def fit_of(worker, available: int) -> tuple[LatentFit, str]:
    """The pool's sizes and vLLM's profile of ``worker`` (vLLM's GPU Worker: ``vllm_config``,
    ``init_snapshot``, ``get_kv_cache_spec``), and how the pool is made, in words."""
    from .mla_worker import pool_bytes

    vc = worker.vllm_config
    dep = deployment_of(vc)
    s, layers, mml = dep.latent, dep.limits.num_layers, vc.model_config.max_model_len
    b = dep.cfg.device_buffer_size
    region = pool_bytes(replace(s, regions=1, row_sets=0), layers, mml, b)
    # vLLM's own measure of one request (kv_cache_utils._max_memory_usage_bytes_from_groups: the
    # sum over the layers of the one uniform-type group the DSA layers make)
    request = sum(spec.max_memory_usage_bytes(vc) for spec in worker.get_kv_cache_spec().values())
    snap, util = worker.init_snapshot, vc.cache_config.gpu_memory_utilization
    common = dict(available=available, request=request, total=snap.total_memory,
                  free=snap.free_memory, util=util)
    if s.resident:                    # every request's latent in a full-length region
        return (LatentFit(quest_rows=s.regions, row_bytes=region, prefill_slots=0, slot_bytes=0,
                          **common),
                f"{s.regions} full-length regions of {mml:,} rows, resident mode")
    one_set = pool_bytes(replace(s, regions=0, row_sets=1), layers, mml, b)
    return (LatentFit(quest_rows=s.row_sets, row_bytes=one_set, prefill_slots=s.regions,
                      slot_bytes=region, **common),
            f"{s.regions} prefill regions of {mml:,} rows + {s.row_sets} row sets of B={b}")


def check(worker, available: int) -> None:
    """Raise the one-line error when vLLM would refuse its KV cache because of the pool."""
    vc = worker.vllm_config
    if getattr(vc.cache_config, "kv_cache_memory_bytes", None):   # fixed by the user: no profile
        return
    dep = deployment_of(vc)
    if dep.latent is None:
        return
    fit, pool = fit_of(worker, available)
    if not fit.short():
        return
    refuse(message(fit, pool, dep.limits.num_layers, vc.model_config.max_model_len))


def install(worker_cls=None) -> None:
    """Wrap ``worker_cls.determine_available_memory`` (vLLM's GPU ``Worker`` by default) with
    ``check``; idempotent. The first hisparse MLA impl calls it once its pool is on the GPU
    (mla_impl.py), so only a DSA worker process on CUDA imports and wraps it."""
    if worker_cls is None:
        from .compat import gpu_worker_cls

        worker_cls = gpu_worker_cls()
    orig = worker_cls.determine_available_memory
    if getattr(orig, "_hisparse", False):
        return

    @functools.wraps(orig)
    def determine_available_memory(self):
        available = orig(self)
        check(self, available)
        return available

    determine_available_memory._hisparse = True
    worker_cls.determine_available_memory = determine_available_memory
