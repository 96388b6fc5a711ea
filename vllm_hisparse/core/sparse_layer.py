"""Per-layer pieces of the prefill path on a paged KV cache.

Layouts (one layer): ``kv``  (N, 2, P, Hkv, D) paged KV cache, block b = one page of P tokens (K at
[:, 0], V at [:, 1]); ``host`` (pages, 2, P, Hkv, D) the same layer of the host pool.
``StepPlan`` (step_plan.py) holds everything decided once per step; these functions do the
per-layer work of the rows with several query tokens (write K/V, dense causal attention, reading
given-back pages back from the host). Decode rows go through core/decode_body.py.
"""
from __future__ import annotations

import torch

from vllm_hisparse.ops.fp8 import as_bytes


def cache_row(blk: torch.Tensor, off: torch.Tensor, P: int) -> torch.Tensor:
    """The row of (block, offset) among a contiguous cache's (N*2*P, Hkv, D) rows: its K there,
    its V P rows later (write_kv's stores; core/write_behind.py's reads)."""
    return torch.add(off, blk, alpha=2 * P)


def write_kv(kv: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, tok: torch.Tensor | None,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K/V of tokens ``tok`` (all T tokens when None) of k/v (T, Hkv, D) at blocks ``blk`` and
    in-block offsets ``off`` (n,) int64, decided once per step (no host sync here). A contiguous
    cache (N, 2, P, Hkv, D) takes two ``index_copy_`` into its (N*2*P, Hkv, D) rows (K of (b, o)
    at row 2Pb + o, V P rows later) instead of two advanced-index assignments: the same bytes,
    less host work per layer (this runs in every eager layer). An fp8 cache is copied as bytes
    (k/v already fp8: core/kv_quant.py)."""
    if tok is not None:
        k, v = k[tok], v[tok]
    k, v = k.to(kv.dtype), v.to(kv.dtype)
    if kv.is_contiguous():
        P = kv.shape[2]
        k, v = as_bytes(k), as_bytes(v)
        rows = as_bytes(kv).view(-1, *kv.shape[3:])
        r = cache_row(blk, off, P)
        rows.index_copy_(0, r, k)
        rows[P:].index_copy_(0, r, v)
        return
    kv[blk, 0, off] = k
    kv[blk, 1, off] = v


SCORE_BYTES = 512 << 20   # cap of one fp32 score block; a guess that keeps 32K prefill in memory


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                    out: torch.Tensor) -> None:
    """Causal attention of queries at positions start.. (n, Hq, D) over keys 0.. (L, Hkv, D);
    fp32 accumulation, written into out (n, Hq, D). Queries go in blocks so that one fp32 score
    block stays under SCORE_BYTES (the blocking depends only on shapes, so it is deterministic)."""
    n, Hq, D = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    kf, vf = k.float(), v.float()
    step = max(1, SCORE_BYTES // (4 * Hq * L))
    for i in range(0, n, step):
        qb = q[i:i + step]
        m = qb.shape[0]
        qf = qb.float().view(m, Hkv, Hq // Hkv, D)
        s = torch.einsum("nhgd,lhd->nhgl", qf, kf) * scale
        pos = start + i + torch.arange(m, device=q.device)
        allowed = torch.arange(L, device=q.device)[None] <= pos[:, None]
        s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[i:i + m] = torch.einsum("nhgl,lhd->nhgd", p, vf).reshape(m, Hq, D).to(out.dtype)


def paged_dense_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, cu_q: torch.Tensor, seq_k: torch.Tensor,
                          max_q: int, max_k: int, scale: float, out: torch.Tensor) -> None:
    """Causal attention of packed queries over paged KV: the plain-torch twin of the FlashAttention
    call the vLLM adapter plugs in on the GPU (``SparseRuntime.dense_fn``, same signature).

    q/out: (Tq, Hq, D) packed rows, row i = tokens [cu_q[i], cu_q[i+1]) at the *last* positions of
    its seq_k[i] keys; k_cache/v_cache: (N, P, Hkv, D); block_table: (Bd, W) int32; cu_q (Bd+1,),
    seq_k (Bd,) int32. max_q/max_k are FlashAttention's bounds (unused here). A row with
    seq_k 0 attends nothing and gets zeros (the FULL-graph body passes 0 for rows of another kind).
    """
    P = k_cache.shape[1]
    cu, sk = cu_q.tolist(), seq_k.tolist()
    for i, n in enumerate(sk):
        t0, t1 = cu[i], cu[i + 1]
        if n == 0:
            out[t0:t1] = 0
            continue
        blocks = block_table[i, :-(-n // P)].long().to(k_cache.device)
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n]
        dense_attention(q[t0:t1], k, v, n - (t1 - t0), scale, out[t0:t1])


def gather_pages(kv: torch.Tensor, host: torch.Tensor, block_rows: list[torch.Tensor],
                 host_pages: list[torch.Tensor], seq_lens: list[int],
                 freed: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch paged KV for requests whose pages [lo, hi) left the GPU (dense layers only): every
    page of each request, resident ones from kv and freed ones from the host pool, packed into
    (n, 2, P, Hkv, D) with a (R, W) int32 block table into it, for the same paged attention call.
    Slow path: it reads the whole freed context back every step."""
    P = kv.shape[2]
    parts, tables, base = [], [], 0
    W = max(-(-n // P) for n in seq_lens)
    for row, hp, n, (lo, hi) in zip(block_rows, host_pages, seq_lens, freed):
        m = -(-n // P)
        pages = kv[row[:m].long().to(kv.device)]
        if hi > lo:
            pages[lo:hi] = host[hp[lo:hi].long().to(host.device)].to(kv.device, kv.dtype)
        parts.append(pages)
        t = torch.zeros(W, dtype=torch.int32)
        t[:m] = torch.arange(base, base + m, dtype=torch.int32)
        tables.append(t)
        base += m
    return torch.cat(parts), torch.stack(tables).to(kv.device)

