"""When a request is sparse, and which of its GPU blocks may be given back: the one rule shared by
the scheduler-side KV manager and connector (which free blocks and reserve pools) and the
worker-side runtime (which must then never read a freed block).

A **length rule**, decided by the request alone, never by load: a request is sparse at every step
whose context (keys including the step's new tokens) has reached ``min_context``
(cfg.min_context_tokens). A prompt of at least ``min_context`` tokens is sparse from its first
token (its prefill writes its KV through to the host pool); a shorter one runs resident and dense
until the step whose context reaches ``min_context`` — the *switch* — and sparse from then on
(core/turn_sparse.py copies the KV it already has to the host pool and the indexer state at that
step). Resident mode (``host_tier`` false) switches at the same step, so outputs stay identical.

A request's GPU blocks are its logical pages 0, 1, ... (one block = one page of ``page_size``
tokens). Once its prompt is processed *and* its context has reached ``min_context``, pages
``[S, processed // page_size)`` are complete, written through to the host pool, and freed; pages
``[0, S)`` are kept and reused as the S hot slots; the newest (partial) page stays where vLLM
writes the next token. Nothing is freed before the switch step has run (its start is below
``min_context``), so the switch reads every page it copies from the GPU.

With ``resident_first`` a sparse request keeps every block (state *resident*) until the KV pool
needs blocks; then it gives back only as many as are needed, oldest page first, and keeps a
window of its ``keep`` newest complete pages on the GPU beside its floor (state *partial*; keep 0
is the floor, today's *spilled*), docs/vllm-integration.md, "Residency states". ``keep`` only ever
shrinks, and the window slides with the request (a new complete page pushes its oldest one out),
so a request never holds more blocks after its first spill than before it. ``freed_pages(...,
keep=None)`` is empty (resident); ``spill_order`` picks whom to take blocks from.

Admission (vllm/connector_scheduler.py) reserves host pages and an indexer row for every request
that *may* turn sparse: ``may_turn_sparse`` (prompt + max_tokens reaches ``min_context``). When
the host pool has no room for it (config ``hostless``, default "sparse"), the request runs
*host-less* if vLLM's GPU blocks can hold its whole life (``hostless_fits``) and an indexer row is
free: sparse by the length rule above, exactly as resident mode (its indexer row selects, its
pages are read from its own GPU blocks: keep stays None), but with no host page (its host
page-table entries are -1, so every write-through skips it) and never spilled (it has no host
copy to fall back on). When host room frees it moves into the host tier (core/hostless.py: its KV
so far copied to newly reserved host pages) and is an ordinary host-backed request from then on.
No free indexer row: it waits. ``hostless`` "dense" (opt-in, changes outputs) runs it without a
row instead, dense like a request that never could be sparse (stock vLLM's outputs), until its
move turns it sparse at that step; "wait" makes it wait for the host pool.
"""
from __future__ import annotations

from vllm_hisparse.config import HiSparseConfig


def is_sparse_request(cfg: HiSparseConfig, num_prompt_tokens: int) -> bool:
    """Sparse from its first token: the prompt alone reaches ``min_context``."""
    return num_prompt_tokens >= cfg.min_context_tokens


def is_sparse_at(cfg: HiSparseConfig, num_prompt_tokens: int, context_tokens: int) -> bool:
    """Whether a step that brings the request's context to ``context_tokens`` (keys including the
    step's new tokens) runs it sparse. Monotone in context_tokens."""
    return (is_sparse_request(cfg, num_prompt_tokens)
            or context_tokens >= cfg.min_context_tokens)


def may_turn_sparse(cfg: HiSparseConfig, num_prompt_tokens: int, max_tokens: int) -> bool:
    """Admission: the request can be sparse at some step of its life, so it needs an indexer row and
    (with the host tier) host pages. Its context never exceeds prompt + max_tokens - 1 computed
    tokens; ``>=`` keeps one token of slack (a reservation that goes unused costs pages, a missing
    one would stop the worker)."""
    return num_prompt_tokens + max_tokens >= cfg.min_context_tokens


def freed_pages(cfg: HiSparseConfig, processed_tokens: int, num_prompt_tokens: int,
                keep: int | None = 0) -> tuple[int, int]:
    """Logical pages [lo, hi) whose GPU blocks are released once ``processed_tokens`` tokens are
    computed (empty when hi <= lo). keep: complete pages beyond the floor the request still holds,
    counted back from its newest complete page (None: all of them, *resident*; 0: none, the
    floor). Monotone in processed_tokens and, for a fixed processed_tokens, in -keep; empty in
    resident mode, during the prompt's prefill and until the context has reached ``min_context``
    (so also at the switch step, whose start is below it), and while keep is None."""
    s = cfg.num_slots
    if (not cfg.host_tier or keep is None
            or processed_tokens < max(num_prompt_tokens, cfg.min_context_tokens)):
        return s, s
    return s, max(s, processed_tokens // cfg.page_size - keep)


def resident_pages(cfg: HiSparseConfig, processed_tokens: int, num_prompt_tokens: int,
                   keep: int | None) -> int:
    """Complete pages beyond the floor that stay on the GPU through the block table (what a
    request can give back): pages [max(S, freed hi), processed // page)."""
    hi = processed_tokens // cfg.page_size
    return max(0, hi - freed_pages(cfg, processed_tokens, num_prompt_tokens, keep)[1])


def residency_summary(cfg: HiSparseConfig, reqs: dict[str, tuple[int, int, int | None]]) -> dict:
    """Worker stats of the live sparse requests ``reqs``: id -> (processed tokens at its last
    step, prompt, keep): how many are *resident* (keep None), *partial* (a window of newest pages
    beyond the floor) or at the *floor*, and ``resident_pages``: id -> complete pages beyond the
    floor each holds in the block table (what resident_first uses above the floor)."""
    pages = {rid: resident_pages(cfg, *r) for rid, r in reqs.items()}
    return {"resident_requests": sum(r[2] is None for r in reqs.values()),
            "partial_requests": sum(r[2] is not None and pages[i] > 0 for i, r in reqs.items()),
            "floor_requests": sum(r[2] is not None and pages[i] == 0 for i, r in reqs.items()),
            "resident_pages": pages}


def spill_order(surplus: dict[str, int], free_blocks: int, reserve: int) -> list[str]:
    """Requests to take blocks from so that ``free_blocks`` reaches ``reserve``: the one with the
    most surplus blocks (held beyond its hot-buffer floor) first, ties by id, stopping as soon as
    their surplus covers the shortfall (all of them if it never does). Requests with no surplus
    are never picked (spilling them frees nothing). The manager takes only the shortfall from the
    first and re-counts, so repeated small shortfalls level the largest requests down in turn."""
    need = reserve - free_blocks
    out = []
    for rid, n in sorted(surplus.items(), key=lambda kv: (-kv[1], kv[0])):
        if need <= 0 or n <= 0:
            break
        out.append(rid)
        need -= n
    return out


def hostless_room(gpu_blocks: int, reserve: int, host_backed: int, floor_blocks: int,
                  promised: int = 0) -> int:
    """GPU blocks left for the whole lives of host-less requests (those the host pool cannot
    take): vLLM's usable blocks ``gpu_blocks`` (its null block excluded) less ``reserve`` (one
    step's allocations + vLLM's watermark, the spill reserve R), ``host_backed`` requests at their
    floor of ``floor_blocks`` each (S hot blocks + the newest page: everything above it can be
    spilled) and ``promised``, the whole lives of the host-less requests admitted before (nothing
    is ever taken from them). Requests that never could be sparse are vLLM's own, as in stock
    vLLM (its preemption handles their pressure). May be negative."""
    return gpu_blocks - reserve - host_backed * floor_blocks - promised


def hostless_fits(gpu_blocks: int, reserve: int, promised: int, host_backed: int,
                  floor_blocks: int, need: int) -> bool:
    """Admission of a host-less request: True when its whole life, ``need`` blocks (prompt +
    max_tokens), fits ``hostless_room`` (arguments there)."""
    return need <= hostless_room(gpu_blocks, reserve, host_backed, floor_blocks, promised)
