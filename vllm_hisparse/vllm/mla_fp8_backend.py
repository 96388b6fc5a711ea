"""The hisparse backend of DSA models with ``--kv-cache-dtype fp8_ds_mla``: vLLM 0.26's
FLASHMLA_SPARSE with the latent in the plugin's pool as 656 B rows (ops/fp8_ds_mla.py; docs/dsa.md
"fp8 latent"). The bf16 twin is vllm/mla_backend.py (FLASH_ATTN_MLA_SPARSE); both forward to the
same ``LatentRuntime`` (plugin.route picks this class for an MLA layer with a sparse indexer and the
fp8_ds_mla cache dtype).

- ``do_kv_cache_update``: the step's [kv_c, k_pe] packed by vLLM's own ``concat_and_cache_mla``
  (the pool's ``packer``, ``VllmPacker``: stock's bytes, into a fixed scratch block), then through
  to the host pool and the regions (``LatentRuntime.write``).
- ``forward_mqa``: the selection converted to pool rows (``LatentRuntime.convert``: region rows of
  tokens whose request holds a region, RESOLVE into the hot slots for the others), then stock's kernels over the pool
  viewed as vLLM's cache, ``(rows / 64, 64, 656)``: decode tokens (and, with fewer than 32 heads a
  rank or with speculative decoding, every token: stock's mixed batch) through FlashMLA's fp8
  decode kernel, prefill tokens as stock does them with >= 32 heads, the request's region
  upconverted to bf16 in the workspace (``cp_gather_and_upconvert_fp8_kv_cache`` over the region's
  blocks) and the bf16 sparse prefill kernel on workspace indices (``workspace_indices``). Same
  kernels, same bytes, same index order as stock: without speculation the outputs equal stock's
  for the same batches (with it, resident mode's: the builder's docstring says why).

Needs ``max_model_len`` and ``device_buffer_size`` multiples of 64 (regions and row sets start on a
block; vllm/mla_setup.py refuses others in one line). Importing this module needs vLLM's CUDA
build only when it runs (the FlashMLA ops); the index helpers are plain torch
(tests/test_dsa_fp8_backend.py).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseBackend,
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
)

from vllm_hisparse.core.capacity_mla import MLA_BLOCK
from vllm_hisparse.ops import fp8_ds_mla

from .mla_impl import LatentBackend, LatentBuilder, LatentImpl


def workspace_indices(idx: torch.Tensor, base: torch.Tensor, req: torch.Tensor,
                      starts: torch.Tensor) -> torch.Tensor:
    """Stock's prefill indices from pool rows: token t of prefill request req[t] >= 0 reads its
    position p = idx[t, j] - base[t] (its region's row minus the region's first row) at workspace
    row starts[req[t]] + p; -1 stays -1; decode tokens (req -1) keep their pool rows.
    idx (T, K) int32, base (T,) int64 (-1: no region), req (T,) int, starts (R,) int32."""
    pre = (req >= 0) & (base >= 0)
    ws = starts.long()[req.long().clamp(min=0)] - base
    out = torch.where(pre[:, None] & (idx >= 0), idx.long() + ws[:, None], idx.long())
    return out.to(idx.dtype)


def region_blocks(bases: torch.Tensor, width: int) -> torch.Tensor:
    """(R, width) int32 block table of R regions starting at pool rows bases (multiples of 64):
    the pool's blocks base / 64 + j."""
    return (bases.long()[:, None] // MLA_BLOCK
            + torch.arange(width, device=bases.device)).to(torch.int32)


class VllmPacker:
    """fp8_ds_mla packing by vLLM's ``concat_and_cache_mla`` (stock's bytes): the step's T <=
    max_tokens rows into a fixed scratch cache, slots 0..T-1 (fixed addresses: CUDA graphs)."""

    def __init__(self, max_tokens: int, device):
        blocks = -(-max_tokens // MLA_BLOCK)
        self.cache = torch.zeros(blocks, MLA_BLOCK, fp8_ds_mla.ROW_BYTES, dtype=torch.uint8,
                                 device=device)
        self.slots = torch.arange(blocks * MLA_BLOCK, dtype=torch.int64, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)   # unused by ds_mla

    def __call__(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        T = kv_c.shape[0]
        ops.concat_and_cache_mla(kv_c, k_pe, self.cache, self.slots[:T], "fp8_ds_mla", self.scale)
        return self.cache.view(-1, fp8_ds_mla.ROW_BYTES)[:T]


class HiSparseFlashMLASparseBackend(LatentBackend, FlashMLASparseBackend):
    @staticmethod
    def get_impl_cls():
        return HiSparseFlashMLASparseImpl

    @staticmethod
    def get_builder_cls():
        return HiSparseFlashMLASparseMetadataBuilder


class HiSparseFlashMLASparseMetadataBuilder(LatentBuilder, FlashMLASparseMetadataBuilder):
    """The stock builder, noting the batch for the connector's plan (``LatentBuilder``) and, per
    prefill chunk of the fp8 path, its requests' first tokens (``hisparse_first``: their
    regions' rows are found from the plan in forward_mqa).

    With speculative decoding every token goes through the fp8 kernel (stock's mixed batch, which
    stock itself takes below 32 heads a rank): the builder requires decodes of equal length and
    calls every request after the first one of another length a prefill (vLLM's
    ``split_decodes_and_prefills``), and ngram proposes 0..k drafts a request, so sparse requests
    decoding (no region: their rows are in the hot slots) would land on the prefill path, which
    upconverts a region. Outputs then equal resident mode's (the same path) but not stock's
    separate prefill kernel's."""

    def noted(self, md, cm, qsl: list[int]) -> None:
        if (self.use_fp8_kv_cache and not md.fp8_use_mixed_batch
                and self.worker.runtime.verify_tokens is not None):
            md.fp8_use_mixed_batch = True
            md.fp8_extra_metadata = self._build_fp8_mixed_decode_prefill(cm)
            return
        pre = getattr(md.fp8_extra_metadata, "prefill", None)
        for ch in (pre.chunks if pre is not None else ()):
            a = md.num_decodes + ch.req_start_idx
            first = qsl[a:a + ch.block_table.shape[0]]
            ch.hisparse_first = torch.tensor(first, dtype=torch.int64, device=self.device)


class HiSparseFlashMLASparseImpl(LatentImpl, FlashMLASparseImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rt = self._start_hisparse(fp8_ds_mla.ROW_BYTES, torch.uint8).runtime
        if rt.pool.device.type == "cuda" and not isinstance(rt.pool.packer, VllmPacker):
            rt.use_packer(VllmPacker(rt.graph.T, rt.pool.device))

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata: FlashMLASparseMetadata, layer):
        from vllm import _custom_ops as ops

        if isinstance(q, tuple):
            ql_nope, q_pe = q
            q = self.q_concat_buffer[:ql_nope.shape[0]]
            ops.concat_mla_q(ql_nope, q_pe, q)
        T = q.shape[0]
        rt = self.hisparse_worker.runtime
        li = self._layer_index()
        topk = self.hisparse_worker.select(li, self.topk_indices_buffer, T)
        idx, valid = rt.convert(li, topk)
        cache = rt.pool.rows[li].view(-1, MLA_BLOCK, fp8_ds_mla.ROW_BYTES)
        md = attn_metadata.fp8_extra_metadata
        if attn_metadata.fp8_use_mixed_batch:                 # every token: the fp8 kernel
            out, _ = self._fp8_flash_mla_kernel(q=q.unsqueeze(0), kv_c_and_k_pe_cache=cache,
                                                topk_indices=idx.unsqueeze(0), kernel_metadata=md)
            return out.squeeze(0), None
        nd = md.num_decode_tokens
        out = None
        if nd:
            qd = q[:nd].view(md.num_decodes, -1, *q.shape[1:])
            o, _ = self._fp8_flash_mla_kernel(
                q=qd, kv_c_and_k_pe_cache=cache,
                topk_indices=idx[:nd].view(md.num_decodes, qd.shape[1], -1),
                kernel_metadata=md.decode.kernel_metadata)
            o = o.reshape(nd, *o.shape[2:])
            if nd == T:
                return o, None
            out = q.new_empty((T, self.num_heads, self.kv_lora_rank))
            out[:nd] = o
        out = q.new_empty((T, self.num_heads, self.kv_lora_rank)) if out is None else out
        base = rt.graph.region_base[:T]
        ws_idx = workspace_indices(idx, base, md.prefill.request_ids[:T],
                                   md.prefill.workspace_starts)
        for ch in md.prefill.chunks:
            work = self.prefill_bf16_workspace[:ch.chunk_tot_seqlen]
            blocks = region_blocks(base[ch.hisparse_first], ch.block_table.shape[1])
            ops.cp_gather_and_upconvert_fp8_kv_cache(cache, work, blocks, ch.workspace_starts,
                                                     blocks.shape[0])
            s = ch.tokens_slice
            out[s] = self._bf16_flash_mla_kernel(q[s], work, ws_idx[s], valid[s])
        return out, None
