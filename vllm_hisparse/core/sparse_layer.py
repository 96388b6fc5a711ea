"""Per-layer HiSparse attention on a paged KV cache (torch and the ops layer's kernels; the adapter
only forwards here).

Layouts (one layer): ``kv``  (N, 2, P, Hkv, D) paged KV cache, block b = one page of P tokens (K at
[:, 0], V at [:, 1]); ``host`` (pages, 2, P, Hkv, D) the same layer of the host pool; ``kmin``/
``kmax`` (rows, U, Hkv, D) Quest page bounds per Quest row. ``StepPlan`` (step_plan.py) holds
everything decided once per step; these functions do the per-layer work.

Decode of a sparse request: Quest scores the complete pages ``[0, newest)``, the best
``top_k_units - 1`` of them are selected (the newest page is always attended, as ``extra`` rows),
and their physical slots come either straight from the block table (all pages still resident) or
from RESOLVE over the hot slots (blocks ``[0, S)`` of the request). Both modes run the same
selection and the same attention kernel, so hisparse == resident bit for bit.

On CUDA a decode layer is a few launches: the Quest update (1), scores + top-k + pages and
blocks (3-4, ``quest_topk_locs``), RESOLVE with its gathers/scatters (4, ``resolve_hot_into``) and
the attention (2, ``sparse_decode``); on CPU the same functions run the plain-torch references.
"""
from __future__ import annotations

import torch

from vllm_hisparse.ops import hot_rows, kernels, reference
from vllm_hisparse.ops.quest import quest_scores_rows, topk_index, topk_pages
from vllm_hisparse.ops.quest_update import quest_update_pages as _quest_update_pages

_resolve_lru = getattr(kernels, "resolve_lru", reference.resolve_lru)


def write_kv(kv: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, tok: torch.Tensor | None,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K/V of tokens ``tok`` (all T tokens when None) of k/v (T, Hkv, D) at blocks ``blk`` and
    in-block offsets ``off`` (n,) int64, decided once per step (no host sync here). A contiguous
    cache (N, 2, P, Hkv, D) takes two ``index_copy_`` into its (N*2*P, Hkv, D) rows (K of (b, o)
    at row 2Pb + o, V P rows later) instead of two advanced-index assignments: the same bytes,
    less host work per layer (this runs in every eager layer)."""
    if tok is not None:
        k, v = k[tok], v[tok]
    k, v = k.to(kv.dtype), v.to(kv.dtype)
    if kv.is_contiguous():
        P = kv.shape[2]
        rows = kv.view(-1, *kv.shape[3:])
        r = torch.add(off, blk, alpha=2 * P)
        rows.index_copy_(0, r, k)
        rows[P:].index_copy_(0, r, v)
        return
    kv[blk, 0, off] = k
    kv[blk, 1, off] = v


def quest_update_pages(kmin: torch.Tensor, kmax: torch.Tensor, page_flat: torch.Tensor,
                       page_new: torch.Tensor, tok_page: torch.Tensor, k: torch.Tensor) -> None:
    """Fold this step's keys into the Quest page bounds with no host sync (same result as
    ``reference.quest_update``); one Triton launch on CUDA (ops/quest_update.py).

    kmin/kmax: (R, U, Hkv, D); page_flat: (m,) int64 distinct ``row * U + page`` of the pages this
    step touches; page_new: (m,) bool, the page's first token is in this step (its bounds restart);
    tok_page: (T,) int64 index into page_flat of each of the T tokens of k (T, Hkv, D),
    non-decreasing, every page with at least one token (as the plan builds it).
    """
    _quest_update_pages(kmin, kmax, page_flat, page_new, tok_page, k)


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


def quest_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor,
               num_full: torch.Tensor, k_units: int) -> torch.Tensor:
    """(R, k_units) int32 best complete pages per row (in ascending page order), -1 padding.

    q: (R, Hq, D); kmin/kmax: (N, U, Hkv, D) page bounds of every runtime row, read at rows (R,)
    (no copy of the bounds); num_full: (R,) complete pages per row.
    CUDA: score kernel + top-k kernel + one launch for the -1 padding and int32 (ops.quest).
    """
    return topk_pages(_topk_index(q, kmin, kmax, rows, num_full, k_units), num_full, k_units)


def quest_topk_locs(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor,
                    num_full: torch.Tensor, k_units: int,
                    block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quest_topk and the selected pages' blocks in one go: (sel, locs), both (R, k_units) int32,
    locs[r, j] = block_table[r, sel[r, j]], -1 where sel is -1 (the resident mode's slots).
    block_table: (R, W) int32/int64. On CUDA no more launches than quest_topk."""
    return topk_pages(_topk_index(q, kmin, kmax, rows, num_full, k_units), num_full, k_units,
                      block_table)


def _topk_index(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor,
                num_full: torch.Tensor, k_units: int) -> torch.Tensor:
    """(R, min(k_units, U)) int64 indices of the top Quest scores, ascending ((R, 0) if none)."""
    R, U = q.shape[0], kmin.shape[1]
    kk = min(k_units, U)
    if R == 0 or kk <= 0:
        return torch.empty((R, 0), dtype=torch.int64, device=q.device)
    scores = quest_scores_rows(q, kmin, kmax, rows, num_full)
    return topk_index(scores, kk)


def resolve_hot(sel: torch.Tensor, state: "HotSlots", rows: torch.Tensor, slot_map: torch.Tensor,
                kv: torch.Tensor, host: torch.Tensor, host_pt: torch.Tensor,
                io_chunk_bytes: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """RESOLVE the selections (Rh, k) of hot rows: (device slots (Rh, k) int32, (2,) int64
    [hits, misses] on the device — counted without a host sync, the caller reads them when needed).
    io_chunk_bytes (config field) goes to the CUDA kernel; the CPU reference ignores it."""
    counts = torch.zeros(2, dtype=torch.int64, device=sel.device)
    locs = torch.empty_like(sel)
    resolve_hot_into(locs, sel, None, rows, state, slot_map, kv, host, host_pt, counts,
                     io_chunk_bytes=io_chunk_bytes)
    return locs, counts


def resolve_hot_into(locs: torch.Tensor, sel: torch.Tensor, hot: torch.Tensor | None,
                     rows: torch.Tensor, state: "HotSlots", slot_map: torch.Tensor, kv: torch.Tensor,
                     host: torch.Tensor, host_pt: torch.Tensor, counts: torch.Tensor,
                     io_chunk_bytes: int = 64) -> None:
    """RESOLVE the hot decode rows in place: locs[hot] = their device slots, counts += [hits, misses].

    locs, sel: (Rd, k) int32 of the decode rows (locs of the other rows are left alone); hot: (Rh,)
    int64 indices of the hot rows among them, or a (Rd,) bool mask of them (fixed shapes for CUDA
    graphs: Rh = Rd, cold rows resolve nothing), or None = all (RESOLVE writes locs directly);
    rows: (Rd,) int64 runtime rows; slot_map (Rh, S), host_pt (Rh, U) int32 of the hot rows;
    counts: (2,) int64 on the device. CUDA: 4 launches (gather + count, RESOLVE's two, scatter).
    """
    st = (state.slot_unit, state.unit_slot, state.lru)
    sel_h, su, us, lru = hot_rows.take_hot_rows(sel, hot, rows, *st, counts)
    out = locs if hot is None else torch.empty_like(sel_h)
    _resolve_lru(sel_h, su, us, lru, slot_map.to(torch.int32), kv, host, host_pt, out,
                 io_chunk_bytes=io_chunk_bytes)
    hot_rows.put_hot_rows(locs, hot, rows, out, su, us, lru, *st)


class HotSlots:
    """LRU hot-buffer state of one layer for every runtime row (see ops.reference.resolve_lru)."""

    def __init__(self, rows: int, slots: int, max_units: int, device):
        self.slot_unit = torch.full((rows, slots), -1, dtype=torch.int32, device=device)
        self.unit_slot = torch.full((rows, max_units), -1, dtype=torch.int32, device=device)
        self.lru = torch.arange(slots, dtype=torch.int32, device=device).repeat(rows, 1)

    def reset(self, row: int) -> None:
        self.slot_unit[row] = -1
        self.unit_slot[row] = -1
        self.lru[row] = torch.arange(self.lru.shape[1], dtype=torch.int32, device=self.lru.device)


def sparse_decode(q: torch.Tensor, kv: torch.Tensor, locs: torch.Tensor, sel: torch.Tensor,
                  seq_lens: torch.Tensor, newest_blocks: torch.Tensor, scale: float,
                  out: torch.Tensor) -> None:
    """Attention of one token per row over the selected pages (locs (R, k)) then its newest page.

    newest_blocks: (R,) block of each row's newest page; its first ``(seq_len-1) % P + 1`` rows
    are attended after the selected ones, read from kv in place (two launches on CUDA).
    """
    kernels.sparse_decode_attention_newest(q, kv, locs, sel, seq_lens, newest_blocks, scale, out)
