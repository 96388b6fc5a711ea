"""HiSparseSpec and HiSparseManager: the bounded KV-cache spec of hisparse layers (scheduler side).

A request's GPU blocks are its logical pages. During the prompt's prefill all of them are held
(dense prefill reads them); afterwards the manager gives back pages ``[S, processed // page)``
(``core.residency.freed_pages``: complete pages, already written through to the host pool) and
keeps blocks ``[0, S)`` as the hot slots plus the newest page, so the scheduler sees the rest as
free. The worker must never read a freed block; it uses the same rule to know which ones.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.gpu_pools import sparse_possible
from vllm_hisparse.core.residency import freed_pages

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


class HiSparseManager(FullAttentionManager):
    def __init__(self, kv_cache_spec: HiSparseSpec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.hs_cfg = kv_cache_spec.cfg

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return
        lo, hi = freed_pages(self.hs_cfg, processed_computed_tokens, num_prompt_tokens)
        if hi > lo:
            # Walks [lo, hi) backwards and stops at the first block freed by an earlier step.
            self._remove_blocks_in_range(request_id, lo, hi)
