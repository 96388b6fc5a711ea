"""DSA with a run-independent selected SET, sorted by position (``indexer: "dsa_stable"``).

``dsa_sorted`` made the order of a token's selection independent of the run; the set still was
not: vLLM's top-k kernels place the entries tied at the k-th score through shared-memory atomics,
so with an exact fp32 tie at the boundary (~1.5e-4 per row at 12K candidates with fp8 q/k: about
0.3-2 per layer per prompt) which tied token is kept changes from run to run, and one 12K prompt
of the DeepSeek-V3.2-shaped reference differed from its first token (H100, 2026-12-07).

With this indexer the MLA worker (vllm/mla_worker.py -> vllm/topk_swap.py) replaces those kernels,
in its own process, by ``ops/stable_topk.py``: per row the top k by (score descending, column
ascending), so ties always keep the lowest positions; then each row is sorted by position as in
``dsa_sorted`` (the stand-ins already write each set in position order). Both hisparse and
resident mode get it (both run our backend); a stock FLASH_ATTN_MLA_SPARSE engine gets it only
where its process installs it (scripts/gpu_dsa.py's stock mode does). Cost: plain torch
in place of vLLM's radix kernels (int64 keys, ``torch.topk`` per row chunk) in every layer's
prefill and decode, plus the sort; not yet measured on a GPU.
"""
from __future__ import annotations

from vllm_hisparse.core.indexers.dsa.sorted import DSASortedIndexer


class DSAStableIndexer(DSASortedIndexer):
    name = "dsa_stable"
    stable_topk = True      # vllm/topk_swap.py: vLLM's top-k kernels -> ops/stable_topk.py
