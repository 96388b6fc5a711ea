"""Memory per request, stock full KV vs HiSparse as the engine implements it today: the formulas
behind `hisparse calc`, each one the plain-integer twin of what vLLM 0.26 and the adapter compute
(tests/test_calc_engine.py checks them against a real engine).

Stock vLLM: a request of n tokens holds ``cdiv(n, block)`` blocks in every layer.

HiSparse today (``vllm/spec.py``, ``core/residency.py``, ``vllm/connector.py``, ``vllm/worker_state.py``):

* GPU KV: after its prefill a sparse request keeps ``min(cdiv(n, page), S + 1)`` blocks (S hot
  slots + the newest page) in **every** layer: dense layers share the block table with the sparse
  ones and read given-back pages from the host pool, they are not kept resident.
  ``HiSparseSpec.max_memory_usage_bytes`` reports exactly this, so vLLM's "Maximum concurrency"
  line is ``num_blocks / that``. A request whose context never reaches ``min_context`` (and every
  request in resident mode, ``host_tier: false``) keeps all its pages. During its own prefill a
  request holds all its pages, and a short prompt that turns sparse later (``core/residency.py``)
  holds every page until its context reaches ``min_context`` (``hisparse_peak_blocks``); the
  connector refuses to start unless one ``max_model_len`` prompt fits the blocks.
* Requests at once on the GPU (``gpu_requests``): N - 1 at their floor (S + 1 blocks) while the
  last one admitted holds its peak, plus what admission keeps free: vLLM's watermark (it wants the
  whole prompt free, ``scheduler_reserve_full_isl``) and, with ``resident_first``, the connector's
  +1 (``admission_blocks``; a prefix-cache hit adds the floor's copies there, up to S, which
  these formulas do not count: they assume no hit) and the reserve R the KV manager keeps free
  (``spill_reserve_blocks``).
* Which requests count as sparse: those whose context (prompt + output) reaches ``min_context``,
  whatever their prompt (``residency.may_turn_sparse``, the connector's admission rule).
* Host pool: every page of **every** layer of a sparse request (``L x cdiv(n, page)`` pages of
  ``page x token bytes``); the pool holds ``host_pool_bytes // (L x page bytes)`` pages, reserved
  per request at admission.
* Quest page bounds: key min and max per page of every KV head, in every sparse layer, allocated
  for ``max_num_seqs`` rows x ``cdiv(max_model_len, page)`` pages while the model is built, so
  vLLM's memory profiling takes them out of the KV budget: a fixed reservation, not per live request
  (none but the scratch row when max_model_len < min_context: ``core/gpu_pools.py``, which also
  caps the dense pool at what the Quest rows' requests can fill).
  (The runtime's int32 slot/page indices, ~``4 x (U + 2S)`` bytes per row per sparse layer, are
  left out: <0.2% of the bounds.)

Target design, not implemented yet: dense layers fully resident on the GPU (their own KV group), the
host pool holding only the sparse layers, Quest bounds per live request sized to its length.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from vllm_hisparse.core import indexers

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4,
               "float": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class ModelShape:
    """What the KV footprint of a GQA decoder depends on. dtype_bytes: bytes of one KV value (the
    KV cache's: 1 with an fp8 cache; ``from_hf_config`` gives the model dtype's)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def token_bytes_per_layer(self) -> int:
        """K and V of one token of one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        """One KV block of all layers (vLLM's ``page_size_bytes`` x layers; one host page of all
        layers for hisparse)."""
        return self.num_layers * block_size * self.token_bytes_per_layer

    @classmethod
    def from_hf_config(cls, src: str | os.PathLike | dict, dtype: str | None = None) -> "ModelShape":
        """From a HF config.json (dict, file, or model directory)."""
        cfg = src
        if not isinstance(src, dict):
            path = os.fspath(src)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
        if "kv_lora_rank" in cfg:
            raise ValueError("MLA models (kv_lora_rank in config) have their own shape "
                             "(core/capacity_mla.MLAShape); this one covers GQA/MHA decoders")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        name = (dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bf16").lower()
        if name not in DTYPE_BYTES:
            raise ValueError(f"--dtype {name!r} is not known; use one of {', '.join(sorted(DTYPE_BYTES))}")
        return cls(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim,
                   DTYPE_BYTES[name])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- per request -----------------------------------------------------------------------------
def baseline_blocks(context: int, block_size: int) -> int:
    """Stock paged KV: blocks a request holds in every layer."""
    return cdiv(context, block_size)


def hisparse_blocks(context: int, page_size: int, num_slots: int, sparse: bool = True) -> int:
    """Blocks a request keeps in every layer after its prefill (``HiSparseSpec.max_memory_usage_bytes``
    / page bytes): S hot slots + the newest page; all its pages when it stays resident."""
    full = cdiv(context, page_size)
    return min(full, num_slots + 1) if sparse else full


def hisparse_peak_blocks(prompt: int, context: int, page_size: int, num_slots: int,
                         min_context: int, sparse: bool = True) -> int:
    """Most blocks a request of ``prompt`` + output = ``context`` tokens holds at once: all its pages
    when it is never sparse; else its prompt's during its prefill, or, for a prompt shorter than
    ``min_context``, its pages up to the step its context reaches ``min_context`` (nothing is given
    back before: ``residency.freed_pages``), and ``hisparse_blocks`` afterwards."""
    full = cdiv(context, page_size)
    if not sparse:
        return full
    return max(cdiv(min(context, max(prompt, min_context)), page_size),
               hisparse_blocks(context, page_size, num_slots))


def baseline_gpu_bytes(m: ModelShape, context: int, block_size: int = 16) -> int:
    """Stock paged KV: every layer holds every token (whole blocks)."""
    return baseline_blocks(context, block_size) * m.block_bytes(block_size)


def hisparse_gpu_bytes(m: ModelShape, context: int, page_size: int, num_slots: int,
                       sparse: bool = True) -> int:
    """GPU KV of one request after its prefill, all layers (dense layers included)."""
    return hisparse_blocks(context, page_size, num_slots, sparse) * m.block_bytes(page_size)


def hisparse_host_pages(context: int, page_size: int, sparse: bool = True) -> int:
    """Host pages (each one page of every layer) a sparse request reserves for its whole life."""
    return cdiv(context, page_size) if sparse else 0


def hisparse_host_bytes(m: ModelShape, context: int, page_size: int, sparse: bool = True,
                        layers: int | None = None) -> int:
    """The host pool holds every token of every host layer (all layers, or the sparse ones with a
    dense pool: ``HiSparseConfig.host_pool_layers``) of a sparse request, in whole pages."""
    return hisparse_host_pages(context, page_size, sparse) * _layer_pages(m, page_size, layers)


def _layer_pages(m: ModelShape, page_size: int, layers: int | None) -> int:
    """Bytes of one page across ``layers`` layers (default: all)."""
    return (m.block_bytes(page_size) if layers is None else
            layers * page_size * m.token_bytes_per_layer)


def indexer_row_bytes(indexer: str, m: ModelShape, max_model_len: int, page_size: int,
                      dense_layers: int) -> int:
    """The indexer's state of one runtime row (``Deployment.indexer_row_bytes``;
    ``Indexer.row_bytes``: Quest's key min and max per page of every KV head,
    ``cdiv(max_model_len, page)`` pages, every sparse layer, model dtype: pass ``m`` with the
    model dtype's bytes, not an fp8 cache's)."""
    return indexers.get(indexer).row_bytes(m.num_layers - dense_layers, m.num_kv_heads,
                                           m.head_dim, m.dtype_bytes, max_model_len, page_size)


RESERVATION_SHARE = 0.5   # guess: one reservation (indexer state, dense pool) may take at most half
                          # of what vLLM may still use at startup; the rest is for the weights,
                          # activations and the KV cache


def reservation_budget_bytes(free_bytes: int, total_bytes: int,
                             gpu_memory_utilization: float | None = None,
                             used_bytes: int | None = None) -> int:
    """Most bytes one startup reservation (the indexer state, the dense pool) may take while the
    model is built: ``RESERVATION_SHARE`` of the GPU memory vLLM may still use. That is this
    engine's ``gpu_memory_utilization x total`` less the ``used_bytes`` it already holds, at most
    the free memory (other processes' memory, e.g. engines sharing the GPU, is not this engine's
    to count); without ``used_bytes``, the free memory less the ``(1 - gpu_memory_utilization) x
    total`` that vLLM leaves to others (as if this process used all of ``total - free``)."""
    room = free_bytes
    if gpu_memory_utilization is not None:
        if used_bytes is None:
            room = min(room, free_bytes - int((1 - gpu_memory_utilization) * total_bytes))
        else:
            room = min(room, int(gpu_memory_utilization * total_bytes) - used_bytes)
    return int(max(room, 0) * RESERVATION_SHARE)


def check_indexer_reservation(rows: int, row_bytes: int, budget_bytes: int, max_model_len: int,
                              page_size: int, set_by: str = "max_num_seqs",
                              what: str = "Quest page bounds") -> None:
    """Raise ValueError, naming the settings to change, when ``rows`` indexer rows of ``row_bytes``
    (``indexer_row_bytes``; what: the indexer's ``state_name``), plus the runtime's scratch row, exceed ``budget_bytes``
    (``reservation_budget_bytes``). set_by: where ``rows`` came from ("max_num_seqs" or "quest_rows")."""
    need = (rows + 1) * row_bytes
    if need <= budget_bytes:
        return
    fit = max(budget_bytes // row_bytes - 1, 0) if row_bytes else rows
    fix = (f"set the hisparse config's quest_rows to {fit} (the most within that limit: long "
           f"requests beyond it wait) or lower --max-num-seqs or --max-model-len" if fit else
           "lower --max-model-len (not even one sequence fits)")
    raise ValueError(
        f"hisparse: the {what} for {set_by}={rows} sequences of max_model_len="
        f"{max_model_len} tokens (page_size={page_size}) need {need / (1 << 30):.2f} GiB of GPU "
        f"memory ({row_bytes / (1 << 20):.1f} MiB per sequence), more than the "
        f"{budget_bytes / (1 << 30):.2f} GiB allowed ({RESERVATION_SHARE:.0%} of the GPU memory vLLM may "
        f"still use); {fix}")


# ---- the whole GPU / host pool ----------------------------------------------------------------
def num_blocks(kv_bytes: int, m: ModelShape, block_size: int) -> int:
    """KV blocks vLLM allocates in ``kv_bytes`` (``kv_cache_utils.get_num_blocks``:
    ``available // page_size_bytes // layers``; block 0 of them is vLLM's null block)."""
    return max(kv_bytes // (block_size * m.token_bytes_per_layer) // m.num_layers, 0)


def vllm_max_concurrency(blocks: int, blocks_per_request: int) -> float:
    """vLLM's "Maximum concurrency for max_model_len tokens per request" figure
    (``get_max_concurrency_for_kv_cache_config``: num_blocks / the spec's blocks per request,
    null block included); its "GPU KV cache size: N tokens" line is
    ``int(this * max_model_len)``."""
    return blocks / blocks_per_request


def host_pool_pages(host_bytes: int, m: ModelShape, page_size: int, layers: int | None = None) -> int:
    """Pages (each one page of every host layer) the host pool holds
    (``Deployment.host_pages``)."""
    return host_bytes // _layer_pages(m, page_size, layers)


def host_pool_rank_bytes(host_pool_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Host pool bytes one tensor-parallel rank allocates: ``host_pool_gib`` is the engine's total,
    split evenly over the ranks (each holds its own KV heads of the same page ids, so every rank
    has the same number of pages: ``Deployment.host_pages``)."""
    return host_pool_bytes // tensor_parallel_size


def rank_kv_heads(num_kv_heads: int, tensor_parallel_size: int = 1) -> int:
    """KV heads one tensor-parallel rank holds (vLLM's ``ModelConfig.get_num_kv_heads``: split,
    or replicated when there are fewer heads than ranks)."""
    return max(1, num_kv_heads // tensor_parallel_size)


def hisparse_prefill_fits(blocks: int, max_model_len: int, page_size: int) -> bool:
    """The connector's startup check (``bind_gpu_block_pool``): a ``max_model_len`` prompt, fully
    resident during its prefill (+1 block), fits the blocks other than the null block."""
    return blocks - 1 >= cdiv(max_model_len, page_size) + 1


def watermark_blocks(blocks: int, watermark: float = 0.0) -> int:
    """vLLM's watermark: blocks kept free when a waiting request is admitted
    (``KVCacheManager.watermark_blocks``: ``int(watermark x num_blocks)``)."""
    return int(watermark * blocks)


def spill_reserve_blocks(max_num_batched_tokens: int, max_num_seqs: int, page_size: int,
                         watermark_blocks: int = 0) -> int:
    """R, the free blocks the KV manager keeps with ``resident_first`` (``connector.spill_reserve``):
    one step's allocations of the running requests (its batched tokens plus a partial block per
    request) and vLLM's watermark."""
    return cdiv(max_num_batched_tokens, page_size) + max_num_seqs + watermark_blocks


def gpu_requests(blocks: int, floor_blocks: int, admit_blocks: int, reserve: int = 0) -> int:
    """Requests that run at once in ``blocks`` (null block included): N - 1 of them at their
    ``floor_blocks`` (``hisparse_blocks``) while the last one admitted holds ``admit_blocks`` (its
    peak, ``hisparse_peak_blocks``, plus what admission wants free besides: vLLM's watermark, the
    connector's +1 of ``admission_blocks``) and ``reserve`` blocks stay free (``spill_reserve_blocks``
    with resident_first, else 0): ``1 + (blocks - 1 - admit - reserve) // floor``, 0 when that
    one request does not fit."""
    room = blocks - 1 - admit_blocks - reserve
    return 0 if room < 0 or floor_blocks < 1 else 1 + room // floor_blocks


def peak_together_requests(blocks: int, peak_blocks: int) -> int:
    """Requests that hold their ``peak_blocks`` all at once in ``blocks`` (the null block left
    out): requests sent together whose short prompts grow to min_context in lockstep, before any
    turns sparse; more than this and vLLM preempts on the way (its watermark holds only for
    admitting waiting requests, not for running ones that grow)."""
    return max(0, (blocks - 1) // peak_blocks) if peak_blocks > 0 else 0


def max_requests(limits: dict[str, int | None]) -> tuple[int, str]:
    """(how many requests fit, which limit bounds it) from {"gpu": n, "host": n or None,
    "max_num_seqs": n or None}; None = no such limit; ties go to the first."""
    name = min((k for k, v in limits.items() if v is not None), key=lambda k: limits[k])
    return int(limits[name]), name


def auto_max_num_seqs(gpu_bytes: int, row_bytes: int, fit) -> int:
    """The largest N with N <= fit(gpu_bytes - N x row_bytes, N): as many indexer rows as requests
    that still fit once those rows are reserved (fit: KV bytes, max_num_seqs -> requests, never more
    for fewer bytes or more sequences)."""
    lo, hi = 0, (gpu_bytes // row_bytes + 1) if row_bytes else fit(gpu_bytes, 0) + 1
    while hi - lo > 1:                         # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if mid <= fit(gpu_bytes - mid * row_bytes, mid):
            lo = mid
        else:
            hi = mid
    return lo
