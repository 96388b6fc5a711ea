"""What the DSA latent pool leaves vLLM's own KV cache, and the hisparse settings that would leave
enough (issue 46).

The latent pool (core/latent_pool.py) is allocated while vLLM builds the model, so vLLM's memory
profile counts it as model memory: its "Available KV cache memory" is what is left after the pool,
and vLLM refuses to start when that is <= 0 or below one request of ``max_model_len`` tokens (its
indexer K and the attention layers' stub rows, docs/dsa.md). Each quest_rows (a row set; a
full-length region in resident mode) or prefill slot taken off the pool gives vLLM's cache exactly
its bytes back, as do the bytes a higher gpu_memory_utilization requests: nothing else in the
profile depends on them (activations and CUDA graphs depend on the batch, not on the pool).

A setting *fits* when vLLM's cache then holds as many requests of ``max_model_len`` as the pool
serves at once (the indexer K of every decoding request lives there): fewer would leave row sets
idle. At quest_rows = 1 this is vLLM's own condition (room for one request), so the line says "no
quest_rows value fits" only when vLLM would refuse quest_rows = 1 as well.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30


def size(nbytes: int) -> str:
    """GiB with two decimals, MiB below 0.01 GiB (a small engine's pool is not "0.00 GiB")."""
    return (f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB // 100 else
            f"{nbytes / (1 << 20):.1f} MiB")


@dataclass(frozen=True)
class LatentFit:
    """vLLM's memory profile of one worker and the pool's sizes; bytes unless named.

    available: vLLM's "Available KV cache memory" (negative when the pool took more than all).
    request: vLLM's KV cache of one request of max_model_len tokens, every layer.
    quest_rows: requests the pool serves at once (row sets; regions in resident mode).
    row_bytes: the pool bytes of one of them (a row set, or a full-length region when resident).
    prefill_slots: the host tier's prefill regions (0 in resident mode); slot_bytes: one region.
    total, free: the GPU's memory and what was free when vLLM started; util: its
    gpu_memory_utilization (vLLM requests ceil(total x util) bytes).
    """
    available: int
    request: int
    quest_rows: int
    row_bytes: int
    prefill_slots: int
    slot_bytes: int
    total: int
    free: int
    util: float

    def short(self) -> bool:
        """vLLM refuses these settings (no memory at all, or not one request of max_model_len)."""
        return self.available <= 0 or self.available < self.request

    def room(self, quest_rows: int | None = None, prefill_slots: int | None = None,
             util: float | None = None) -> int:
        """vLLM's KV-cache bytes with some settings changed (None: as now)."""
        q = self.quest_rows if quest_rows is None else quest_rows
        p = self.prefill_slots if prefill_slots is None else prefill_slots
        u = self.util if util is None else util
        return (self.available + (self.quest_rows - q) * self.row_bytes
                + (self.prefill_slots - p) * self.slot_bytes
                + math.ceil(self.total * u) - math.ceil(self.total * self.util))

    def fits(self, quest_rows: int | None = None, prefill_slots: int | None = None,
             util: float | None = None) -> bool:
        """vLLM's cache holds a request of max_model_len for each request the pool serves."""
        q = self.quest_rows if quest_rows is None else quest_rows
        room = self.room(quest_rows, prefill_slots, util)
        return room > 0 and room >= max(q, 1) * self.request

    def fitting_quest_rows(self) -> int | None:
        """The largest quest_rows below the current one that fits (None: none does)."""
        return next((q for q in range(self.quest_rows - 1, 0, -1) if self.fits(quest_rows=q)),
                    None)

    def fitting_prefill_slots(self) -> int | None:
        """The largest prefill_slots below the current one that fits, quest_rows as now."""
        return next((p for p in range(self.prefill_slots - 1, 0, -1)
                     if self.fits(prefill_slots=p)), None)

    def needed_util(self) -> float | None:
        """The least gpu_memory_utilization (two decimals, at most 1) at which the current settings
        fit (None: not even 1 does)."""
        u = math.ceil(self.util * 100) / 100
        while u <= 1 and not self.fits(util=u):
            u = round(u + 0.01, 2)
        return u if u <= 1 else None

    def util_possible(self, u: float) -> bool:
        """vLLM starts at ``u`` only if that much of the GPU is free (its request_memory check)."""
        return math.ceil(self.total * u) <= self.free


def message(fit: LatentFit, pool: str, layers: int, max_model_len: int) -> str:
    """The one line that names what to change (``pool``: how the pool is made, for the reader,
    e.g. "2 prefill regions of 33,808 rows + 44 row sets of B=4096")."""
    pool_bytes = fit.quest_rows * fit.row_bytes + fit.prefill_slots * fit.slot_bytes
    head = (f"hisparse: the DSA latent pool ({size(pool_bytes)}: {pool}, {layers} layers) leaves "
            f"vLLM {size(fit.available)} for its KV cache at gpu_memory_utilization={fit.util:g} "
            f"(it needs {size(fit.request)} for each of the pool's {fit.quest_rows} requests of "
            f"{max_model_len:,} tokens)")
    q, p, u = fit.fitting_quest_rows(), fit.fitting_prefill_slots(), fit.needed_util()
    if fit.prefill_slots:              # host tier: row sets of B rows, prefill regions
        others = ([f"prefill_slots to {p}" if p else "prefill_slots"]
                  if fit.prefill_slots > 1 else []) + ["device_buffer_size"]
    else:                              # resident: a region of max_model_len rows per request
        others = ["--max-model-len"]
    fix = (f"lower quest_rows to {q} (or {' / '.join(others)})" if q else
           f"no quest_rows value fits: lower {' or '.join(others)}")
    if u is not None and fit.util_possible(u):
        fix += f", or raise gpu_memory_utilization to {u:g}"
    elif u is not None:
        fix += (f", or free GPU memory (gpu_memory_utilization={u:g} would fit; only "
                f"{fit.free / fit.total:.2f} of the GPU was free)")
    return f"{head}; {fix}"
