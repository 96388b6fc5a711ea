"""Memory per request of an MLA model with a DSA indexer (DeepSeek-V3.2, GLM-5.x), stock
FLASH_ATTN_MLA_SPARSE vs HiSparse as docs/dsa.md designs it (the served DSA path follows it with a
bf16 latent; ``hisparse calc`` prints these formulas).

Per token per layer (``ops/sparse_mla.py``, ``ops/dsa_indexer.py``):

* latent row: ``kv_lora_rank + qk_rope_head_dim`` = 576 values = **1152 B** in bf16; with
  ``--kv-cache-dtype fp8_ds_mla`` (FLASHMLA_SPARSE's "FP8 with scale" row) ``kv_lora_rank`` fp8
  values + one fp32 scale per 128 + the rope part in bf16 = 512 + 16 + 128 = **656 B** (modelled
  for both tiers; hisparse does not serve fp8_ds_mla yet: issue 46);
* indexer K: ``index_head_dim`` fp8 + one fp32 scale per 128 = **132 B**.

Stock vLLM 0.26 keeps both for every token in **one** KV-cache group (one block table, block 64):
a block of all layers is ``L x 64 x (1152 + 132)`` B (``UniformTypeKVCacheSpecs.page_size_bytes``),
``num_blocks = kv_bytes // that`` and a request of n tokens holds ``cdiv(n, 64)`` blocks.

HiSparse (docs/dsa.md): the indexer K stays in vLLM's blocks (every token, every layer: the
indexer reads all of it each step), next to a ``STUB_BYTES`` stub per token that keeps the
attention layers in the KV-cache group (so vLLM still builds their metadata); the latent rows live
in a plugin-owned GPU pool allocated before vLLM profiles memory, so vLLM's KV budget shrinks by
it:

* ``rows`` latent-row sets of ``B + newest`` rows per layer (B = device_buffer_size hot slots,
  ``newest``: rows of the newest tokens not yet placed in a slot), one per decoding request that
  may be sparse (the analogue of Quest's rows: admission never lets more in), each with its
  RESOLVE state: per layer the token -> slot table (``max_model_len`` int32) and the slot -> token
  and the policy's state (LRU order or crf value: 2 x S int32), and one token -> host row table
  (``max_model_len`` int32);
* ``prefill_slots`` full-length regions of ``max_model_len`` rows per layer: a request's latent
  stays whole on the GPU during its prefill (its chunks attend top-k anywhere in the prompt);
* the host pool holds every latent row of a sparse request (pages of ``page_size`` tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_hisparse.core.capacity import DTYPE_BYTES, cdiv
from vllm_hisparse.ops import fp8_ds_mla

MLA_BLOCK = 64                     # FLASH_ATTN_MLA_SPARSE's block size (tokens)
STUB_BYTES = 16                    # design choice (docs/dsa.md): the attention layers' shrunk spec,
                                   # 8 bf16 values per token (16-byte aligned), never read


@dataclass(frozen=True)
class MLAShape:
    """What the KV footprint of an MLA + DSA decoder depends on."""
    num_layers: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    dtype_bytes: int = 2
    fp8_ds_mla: bool = False       # the latent in FLASHMLA_SPARSE's 656 B fp8-with-scale rows

    @property
    def latent_bytes(self) -> int:
        """One latent row: one token of one layer."""
        if self.fp8_ds_mla:        # fp8 nope + an fp32 scale per 128 + bf16 rope
            return fp8_ds_mla.row_bytes(self.kv_lora_rank, self.qk_rope_head_dim)
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes

    @property
    def index_bytes(self) -> int:
        """The indexer K of one token of one layer (fp8 values + fp32 scale per 128)."""
        return self.index_head_dim + self.index_head_dim // 128 * 4

    @classmethod
    def from_hf_config(cls, cfg: dict, dtype: str | None = None,
                       kv_cache_dtype: str = "auto") -> "MLAShape":
        """From a HF config dict with ``kv_lora_rank`` (MLA) and ``index_topk`` (DSA);
        ``kv_cache_dtype`` auto (the model dtype) or fp8_ds_mla."""
        if "index_topk" not in cfg:
            raise ValueError("MLA without a DSA indexer (no index_topk in config: DeepSeek-V3 "
                             "style dense MLA) has nothing for hisparse to select with; calc "
                             "covers DSA models (DeepSeek-V3.2 style) and GQA/MHA decoders")
        name = (dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bf16").lower()
        if DTYPE_BYTES.get(name) != 2:
            raise ValueError(f"--dtype {name!r}: FLASH_ATTN_MLA_SPARSE keeps a bf16/fp16 latent; "
                             f"use bf16 or fp16")
        if kv_cache_dtype not in ("auto", "fp8_ds_mla"):
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: an MLA + DSA model's latent is "
                             f"auto (bf16) or fp8_ds_mla (FLASHMLA_SPARSE's 656 B rows)")
        if kv_cache_dtype == "fp8_ds_mla" and cfg["kv_lora_rank"] % 128:
            raise ValueError(f"--kv-cache-dtype fp8_ds_mla: kv_lora_rank {cfg['kv_lora_rank']} is "
                             f"not a multiple of 128 (one fp32 scale per 128 values)")
        return cls(cfg["num_hidden_layers"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"],
                   cfg.get("index_head_dim", 128), cfg["index_topk"], 2,
                   kv_cache_dtype == "fp8_ds_mla")


# ---- stock FLASH_ATTN_MLA_SPARSE ----------------------------------------------------------------
def stock_block_bytes(m: MLAShape) -> int:
    """One block of the single KV-cache group, all layers: latent + indexer K."""
    return m.num_layers * MLA_BLOCK * (m.latent_bytes + m.index_bytes)


def stock_num_blocks(kv_bytes: int, m: MLAShape) -> int:
    return max(kv_bytes // stock_block_bytes(m), 0)


def stock_gpu_bytes(m: MLAShape, context: int) -> int:
    return cdiv(context, MLA_BLOCK) * stock_block_bytes(m)


# ---- hisparse (docs/dsa.md) ---------------------------------------------------------------------
def index_block_bytes(m: MLAShape) -> int:
    """One block of vLLM's KV-cache group under hisparse, all layers: indexer K + the stub."""
    return m.num_layers * MLA_BLOCK * (m.index_bytes + STUB_BYTES)


def hisparse_num_blocks(kv_bytes: int, m: MLAShape) -> int:
    return max(kv_bytes // index_block_bytes(m), 0)


def latent_row_set_bytes(m: MLAShape, buffer: int, newest: int, max_model_len: int) -> int:
    """What one decoding request reserves on the GPU besides vLLM's blocks: (B + newest) latent
    rows of every layer, and the RESOLVE state of its B slots (int32 tables, see above)."""
    S = buffer + newest
    resolve = m.num_layers * (max_model_len + 2 * S) * 4 + max_model_len * 4
    return m.num_layers * S * m.latent_bytes + resolve


def prefill_region_bytes(m: MLAShape, max_model_len: int) -> int:
    """One prefill region: a max_model_len prompt's latent rows, every layer."""
    return m.num_layers * max_model_len * m.latent_bytes


def hisparse_gpu_bytes(m: MLAShape, context: int, buffer: int, newest: int,
                       max_model_len: int) -> int:
    """GPU bytes of one decoding sparse request: its indexer K blocks + its latent row set."""
    return (cdiv(context, MLA_BLOCK) * index_block_bytes(m)
            + latent_row_set_bytes(m, buffer, newest, max_model_len))


def host_page_bytes(m: MLAShape, page_size: int) -> int:
    """One host page: page_size latent rows of every layer."""
    return m.num_layers * page_size * m.latent_bytes


def hisparse_host_bytes(m: MLAShape, context: int, page_size: int) -> int:
    return cdiv(context, page_size) * host_page_bytes(m, page_size)
