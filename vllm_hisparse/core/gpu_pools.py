"""How much GPU memory the pools of sparse requests take: the Quest page-bound rows and the dense
pool (the dense layers of sparse requests). The vLLM adapter allocates both while the model is
built, so vLLM's memory profiling takes them out of the KV cache: every byte reserved here is a
byte that short (dense, resident) requests cannot use. So the pools are sized from what the
sparse requests of this engine can hold at once, never from the config alone:

* no request can turn sparse (``max_model_len < min_context``: a context never exceeds
  max_model_len, core/residency.py): no Quest row (the scratch row only) and a dense pool of no
  page: a short-prompt server gets stock's KV cache, whatever the config says;
* otherwise ``quest_rows`` rows (``max_num_seqs`` when 0), and a dense pool of at most what those
  rows can fill: each admitted sparse request holds at most ``cdiv(max_model_len, page_size)``
  pages there (the connector reserves ``min(prompt + max_tokens, max_model_len)`` tokens), and at
  most ``rows`` are admitted at once, so pages beyond ``rows x that`` would never be used.

``core/deployment.resolve`` calls these functions, once per engine; the scheduler (connector
admission), the worker (runtime, allocation) and ``hisparse calc`` read its result, so they agree.
"""
from __future__ import annotations

from vllm_hisparse.config import HiSparseConfig


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sparse_possible(cfg: HiSparseConfig, max_model_len: int) -> bool:
    """Some request of this engine can be sparse at some step: its context (at most
    max_model_len tokens) can reach min_context."""
    return max_model_len >= cfg.min_context_tokens


def quest_rows(cfg: HiSparseConfig, max_num_seqs: int, max_model_len: int) -> int:
    """Quest page-bound rows on the GPU, besides the scratch row: one per sparse request admitted
    at once. cfg.quest_rows, else max_num_seqs; 0 when no request can turn sparse."""
    if not sparse_possible(cfg, max_model_len):
        return 0
    return cfg.quest_rows or max_num_seqs


def dense_pool_pages(cfg: HiSparseConfig, page_bytes: int, max_num_seqs: int,
                     max_model_len: int) -> int | None:
    """Pages (one page of each dense layer) of the GPU dense pool; None without one
    (cfg.uses_dense_pool). page_bytes: one page of one layer (K and V). At most dense_pool_gib
    holds, and at most what the Quest rows' sparse requests can fill at once (0 when none can be
    sparse)."""
    configured = cfg.dense_pool_pages(page_bytes)
    if configured is None:
        return None
    rows = quest_rows(cfg, max_num_seqs, max_model_len)
    return min(configured, rows * _cdiv(max_model_len, cfg.page_size))


def dense_pool_bytes(cfg: HiSparseConfig, page_bytes: int, max_num_seqs: int,
                     max_model_len: int) -> int:
    """GPU bytes the dense pool takes (0 without one)."""
    pages = dense_pool_pages(cfg, page_bytes, max_num_seqs, max_model_len)
    return 0 if pages is None else pages * page_bytes * len(cfg.dense_layers)


def idle_rows_note(rows: int, room: int, max_model_len: int, bound: str,
                   source: str = "quest_rows") -> str | None:
    """Startup advice when the indexer reserves more rows than the ``bound`` pool admits requests
    of max_model_len tokens (each row's GPU memory, Quest page bounds over max_model_len, is taken
    from the KV cache): None when every row can be used at max_model_len. source: where the row
    count came from (quest_rows, or max_num_seqs when quest_rows is unset)."""
    if rows <= room:
        return None
    return (f"hisparse: {rows} Quest rows ({source}) but the {bound} pool holds {room} requests of "
            f"max_model_len={max_model_len} tokens: {rows - room} rows serve only shorter requests; "
            f"for a workload at max_model_len set quest_rows to {room} and their GPU memory goes "
            f"to the KV cache (hisparse calc shows how much)")
