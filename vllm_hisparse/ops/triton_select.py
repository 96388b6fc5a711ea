"""SELECT + RESOLVE of a decode batch (Triton): one program per row takes the row's Quest page
scores, picks its top pages, and maps them to physical blocks — through the block table while every
page is on the GPU, or through the row's hot slots otherwise (a constexpr branch per served policy of
vllm_hisparse.slots: ``POLICY`` 0 = lru, 1 = crf); a second launch, one program per
selected page, copies the missing pages from the pinned host pool with GPU loads (a row's misses in
parallel: one program copying them one after the other was far slower; docs/gpu-results.md).

Per row r (program r; rows with ``seq[r] == 0`` stop at once, rows without a complete page get
``sel = locs = -1``):

1. **Top-k** over the scores of pages [0, n), n = num_full[r]: all of them when n <= K, else the K
   largest by an order-preserving 32-bit key, found by four 8-bit radix passes (a histogram each),
   then every larger key and the first ties in page order (contract ``reference.topk_index``).
   ``sel[r]`` = the pages in ascending order, -1 after them.
2. **Pages on the block table** (every page of a resident row, ``hot[r] == 0``; pages >= hot[r] of
   a partially spilled row): ``locs[r, j] = block_table[r, sel[r, j]]``, counted in ``counts[2]``.
3. **Hot rows**, their pages < hot[r] (RESOLVE, contract ``reference.select_resolve``, i.e.
   ``slots.engine.resolve`` on the selection with the other pages masked to -1):
   hits through the page table ``unit_slot``; victims in the policy's eviction order, empty slots
   before occupied ones that are not hit now; the i-th miss in selection order takes the i-th
   victim. LRU (state ``order``, MRU first): victims from the LRU end; the new order is hits (later
   selection entries more recent), then misses, then the rest in their old order. crf (state
   ``value``, slots/crf.py): victims in ascending (value, slot) order, one block-wide sort of the
   32-bit key ``(value + 1) << 16 | slot`` with hit slots pushed last; then every occupied value
   decays, hits add HIT, misses start at HIT // 2. Slot
   s of the row is block ``block_table[r, s]`` (the request's first S blocks are its hot slots).
   The state rows are read and written in place through the runtime row ``rows[r]``; hits and
   misses are added to ``counts``; a miss's locs entry is marked ``-2 - block`` until the IO
   program has copied ``host[host_pt[row, unit]]`` into the block.

Every decision is a function of the row's state and scores (scans in fixed orders, no atomics but
the integer counts), so a row's result does not depend on the other rows of the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SELECT_WARPS = 16  # warps of the select program (the fastest of 4 / 8 / 16 for a 32K row;
                   # bench.decode_step --select-warps; docs/gpu-results.md)
RADIX_BITS = 8     # bits per top-k radix pass (11: at most 3 passes of 2048 bins, measured
                   # slower; bench.decode_step --radix-bits; docs/gpu-results.md)


@triton.jit
def _topk_take(SC, n, K, UB: tl.constexpr, BITS: tl.constexpr):
    """(UB,) bool: the pages [0, n) among the K best scores of the row at SC (n > K). Radix passes
    of BITS bits (a histogram each) narrow the K-th key's prefix; they stop once the prefix's
    bucket is taken whole (then the prefix alone decides), so random scores need fewer passes than
    32 / BITS."""
    o = tl.arange(0, UB)
    live = o < n
    x = tl.load(SC + o, mask=live, other=0.0)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = tl.where(live, key, -1)
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)
    need = K
    prefix = tl.zeros([], tl.int64)
    used = tl.zeros([], tl.int32)              # bits of the key that prefix holds
    done = tl.zeros([], tl.int32)
    for p in tl.static_range((32 + BITS - 1) // BITS):
        sh = (32 - BITS * (p + 1)) if BITS * (p + 1) < 32 else 0
        w = 32 - BITS * p - sh
        if done == 0:
            if p == 0:
                match = live
            else:
                match = live & ((key >> (sh + w)) == prefix)
            dig = ((key >> sh) & ((1 << w) - 1)).to(tl.int32)
            hist = tl.histogram(dig, NB, mask=match)
            ge = tl.cumsum(hist, 0, reverse=True)                 # entries with digit >= bin
            d = tl.max(tl.where(ge >= need, bins, -1), 0)
            # one reduction for two numbers at bin d: entries above it (ge - hist) and in it
            # (hist), packed (counts < 2^16: rows of up to 16384 pages)
            both = tl.sum(tl.where(bins == d, ((ge - hist) << 16) | hist, 0), 0)
            need -= both >> 16
            prefix = (prefix << w) | d
            used += w
            done = ((both & 0xFFFF) == need).to(tl.int32)
    kp = key >> (32 - used)
    kp = tl.where(live, kp, -1)
    eq = (kp == prefix).to(tl.int32)
    return (kp > prefix) | ((eq != 0) & (tl.cumsum(eq, 0) - eq < need))


@triton.jit
def _resolve_prelude(r, row, on, S, SU, POL, SCR, s_su, s_pol, SB: tl.constexpr,
                     POLICY: tl.constexpr):
    """What _resolve_row needs of row ``row``'s state before the selection is known (loaded early so
    its latency hides behind the top-k), and r's scratch flags zeroed (1 hit, 2 victim). LRU: its
    order (slot at recency p, MRU first), that order reversed (the LRU end first) and the units of
    those slots; crf: the slots' values (three times). on: whether the row resolves (else nothing
    is read). A barrier must follow before _resolve_row."""
    os_ = tl.arange(0, SB)
    pre = (os_ < S) & on
    lo = tl.load(POL + row * s_pol + os_, mask=pre, other=0)
    lo_rev = lo
    su_rev = lo
    if POLICY == 0:
        lo_rev = tl.load(POL + row * s_pol + (S - 1 - os_), mask=pre, other=0)
        su_rev = tl.load(SU + row * s_su + lo_rev, mask=pre, other=0)
    tl.store(SCR + r.to(tl.int64) * SB + os_, 0, mask=pre)
    return lo, lo_rev, su_rev


@triton.jit
def _resolve_row(r, row, u, jk, K, S, BT, SU, US, POL, SCR, VIC, COUNTS, LOCS,
                 s_bt, s_su, s_us, s_pol, lo, lo_rev, su_rev, rest, KB: tl.constexpr,
                 SB: tl.constexpr, POLICY: tl.constexpr, SHIFT: tl.constexpr, HIT: tl.constexpr):
    """lo / lo_rev / su_rev: _resolve_prelude's loads of the row's policy state, made by the caller
    before the top-k so their latency hides behind it. u: (KB,) the units to resolve through the
    hot slots, -1 = none; rest: (KB,) what locs gets where u is -1 (-1, or a resident page's
    block)."""
    valid = u >= 0
    us = US + row * s_us
    su = SU + row * s_su
    pol = POL + row * s_pol                                    # the policy's state row
    bt = BT + r.to(tl.int64) * s_bt
    scr = SCR + r.to(tl.int64) * SB
    vic = VIC + r.to(tl.int64) * KB
    cur = tl.load(us + u, mask=valid, other=-1)
    hit = valid & (cur >= 0)
    miss = valid & (cur < 0)
    hit_i = hit.to(tl.int32)
    miss_i = miss.to(tl.int32)
    # hits and misses counted and ranked in one scan (packed: a row selects < 2^16 pages)
    both = tl.cumsum(hit_i | (miss_i << 16), 0)
    hi = (both & 0xFFFF) - hit_i                               # rank of each hit
    mi = (both >> 16) - miss_i                                 # rank of each miss
    hm = tl.max(both, 0)                                       # the last prefix: the totals
    h = hm & 0xFFFF
    m = hm >> 16
    tl.atomic_add(COUNTS, h.to(tl.int64))
    tl.atomic_add(COUNTS + 1, m.to(tl.int64))
    os_ = tl.arange(0, SB)
    sm = os_ < S
    tl.store(scr + cur, 1, mask=hit)
    vs = tl.zeros([KB], tl.int32)
    if m > 0:                                                  # victims: only when a page misses
        tl.debug_barrier()
        if POLICY == 0:                                        # LRU: victims from the LRU end
            hitf = tl.load(scr + lo_rev, mask=sm, other=0, volatile=True) == 1
            empty = sm & (su_rev < 0)
            occ = sm & (su_rev >= 0) & ~hitf
            e_i = empty.to(tl.int32)
            o_i = occ.to(tl.int32)
            n_empty = tl.sum(e_i, 0)
            rank = tl.where(empty, tl.cumsum(e_i, 0) - e_i,
                            tl.where(occ, n_empty + tl.cumsum(o_i, 0) - o_i, 1 << 30))
            is_v = rank < m
            tl.store(vic + rank, lo_rev, mask=is_v)
            tl.store(us + su_rev, -1, mask=is_v & ~empty)     # a victim forgets its old page
            tl.store(scr + lo_rev, 2, mask=is_v)
        else:                                                  # crf: lo = value, -1 = empty
            hits_s = tl.load(scr + os_, mask=sm, other=0, volatile=True) == 1
            # eviction order = ascending (value, slot): empty slots (-1) first; hit slots never
            key = tl.where(sm & ~hits_s, ((lo + 1) << 16) | os_, 0x7FFFFFFF)
            vslot = tl.sort(key, 0) & 0xFFFF
            is_v = os_ < m
            old = tl.load(su + vslot, mask=is_v, other=-1)
            tl.store(vic + os_, vslot, mask=is_v)
            tl.store(us + old, -1, mask=is_v & (old >= 0))    # a victim forgets its old page
        tl.debug_barrier()
        vs = tl.load(vic + mi, mask=miss, other=0, volatile=True)
        tl.store(su + vs, u, mask=miss)
        tl.store(us + u, vs, mask=miss)
    vcur = tl.zeros([KB], tl.int32)
    if POLICY != 0:
        vcur = tl.load(pol + cur, mask=hit, other=0)           # hits' values before the decay
    tl.debug_barrier()
    phys = tl.load(bt + tl.where(hit, cur, vs), mask=valid, other=-1)
    # a miss is marked -2 - block: _miss_io_kernel copies its page in, then writes the block
    tl.store(LOCS + r.to(tl.int64) * K + jk, tl.where(hit, phys, tl.where(miss, -2 - phys, rest)),
             mask=jk < K)
    if POLICY == 0:
        tl.store(pol + (h - 1 - hi), cur, mask=hit)
        tl.store(pol + (h + m - 1 - mi), vs, mask=miss)
        stay = sm & (tl.load(scr + lo, mask=sm, other=1, volatile=True) == 0)
        st_i = stay.to(tl.int32)
        tl.store(pol + (h + m + tl.cumsum(st_i, 0) - st_i), lo, mask=stay)
    else:
        tl.store(pol + os_, tl.where(lo >= 0, lo - (lo >> SHIFT), lo), mask=sm)
        tl.debug_barrier()
        tl.store(pol + cur, vcur - (vcur >> SHIFT) + HIT, mask=hit)
        tl.store(pol + vs, HIT // 2, mask=miss)
    return m


@triton.jit
def _miss_io_kernel(LOCS, SEL, SEQ, NFULL, HOT, ROWS, HPT, HOST, KV, K, s_hpt, ROW: tl.constexpr,
                    CH: tl.constexpr):
    """Program (r, j): if selection entry j of row r (a row the select kernel resolved: live, hot,
    with complete pages; other rows' locs are not this call's) is a marked miss, copy its page
    from the host pool (UVA loads) into its block, then write the block into locs."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    mine = (tl.load(SEQ + r) > 0) & (tl.load(NFULL + r) > 0) & (tl.load(HOT + r) != 0)
    loc = tl.load(LOCS + r.to(tl.int64) * K + j, mask=mine, other=0)
    if loc <= -2:
        phys = -2 - loc
        row = tl.load(ROWS + r).to(tl.int64)
        hp = tl.load(HPT + row * s_hpt + tl.load(SEL + r.to(tl.int64) * K + j)).to(tl.int64)
        oc = tl.arange(0, CH)
        src = HOST + hp * ROW
        dst = KV + phys.to(tl.int64) * ROW
        for c in tl.static_range(0, ROW, 2 * CH):        # two chunks in flight per round
            x = tl.load(src + c + oc)
            if c + CH < ROW:
                y = tl.load(src + c + CH + oc)
            tl.store(dst + c + oc, x)
            if c + CH < ROW:
                tl.store(dst + c + CH + oc, y)
        tl.store(LOCS + r.to(tl.int64) * K + j, phys)


@triton.jit
def _select_kernel(SC, SEQ, NFULL, HOT, ROWS, BT, SU, US, POL, SCR, VIC, COUNTS, SEL, LOCS, MISSED,
                   K, S,
                   s_sc, s_bt, s_su, s_us, s_pol, UB: tl.constexpr, KB: tl.constexpr,
                   SB: tl.constexpr, HAS_HOT: tl.constexpr, BITS: tl.constexpr,
                   POLICY: tl.constexpr, SHIFT: tl.constexpr, HIT: tl.constexpr):
    r = tl.program_id(0)
    n = tl.load(NFULL + r).to(tl.int32)
    jk = tl.arange(0, KB)
    missed = 0                                    # (MISSED[r], hot launches: 1 for a row that misses)
    sel = SEL + r.to(tl.int64) * K
    if (tl.load(SEQ + r) > 0) & (n == 0):             # no complete page yet: nothing selected
        tl.store(sel + jk, -1, mask=jk < K)
        tl.store(LOCS + r.to(tl.int64) * K + jk, -1, mask=jk < K)
    if (tl.load(SEQ + r) > 0) & (n > 0):
        hot = 0
        if HAS_HOT:
            hot = tl.load(HOT + r)
        row = tl.load(ROWS + r).to(tl.int64)
        lo, lo_rev, su_rev = _resolve_prelude(r, row, hot != 0, S, SU, POL, SCR, s_su, s_pol, SB,
                                              POLICY)
        o = tl.arange(0, UB)
        take = o < n
        if n > K:
            take = _topk_take(SC + r.to(tl.int64) * s_sc, n, K, UB, BITS)
        ti = take.to(tl.int32)
        tl.store(sel + tl.cumsum(ti, 0) - ti, o, mask=take)
        tl.store(sel + jk, -1, mask=(jk >= tl.minimum(n, K)) & (jk < K))
        tl.debug_barrier()
        u = tl.load(sel + jk, mask=jk < K, other=-1, volatile=True)
        # pages [hot, n) through the block table (all of them in a resident row, hot == 0)
        on_bt = (u >= 0) & (u >= hot)
        blk = tl.load(BT + r.to(tl.int64) * s_bt + u, mask=on_bt, other=-1)
        if HAS_HOT:
            tl.atomic_add(COUNTS + 2, tl.sum(on_bt.to(tl.int64), 0))
        slot_u = tl.where(on_bt, -1, u)           # the pages of the hot slots (hot rows only)
        if tl.max(slot_u, 0) >= 0:                # a row with none is left alone (slots.engine)
            m = _resolve_row(r, row, slot_u, jk, K, S, BT, SU, US, POL, SCR, VIC, COUNTS, LOCS,
                             s_bt, s_su, s_us, s_pol, lo, lo_rev, su_rev, blk, KB, SB, POLICY,
                             SHIFT, HIT)
            missed = (m > 0).to(tl.int32)
        else:
            tl.store(LOCS + r.to(tl.int64) * K + jk, blk, mask=jk < K)
    if HAS_HOT:
        tl.store(MISSED + r, missed)


def row_chunk(row_elems: int) -> int:
    """Elements of a page one IO program moves per load: the largest power of two dividing the
    page, at most 8192 (16 KiB of bf16: 64 per thread at 4 warps)."""
    ch = 1
    while ch < 8192 and row_elems % (2 * ch) == 0:
        ch *= 2
    return ch


def policy_constants(state) -> dict:
    """The RESOLVE kernels' policy arguments of a slots.HotBufferState (Triton's and the CUDA
    select's): POLICY = its branch id, SHIFT / HIT = its constants (0 where it has none); checks
    that its rows fit the branch (crf packs the slot of its victim key in 16 bits)."""
    most, S = state.policy.kernel_max_slots, state.slots
    assert most is None or S <= most, f"{state.policy.name}'s kernel holds at most {most} slots"
    return {"SHIFT": 0, "HIT": 0, **state.policy.kernel_constants, "POLICY": state.policy.kernel}


def select_resolve(scores: torch.Tensor, seq: torch.Tensor, num_full: torch.Tensor, k: int,
                   block_table: torch.Tensor, sel: torch.Tensor, locs: torch.Tensor,
                   scratch: torch.Tensor, victims: torch.Tensor, hot: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None, state=None,
                   host_pt: torch.Tensor | None = None, host: torch.Tensor | None = None,
                   kv: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                   fetch: bool = True, missed: torch.Tensor | None = None) -> None:
    """Launch on checked inputs (ops/decode_ops.py); also runs under TRITON_INTERPRET=1. Shapes as
    reference.select_resolve (fetch False: no miss copies, the misses left marked); scratch
    (N, SB) / victims (N, KB) int32 workspaces with SB, KB the powers of two >= S, k
    (select_widths); host on the device (the pool's CUDA alias); state a
    slots.HotBufferState whose policy has a kernel branch (POLICY = its ``kernel`` id); missed
    (N,) int32 (hot launches; allocated here when None)."""
    N, U = scores.shape
    if N == 0 or k == 0:
        return
    assert U < 1 << 16, "the top-k packs per-bin counts in 16 bits: rows of < 65536 pages"
    has_hot = hot is not None
    consts = {"POLICY": 0, "SHIFT": 0, "HIT": 0}
    if has_hot:
        su, us, pol = state.kernel_state()
        consts = policy_constants(state)
        S = su.shape[1]
        if missed is None:
            missed = torch.empty(N, dtype=torch.int32, device=scores.device)
    else:
        su = us = pol = host_pt = sel
        host = kv = scores
        hot = rows = seq
        counts = missed = seq
        S = 1
    KB, SB = select_widths(k, S)
    _select_kernel[(N,)](
        scores, seq, num_full, hot, rows, block_table, su, us, pol, scratch, victims, counts, sel,
        locs, missed, k, S, scores.stride(0), block_table.stride(0), su.stride(0), us.stride(0),
        pol.stride(0), UB=max(16, triton.next_power_of_2(U)), KB=KB, SB=SB, HAS_HOT=has_hot,
        BITS=RADIX_BITS, num_warps=SELECT_WARPS, **consts)
    if has_hot and fetch:
        miss_io(locs, sel, seq, num_full, hot, rows, host_pt, host, kv, k)


def miss_io(locs, sel, seq, num_full, hot, rows, host_pt, host, kv, k: int) -> None:
    """The miss copies of a select: every locs entry marked -2 - block gets its page from the host
    pool (host: the pool's CUDA alias) and then the block (one program per selection entry)."""
    N = locs.shape[0]
    if N == 0 or k == 0:
        return
    row = kv[0].numel()
    _miss_io_kernel[(N, k)](locs, sel, seq, num_full, hot, rows, host_pt, host, kv, k,
                            host_pt.stride(0), ROW=row, CH=row_chunk(row), num_warps=4)


def select_widths(k: int, S: int) -> tuple[int, int]:
    """(KB, SB): the register widths of a row's selection and slots (the workspaces' widths)."""
    return max(16, triton.next_power_of_2(k)), max(16, triton.next_power_of_2(S))
