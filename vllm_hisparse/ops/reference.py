"""Plain-torch references of every kernel, same signatures as the CUDA ops in ops/kernels.py.

They are the tests' oracle, the simulator's engine and the CPU path of the vLLM backend.
Layouts (per layer; a selection unit is one page of ``unit`` tokens):
  kv buffer   (N, 2, unit, Hkv, D)   physical slot -> K block [:, 0] and V block [:, 1]
              (FlashInfer's NHD paged layout; a vLLM block of block_size == unit is one slot)
  host pool   (P, 2, unit, Hkv, D)   the same layout, one host page per unit, pinned
  quest meta  kmin/kmax (R, U, Hkv, D) per-unit elementwise min/max of keys
"""
from __future__ import annotations

import torch

from vllm_hisparse.slots import HotBufferState, fetch_misses, resolve


# ---- RESOLVE ------------------------------------------------------------------------------------
def resolve_lru(selection: torch.Tensor, slot_unit: torch.Tensor, unit_slot: torch.Tensor,
                lru_order: torch.Tensor, slot_map: torch.Tensor, buffer: torch.Tensor,
                host: torch.Tensor, host_page_table: torch.Tensor, device_locs: torch.Tensor,
                io_chunk_bytes: int = 64) -> None:
    """One LRU resolve step for a batch of rows, everything updated in place.

    selection: (R, k) int32 unique logical units, best first, -1 = padding (an all -1 row is a no-op)
    slot_unit: (R, S) int32 unit held by each local slot, -1 = empty
    unit_slot: (R, U) int32 page table, unit -> local slot, -1 = not resident
    lru_order: (R, S) int32 local slots, MRU first
    slot_map:  (R, S) int32 physical slot (row of ``buffer``) of each local slot
    buffer:    (N, *unit_shape) device hot buffer (GQA: unit_shape = (2, unit, Hkv, D)); missing
               units are copied into it, byte for byte
    host:      (P, *unit_shape) host pool of this layer (pinned); one host page holds one unit
    host_page_table: (R, Umax) int32 host page of each logical unit of each row
    device_locs: (R, k) int32 out: physical slot of each selected unit, -1 for padding
    io_chunk_bytes: the CUDA kernel's per-thread transfer size; no effect on results (ignored here)
    """
    state = HotBufferState.wrap(slot_unit, unit_slot, {"order": lru_order}, "lru")
    locs, miss = resolve(state, selection)
    fetch_misses(buffer, slot_map, locs, miss, selection,
                 lambda r, u: host[host_page_table[r.cpu(), u.cpu()].long()])
    phys = torch.gather(slot_map.long(), 1, locs.clamp(min=0))
    device_locs.copy_(torch.where(locs >= 0, phys, -1).to(device_locs.dtype))


# ---- sparse decode attention -------------------------------------------------------------------
def sparse_decode_attention(q: torch.Tensor, kv: torch.Tensor, locs: torch.Tensor, units: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, extra_kv: torch.Tensor | None = None,
                            extra_lens: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per row over the selected units' rows, in selection order.

    q: (R, Hq, D); kv: (N, 2, unit, Hkv, D); locs: (R, k) int32 physical slots, -1 = padding;
    units: (R, k) int32 logical units of ``locs`` (row j of unit u is token u*unit+j, attended only
    if < seq_lens[r]); seq_lens: (R,) int32; extra_kv: (R, E, 2, Hkv, D) always-attended rows after
    the selected ones, the first extra_lens[r] valid. fp32 accumulation; rows with nothing to attend
    give zeros. Returns out (R, Hq, D) in q's dtype.
    """
    R, Hq, D = q.shape
    unit, Hkv = kv.shape[2], kv.shape[3]
    k = locs.shape[1]
    g = kv[locs.clamp(min=0).long()].transpose(2, 3)                   # (R, k, unit, 2, Hkv, D)
    pos = units.long()[:, :, None] * unit + torch.arange(unit, device=q.device)
    valid = (locs[:, :, None] >= 0) & (pos < seq_lens.long()[:, None, None])
    g = g.reshape(R, k * unit, 2, Hkv, D)
    valid = valid.reshape(R, k * unit)
    if extra_kv is not None:
        E = extra_kv.shape[1]
        g = torch.cat([g, extra_kv], 1)
        ev = torch.arange(E, device=q.device)[None] < extra_lens.long()[:, None]
        valid = torch.cat([valid, ev], 1)
    return _attend_rows(q, g[:, :, 0], g[:, :, 1], valid, scale, out)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                 scale: float, out: torch.Tensor | None) -> torch.Tensor:
    """One query per row (R, Hq, D) over its keys/values k, v (R, T, Hkv, D) where valid (R, T);
    fp32, rows with nothing valid give zeros."""
    R, Hq, D = q.shape
    Hkv = k.shape[2]
    # Keys past seq_len (or padding) may hold anything, NaN included: never let them reach the sum.
    keep = valid[:, :, None, None]
    kf = k.float().masked_fill(~keep, 0.0)
    vf = v.float().masked_fill(~keep, 0.0)
    qf = q.float().view(R, Hkv, Hq // Hkv, D)
    s = torch.einsum("rhgd,rthd->rhgt", qf, kf) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.einsum("rhgt,rthd->rhgd", p, vf).reshape(R, Hq, D)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out


def dense_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_k: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row over its first seq_k[r] keys, read through its block table.

    q: (R, Hq, D); k_cache/v_cache: (N, P, Hkv, D); block_table: (R, W) int32; seq_k: (R,) int32
    (0: zeros). fp32 accumulation; returns out (R, Hq, D) in q's dtype. Keys past seq_k may hold
    anything, NaN included. Row by row over exactly its keys, so a row's bits do not depend on the
    other rows or the table's width (as the Triton twin, ops.triton_dense_decode; the two are
    equal up to fp32 summation order).
    """
    R = q.shape[0]
    P, Hkv, D = k_cache.shape[1:]
    res = torch.zeros(R, *q.shape[1:], dtype=q.dtype, device=q.device)
    for r, n in enumerate(seq_k.tolist()):
        if n > 0:
            blocks = block_table[r, :-(-n // P)].long().to(k_cache.device)
            k = k_cache[blocks].reshape(-1, Hkv, D)[:n]
            v = v_cache[blocks].reshape(-1, Hkv, D)[:n]
            ok = torch.ones(1, n, dtype=torch.bool, device=q.device)
            res[r] = _attend_rows(q[r:r + 1], k[None], v[None], ok, scale, None)[0]
    if out is None:
        return res
    out.copy_(res)
    return out


# ---- Quest -------------------------------------------------------------------------------------
def quest_update(kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                 keys: torch.Tensor, page_size: int) -> None:
    """Fold new keys into the per-page min/max; a page restarts at its first token.

    kmin/kmax: (R, U, Hkv, D); rows/positions: (n,) int; keys: (n, Hkv, D).
    """
    R, U = kmin.shape[:2]
    flat = rows.long() * U + positions.long() // page_size
    mn, mx = kmin.view(R * U, *kmin.shape[2:]), kmax.view(R * U, *kmax.shape[2:])
    first = (positions.long() % page_size) == 0
    if bool(first.any()):
        mn[flat[first]] = float("inf")
        mx[flat[first]] = float("-inf")
    idx = flat.to(mn.device)[:, None, None].expand(keys.shape)
    mn.scatter_reduce_(0, idx, keys.to(mn.dtype), "amin")
    mx.scatter_reduce_(0, idx, keys.to(mx.dtype), "amax")


def quest_update_pages(kmin: torch.Tensor, kmax: torch.Tensor, page_flat: torch.Tensor,
                       page_new: torch.Tensor, tok_page: torch.Tensor, k: torch.Tensor) -> None:
    """Fold a step's keys into the page bounds by page index, no host sync (same bounds as
    quest_update for the same tokens).

    kmin/kmax: (R, U, Hkv, D); page_flat: (m,) int64 distinct ``row * U + page`` of the pages the
    step touches; page_new: (m,) bool, the page's first token is in this step (its bounds restart);
    tok_page: (T,) int64 index into page_flat of each of the T tokens of k (T, Hkv, D).
    """
    m = page_flat.shape[0]
    if m == 0:
        return
    R, U = kmin.shape[:2]
    idx = tok_page[:, None, None].expand(k.shape)
    kk = k.to(kmin.dtype)
    for bounds, op, init in ((kmin, "amin", float("inf")), (kmax, "amax", float("-inf"))):
        flat = bounds.view(R * U, *bounds.shape[2:])
        step = torch.full((m, *bounds.shape[2:]), init, dtype=bounds.dtype, device=bounds.device)
        step.scatter_reduce_(0, idx, kk, op)
        old = flat[page_flat]
        both = torch.minimum(old, step) if op == "amin" else torch.maximum(old, step)
        flat[page_flat] = torch.where(page_new[:, None, None], step, both)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 num_units: torch.Tensor) -> torch.Tensor:
    """(R, U) fp32 upper bounds of q.k per page: sum_d max(q*min, q*max), summed over the query heads
    of each KV group and over the groups; -inf for units >= num_units[r].

    q: (R, Hq, D); kmin/kmax: (R, U, Hkv, D); num_units: (R,) int.
    """
    R, Hq, D = q.shape
    U, Hkv = kmin.shape[1], kmin.shape[2]
    qf = q.float().view(R, 1, Hkv, Hq // Hkv, D)
    a = qf * kmin.float()[:, :, :, None, :]
    b = qf * kmax.float()[:, :, :, None, :]
    s = torch.maximum(a, b).sum(dim=(2, 3, 4))
    live = torch.arange(U, device=q.device)[None] < num_units.long()[:, None]
    return s.masked_fill(~live, float("-inf"))


def topk_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(R, k) int64 indices of the k largest scores of each row, in ascending index order; among
    equal scores the lowest indices are taken. Scores compare by their order-preserving 32-bit key
    (so -0.0 < +0.0; NaN is not expected). scores: (R, U) fp32, 0 <= k <= U."""
    bits = scores.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=1).values


def topk_pages(idx: torch.Tensor, num_full: torch.Tensor, k_units: int,
               block_table: torch.Tensor | None = None):
    """The pages of a top-k over page scores: (R, k_units) int32, column j = idx[r, j] if j < kk
    and idx[r, j] < num_full[r], else -1. With block_table (R, W) int, also (R, k_units) int32
    block_table[r, page] of each page (-1 padding): returns (pages, blocks).

    idx: (R, kk) int64 from topk_index (or torch.topk), kk <= k_units; num_full: (R,) int complete pages per row.
    """
    R, kk = idx.shape
    out = torch.full((R, k_units), -1, dtype=torch.int32, device=idx.device)
    idx = torch.where(idx < num_full.long()[:, None].to(idx.device), idx, -1)
    out[:, :kk] = idx.to(torch.int32)
    if block_table is None:
        return out
    blocks = torch.gather(block_table.to(idx.device), 1, out.long().clamp(min=0))
    return out, torch.where(out >= 0, blocks, -1).to(torch.int32)


def quest_select(scores: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Top pages per row into out (R, k_units) int32, best first; the newest (possibly partial) page
    always first; -1 padding when a row has fewer pages than k_units (or seq_lens[r] == 0).
    """
    R, U = scores.shape
    k = out.shape[1]
    n = (seq_lens.long() + page_size - 1) // page_size                 # pages in use
    live = torch.arange(U, device=scores.device)[None] < n[:, None]
    s = scores.masked_fill(~live, float("-inf"))
    newest = (n - 1).clamp(min=0)
    s.scatter_(1, newest[:, None], float("inf"))
    kk = min(k, U)
    val, idx = torch.topk(s, kk, dim=1)
    idx = torch.where(torch.arange(kk, device=s.device)[None] < n[:, None], idx, -1)
    out.fill_(-1)
    out[:, :kk] = idx.to(out.dtype)
    return out


# ---- write-through -----------------------------------------------------------------------------
def write_through(host: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tok: torch.Tensor,
                  page: torch.Tensor, off: torch.Tensor) -> None:
    """Copy the step's new K/V rows into one layer's host pool, in place, byte for byte.

    host: (pages, 2, P, Hkv, D) pool of one layer, K at [:, 0], V at [:, 1] (any device)
    k, v: (T, Hkv, D) host's dtype; the token stride may exceed Hkv*D (views of a fused qkv output)
    tok, page, off: (n,) int64: k[tok[i]] -> host[page[i], 0, off[i]], v[tok[i]] -> host[page[i], 1, off[i]];
    destinations distinct; page[i] < 0 = padding (a no-op); other indices must be in range.
    """
    keep = page >= 0
    t = tok[keep].to(k.device)
    p, o = page[keep].to(host.device), off[keep].to(host.device)
    host[p, 0, o] = k[t].to(host.device)
    host[p, 1, o] = v[t].to(host.device)


# ---- decode batch: the new token, and SELECT + RESOLVE -----------------------------------------
def decode_write(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                 seq: torch.Tensor, newest: torch.Tensor, dst: torch.Tensor | None = None,
                 dst_page: torch.Tensor | None = None, kmin: torch.Tensor | None = None,
                 kmax: torch.Tensor | None = None, q_page: torch.Tensor | None = None) -> None:
    """The new token of each decode row, in place: row r (one token at position seq[r] - 1; seq 0 =
    padding, writes nothing) stores k[r]/v[r] (N, Hkv, D) at kv[b, 0/1, off] (kv (blocks, 2, P, Hkv,
    D), b = block_table[r, pos // P], off = pos % P), and at dst[dst_page[r], 0/1, off] where
    dst_page[r] >= 0 (dst: a pool in kv's layout), and folds k[r] into the Quest bounds kmin/kmax
    (R, U, Hkv, D) at flat page q_page[r] = qrow * U + page where q_page[r] >= 0 (restarting the
    page's bounds when off == 0). newest (N,) int32 gets b (-1 for padding).
    seq, dst_page, q_page: (N,) int64; block_table (N, W) int."""
    P = kv.shape[2]
    live = seq > 0
    pos = (seq - 1).clamp(min=0)
    page, off = pos // P, pos % P
    blk = torch.gather(block_table.long(), 1, page[:, None])[:, 0]
    newest.copy_(torch.where(live, blk, -1).to(newest.dtype))
    r = torch.nonzero(live)[:, 0]
    kv[blk[r], 0, off[r]] = k[r].to(kv.dtype)
    kv[blk[r], 1, off[r]] = v[r].to(kv.dtype)
    if dst is not None:
        r = torch.nonzero(live & (dst_page >= 0))[:, 0]
        dp, o = dst_page[r].to(dst.device), off[r].to(dst.device)
        dst[dp, 0, o] = k[r].to(dst.device, dst.dtype)
        dst[dp, 1, o] = v[r].to(dst.device, dst.dtype)
    if kmin is not None:
        r = torch.nonzero(live & (q_page >= 0))[:, 0]
        R, U = kmin.shape[:2]
        kq = k[r].to(kmin.dtype)
        new = (off[r] == 0)[:, None, None]
        for b, f in ((kmin, torch.minimum), (kmax, torch.maximum)):
            flat = b.view(R * U, *b.shape[2:])
            flat[q_page[r]] = torch.where(new, kq, f(flat[q_page[r]], kq))


def select_resolve(scores: torch.Tensor, seq: torch.Tensor, num_full: torch.Tensor, k: int,
                   block_table: torch.Tensor, sel: torch.Tensor, locs: torch.Tensor,
                   hot: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   state: HotBufferState | None = None, host_pt: torch.Tensor | None = None,
                   host: torch.Tensor | None = None, kv: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None, fetch: bool = True,
                   missed: torch.Tensor | None = None) -> None:
    """Each live row's top pages and their physical blocks, in place (the plain-torch twin of
    ops/triton_select.py, composed from topk_index, topk_pages and the slot engine's resolve).

    scores: (N, U) fp32 page scores (only pages [0, num_full[r]) are read); seq, num_full: (N,) int
    (a row is live when seq > 0; other rows' sel/locs are left as they are); k: pages to select;
    block_table: (N, W) int; sel, locs: (N, k) int32 out: pages ascending then -1, and their blocks.
    hot: (N,) int, pages [0, hot[r]) of row r resolve through its hot slots, pages [hot[r],
    num_full[r]) through the block table (0: a resident row; >= num_full[r]: every page through
    the slots): ``state`` (slots.HotBufferState of M rows, any served policy) read and written at
    runtime rows rows (N,) int64, slot s = block_table[r, s]; misses come from
    host[host_pt[rows[r], page]] into kv (both (*, 2, P, Hkv, D)); counts (3,) int64 += [hits,
    misses, pages taken through the block table] of the live rows. fetch False: the misses are
    not copied and their locs entries are marked ``-2 - block`` (``fetch_marked`` copies them, the
    fused attention reads them from the host itself). missed (N,) int32, with hot: 1 for each row
    with a miss this step, 0 for every other row (live or not)."""
    N, U = scores.shape
    live = seq > 0
    if hot is not None and missed is not None:
        missed[:N] = 0
    if N == 0 or k == 0 or not bool(live.any()):
        return
    n = num_full.long()
    s = torch.where(torch.arange(U, device=scores.device)[None] < n[:, None], scores, float("-inf"))
    pages, blocks = topk_pages(topk_index(s, min(k, U)), n, k, block_table)
    sel.copy_(torch.where(live[:, None], pages, sel))
    locs.copy_(torch.where(live[:, None], blocks, locs))
    if hot is None:
        return
    on_bt = live[:, None] & (pages >= hot[:, None])              # includes -1 padding: not counted
    counts[2] += (on_bt & (pages >= 0)).sum()
    h = torch.nonzero(live & (num_full > 0) & (hot != 0))[:, 0]
    if len(h) == 0:
        return
    S, r = state.slots, rows[h].long()
    ph = torch.where(pages[h] < hot[h, None], pages[h], -1)     # the pages of the hot slots
    loc, miss = resolve(state, ph, rows=r)
    valid = ph >= 0
    counts[:2] += torch.stack([(valid & ~miss).sum(), miss.sum()])
    if missed is not None:
        missed[h] = miss.any(1).to(missed.dtype)
    slot_map = block_table[h, :S].long()
    phys = torch.gather(slot_map, 1, loc.clamp(min=0))
    if fetch:
        fetch_misses(kv, slot_map, loc, miss, ph, lambda i, u: host[host_pt[r[i], u].long()])
    else:
        phys = torch.where(miss, -2 - phys, phys)
    locs[h] = torch.where(loc >= 0, phys, blocks[h]).to(locs.dtype)


def fetch_marked(kv: torch.Tensor, locs: torch.Tensor, units: torch.Tensor, seq: torch.Tensor,
                 rows: torch.Tensor, host_pt: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """The misses select_resolve(fetch=False) left marked: each entry ``-2 - block`` of a row with
    seq > 0 gets its page host[host_pt[rows[r], units[r, j]]] copied into kv[block]. Returns locs
    with the marks replaced by their blocks (a new tensor; locs is left as it is)."""
    marked = (seq > 0)[:, None] & (locs <= -2)
    r, j = torch.nonzero(marked, as_tuple=True)
    out = torch.where(marked, -2 - locs, locs)
    if len(r):
        pages = host_pt[rows[r].long().to(host_pt.device), units[r, j].long().to(host_pt.device)]
        kv[out[r, j].long()] = host[pages.long()].to(kv.device, kv.dtype)
    return out
