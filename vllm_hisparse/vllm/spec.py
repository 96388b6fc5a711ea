"""HiSparseSpec and HiSparseManager: the bounded KV-cache spec of hisparse layers (scheduler side).

A request's GPU blocks are its logical pages. During the prompt's prefill all of them are held
(dense prefill reads them); afterwards the manager gives back pages ``[S, processed // page)``
(``core.residency.freed_pages``: complete pages, already written through to the host pool) and
keeps blocks ``[0, S)`` as the hot slots plus the newest page, so the scheduler sees the rest as
free. The worker must never read a freed block; it uses the same rule to know which ones.

With ``resident_first`` a request keeps every block after its prompt (*resident*) until the free
blocks fall below the reserve R at a ``remove_skipped_blocks`` call; then resident requests are
*spilled* (``core.residency.spill_order``), one way, down to the same floor, and their ids go to a
``SpillLedger`` that the scheduler-side connector ships to the worker in the step's metadata
(docs/vllm-integration.md, "Residency states").
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.gpu_pools import sparse_possible
from vllm_hisparse.core.residency import freed_pages, spill_order

from .compat import FullAttentionManager, FullAttentionSpec


@dataclass(frozen=True, kw_only=True)
class HiSparseSpec(FullAttentionSpec):
    hisparse_config: str = "{}"          # HiSparseConfig as JSON (specs must hash and pickle)

    @property
    def cfg(self) -> HiSparseConfig:
        return HiSparseConfig.load(self.hisparse_config)

    @classmethod
    def merge(cls, specs):
        # FullAttentionSpec.merge rebuilds cls(...) from a fixed field list and drops ours.
        merged = super().merge(specs)
        assert len({s.hisparse_config for s in specs}) == 1, "one hisparse config per KV group"
        return replace(merged, hisparse_config=specs[0].hisparse_config)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """Steady-state GPU bytes of one request: S hot blocks + the newest page (hisparse mode);
        the full length in resident mode or when no request can turn sparse (max_model_len below
        min_context). (The prompt's own prefill is still fully resident.)"""
        cfg = self.cfg
        full = super().max_memory_usage_bytes(vllm_config)
        if not cfg.host_tier or not sparse_possible(cfg, vllm_config.model_config.max_model_len):
            return full
        return min(full, (cfg.num_slots + 1) * self.page_size_bytes)


@dataclass
class SpillLedger:
    """The link between the manager and the scheduler-side connector of one block pool
    (resident_first): the connector sets ``reserve`` (bind_gpu_block_pool), the manager appends
    the requests it spills to ``spilled``, the connector takes them into the step's metadata."""
    reserve: int | None = None        # free blocks to keep; None (no connector bound): spill at once
    spilled: list[str] = field(default_factory=list)
    bound: bool = False               # a HiSparseManager uses it (one per pool: one sparse group;
                                      # a flag, not the manager, which holds the pool: weak key)

    def take(self) -> list[str]:
        out, self.spilled = self.spilled, []
        return out


_LEDGERS: "weakref.WeakKeyDictionary[object, SpillLedger]" = weakref.WeakKeyDictionary()


def ledger_of(block_pool) -> SpillLedger:
    """The spill ledger of a vLLM BlockPool (created on first use; lives as long as the pool)."""
    led = _LEDGERS.get(block_pool)
    if led is None:
        led = _LEDGERS[block_pool] = SpillLedger()
    return led


class HiSparseManager(FullAttentionManager):
    def __init__(self, kv_cache_spec: HiSparseSpec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.hs_cfg = kv_cache_spec.cfg
        self._ledger = None
        self._resident: dict[str, tuple[int, int]] = {}    # req -> (processed tokens, prompt)
        self._spilled: set[str] = set()
        if self.hs_cfg.resident_first and self.hs_cfg.host_tier:
            self._ledger = ledger_of(self.block_pool)
            if self._ledger.bound:
                raise ValueError("hisparse: resident_first=true needs all hisparse layers in one "
                                 "KV cache group; use resident_first=false for this model")
            self._ledger.bound = True

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return
        if self._ledger is not None and request_id not in self._spilled:
            self._resident[request_id] = (processed_computed_tokens, num_prompt_tokens)
            self._spill_under_pressure()
            if request_id not in self._spilled:
                return                                # resident: keeps every block
        self._free_beyond_floor(request_id, processed_computed_tokens, num_prompt_tokens)

    def _free_beyond_floor(self, request_id: str, processed: int, num_prompt: int) -> None:
        lo, hi = freed_pages(self.hs_cfg, processed, num_prompt)
        if hi > lo:
            # Walks [lo, hi) backwards and stops at the first block freed by an earlier step.
            self._remove_blocks_in_range(request_id, lo, hi)

    def surplus(self, request_id: str) -> int:
        """Blocks a resident request holds beyond its floor (what spilling it gives back): all of
        [lo, hi), none of which was freed while it was resident (O(1): called per request under
        pressure)."""
        lo, hi = freed_pages(self.hs_cfg, *self._resident[request_id])
        return max(0, min(hi, len(self.req_to_blocks.get(request_id, ()))) - lo)

    def _spill_under_pressure(self) -> None:
        """Spill resident requests, most surplus first, until the pool's free blocks reach the
        reserve (all of them with surplus when no reserve is set). One at a time: a block shared
        through the prefix cache does not come free with one request's spill."""
        reserve = self._ledger.reserve
        while True:
            free = self.block_pool.get_num_free_blocks()
            if reserve is not None and free >= reserve:
                return
            want = reserve if reserve is not None else free + self.block_pool.num_gpu_blocks
            order = spill_order({r: self.surplus(r) for r in self._resident}, free, want)
            if not order:
                return
            rid = order[0]
            self._spilled.add(rid)
            self._ledger.spilled.append(rid)
            self._free_beyond_floor(rid, *self._resident.pop(rid))

    def pop_blocks_for_free(self, request_id: str):         # free() and vLLM's batched frees
        # A preempted request restarts resident here; the worker keeps it spilled (it then reads
        # its hot slots while the blocks are still held: never a block given back).
        self._resident.pop(request_id, None)
        self._spilled.discard(request_id)
        return super().pop_blocks_for_free(request_id)
