"""DSA with each token's selection in ascending position order (``indexer: "dsa_sorted"``).

The same tokens as ``dsa`` (vLLM's lightning indexer selects), handed to RESOLVE and to the
sparse-MLA attention sorted: position ascending, ``-1`` (none) after the positions. The attention
then sums a token's KV rows in an order that depends on the selected set only, not on the order in
which vLLM's radix top-k kernels (``persistent_topk``, ``cooperative_topk``,
``top_k_per_row_prefill``) wrote it.

Why it exists: two runs of one resident engine on the DeepSeek-V3.2 shape with attention-matters
weights differed from the prefill's first token on (H100, 2026-12-06; docs/gpu-results.md), so no
DSA exactness verdict was possible. If those kernels emit a row's indices in a run-dependent
order, FA3's fp32 sums differ in their last bits and the difference grows through the layers.
Serving resident and hisparse with ``dsa_sorted`` tells: reproducible -> the order was it (and
the comparison hisparse == resident stands on a reproducible reference); not reproducible ->
the selected set itself, or another kernel, differs. Both modes sort the same way, so the
equality hisparse == resident keeps its meaning; stock FLASH_ATTN_MLA_SPARSE does not sort, so
against stock only the tokens compare. Cost: one sort of (T, top_k) int32 a layer.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core.indexers.dsa.indexer import DSAIndexer


def sorted_selection(sel: torch.Tensor) -> torch.Tensor:
    """(T, K) int32 positions, -1 = none: each row ascending, its -1s last. Device work on fixed
    shapes only (no host sync: runs inside vLLM's CUDA graphs)."""
    big = torch.iinfo(sel.dtype).max
    keyed = torch.where(sel < 0, torch.full_like(sel, big), sel)
    out = keyed.sort(dim=1).values
    return torch.where(out == big, torch.full_like(out, -1), out)


class DSASortedIndexer(DSAIndexer):
    name = "dsa_sorted"

    @classmethod
    def mla_selection(cls, topk_buffer, num_tokens, layer):
        return sorted_selection(topk_buffer[:num_tokens])
