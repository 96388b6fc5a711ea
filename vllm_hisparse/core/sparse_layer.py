"""Per-layer HiSparse attention on a paged KV cache (plain torch; the adapter only forwards here).

Layouts (one layer): ``kv``  (N, 2, P, Hkv, D) paged KV cache, block b = one page of P tokens (K at
[:, 0], V at [:, 1]); ``host`` (pages, 2, P, Hkv, D) the same layer of the host pool; ``kmin``/
``kmax`` (rows, U, Hkv, D) Quest page bounds per runtime row. ``StepPlan`` (sparse_runtime.py) holds
everything decided once per step; these functions do the per-layer work.

Decode of a sparse request: Quest scores the complete pages ``[0, newest)``, the best
``top_k_units - 1`` of them are selected (the newest page is always attended, as ``extra`` rows),
and their physical slots come either straight from the block table (all pages still resident) or
from RESOLVE over the hot slots (blocks ``[0, S)`` of the request). Both modes run the same
selection and the same attention kernel, so hisparse == resident bit for bit.
"""
from __future__ import annotations

import torch

from vllm_hisparse.ops import kernels, reference

_resolve_lru = getattr(kernels, "resolve_lru", reference.resolve_lru)
_sparse_attention = getattr(kernels, "sparse_decode_attention", reference.sparse_decode_attention)
_quest_update = getattr(kernels, "quest_update", reference.quest_update)
_quest_scores = getattr(kernels, "quest_scores", reference.quest_scores)


def write_kv(kv: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K/V (T, Hkv, D) at flat slots ``block * P + offset`` (T,) int64; -1 = padding, skipped."""
    P = kv.shape[2]
    ok = slot_mapping >= 0
    s = slot_mapping[ok]
    blk, off = s // P, s % P
    kv[blk, 0, off] = k[ok].to(kv.dtype)
    kv[blk, 1, off] = v[ok].to(kv.dtype)


def write_host(host: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """Write-through: K/V (n, Hkv, D) of n tokens into host pages (n,) at offsets (n,)."""
    if len(pages) == 0:
        return
    pages_c, offs_c = pages.to(host.device), offs.to(host.device)
    host[pages_c, 0, offs_c] = k.to(host.device, host.dtype)
    host[pages_c, 1, offs_c] = v.to(host.device, host.dtype)


def quest_update(kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                 k: torch.Tensor, page_size: int) -> None:
    if len(rows):
        _quest_update(kmin, kmax, rows, pos, k, page_size)


def gather_context(kv: torch.Tensor, host: torch.Tensor | None, block_row: torch.Tensor,
                   host_pages: torch.Tensor | None, seq_len: int, freed: tuple[int, int]):
    """K, V (seq_len, Hkv, D) of one request: its pages from the GPU blocks, except the freed pages
    [lo, hi), which only the host pool still holds."""
    P = kv.shape[2]
    n = -(-seq_len // P)
    pages = kv[block_row[:n].long()]                                     # (n, 2, P, Hkv, D)
    lo, hi = freed
    if hi > lo:
        pages = pages.clone()
        pages[lo:hi] = host[host_pages[lo:hi].long().to(host.device)].to(kv.device, kv.dtype)
    k = pages[:, 0].reshape(n * P, *pages.shape[3:])[:seq_len]
    v = pages[:, 1].reshape(n * P, *pages.shape[3:])[:seq_len]
    return k, v


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


def quest_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_full: torch.Tensor,
               k_units: int) -> torch.Tensor:
    """(R, k_units) int32 best complete pages per row (best first), -1 padding.

    q: (R, Hq, D); kmin/kmax: (R, U, Hkv, D) of the rows; num_full: (R,) complete pages per row.
    """
    R, U = kmin.shape[0], kmin.shape[1]
    out = torch.full((R, k_units), -1, dtype=torch.int32, device=q.device)
    kk = min(k_units, U)
    if R == 0 or kk == 0:
        return out
    scores = _quest_scores(q, kmin, kmax, num_full)
    _, idx = torch.topk(scores, kk, dim=1)
    idx = torch.where(idx < num_full.long()[:, None].to(idx.device), idx, -1)
    out[:, :kk] = idx.to(torch.int32)
    return out


def resolve_hot(sel: torch.Tensor, state: "HotSlots", rows: torch.Tensor, slot_map: torch.Tensor,
                kv: torch.Tensor, host: torch.Tensor, host_pt: torch.Tensor,
                io_chunk_bytes: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """RESOLVE the selections (Rh, k) of hot rows: (device slots (Rh, k) int32, (2,) int64
    [hits, misses] on the device — counted without a host sync, the caller reads them when needed).
    io_chunk_bytes (config field) goes to the CUDA kernel; the CPU reference ignores it."""
    su, us, lru = state.slot_unit[rows], state.unit_slot[rows], state.lru[rows]
    valid = sel >= 0
    was = torch.gather(us, 1, sel.long().clamp(min=0)) >= 0
    counts = torch.stack([(valid & was).sum(), (valid & ~was).sum()])
    locs = torch.empty_like(sel)
    _resolve_lru(sel, su, us, lru, slot_map.to(torch.int32), kv, host, host_pt, locs,
                 io_chunk_bytes=io_chunk_bytes)
    state.slot_unit[rows], state.unit_slot[rows], state.lru[rows] = su, us, lru
    return locs, counts


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
    are attended after the selected ones.
    """
    P = kv.shape[2]
    extra = kv[newest_blocks.long()].transpose(1, 2).contiguous()       # (R, P, 2, Hkv, D)
    extra_lens = ((seq_lens.long() - 1) % P + 1).to(torch.int32)
    _sparse_attention(q, kv, locs, sel, seq_lens, scale, extra, extra_lens, out)
