"""Which GPU blocks of a request may be given back: the one rule shared by the scheduler-side
KV manager (which frees them) and the worker-side runtime (which must then never read them).

A request's GPU blocks are its logical pages 0, 1, ... (one block = one page of ``page_size``
tokens). After its prompt has been processed, pages ``[S, processed // page_size)`` are complete,
written through to the host pool, and freed; pages ``[0, S)`` are kept and reused as the S hot
slots; the newest (partial) page stays where vLLM writes the next token.
"""
from __future__ import annotations

from vllm_hisparse.config import HiSparseConfig


def is_sparse_request(cfg: HiSparseConfig, num_prompt_tokens: int) -> bool:
    """Requests shorter than ``min_context`` (cfg.min_context_tokens) stay resident and dense for
    their whole life."""
    return num_prompt_tokens >= cfg.min_context_tokens


def freed_pages(cfg: HiSparseConfig, processed_tokens: int, num_prompt_tokens: int) -> tuple[int, int]:
    """Logical pages [lo, hi) whose GPU blocks are released once ``processed_tokens`` tokens are
    computed (empty when hi <= lo). Monotone in processed_tokens; empty in resident mode, during
    the prompt's prefill and for requests below ``min_context``."""
    s = cfg.num_slots
    if (not cfg.host_tier or processed_tokens < num_prompt_tokens
            or not is_sparse_request(cfg, num_prompt_tokens)):
        return s, s
    return s, max(s, processed_tokens // cfg.page_size)
