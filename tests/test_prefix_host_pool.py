"""Prefix caching with the host tier, step 2a (docs/design/prefix-caching.md), without an engine:
the KV manager on a real vLLM BlockPool. The floor is the S hot slots (F = S: a hit's blocks
[0, S) become private copies); a request's own hashed slots are donated (their cache entries moved
to fresh copies, queued for the step's forward) in the step its slots are first overwritten, or
dropped when no block is free; copies never land on a block given back in the same step (the
worker's plan still reads those). Step 2b: the scheduler connector's shared host pages (share at
admission, publish of running requests' complete pages, the resumption swap / unpublish, release,
reset; admission counting fresh pages only; publishing off shares nothing)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.deployment import EngineLimits, resolve

pytestmark = pytest.mark.vllm
PAGE, S = 16, 4                   # device_buffer_size 64 / page 16: four hot slots


def manager(num_blocks: int):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_hisparse.vllm.spec import HiSparseManager, HiSparseSpec

    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=PAGE, min_context=64,
                         host_tier=True, resident_first=False, host_pool_gib=0.05)
    spec = HiSparseSpec(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32,
                        deployment=resolve(cfg, EngineLimits(4, 1024, 16, 2, 32, 4)))
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=PAGE)
    m = HiSparseManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                        scheduler_block_size=PAGE)
    return m, pool


def request(rid: str, pages: int, seed: int = 0):
    from vllm.v1.core.kv_cache_utils import BlockHash

    return SimpleNamespace(request_id=rid, num_prompt_tokens=pages * PAGE, num_computed_tokens=0,
                           shared_prefix_boundary=None,
                           block_hashes=[BlockHash(bytes([seed, i]) * 16) for i in range(pages)])


def prefill(m, req, pages: int) -> list:
    """Request ``req`` computes its ``pages``-page prompt itself in one step (hashed)."""
    m.allocate_new_blocks(req.request_id, pages * PAGE, pages * PAGE)
    m.cache_blocks(req, pages * PAGE)
    assert m.take_pending_cow_copies() == []          # its slots hold its own pages still
    return list(m.req_to_blocks[req.request_id])


def first_decode(m, req, pages: int) -> None:
    """The next step: its first decode row, at its floor (pages [S, pages) given back)."""
    m.new_step_starts()
    m.remove_skipped_blocks(req.request_id, pages * PAGE, pages * PAGE)
    m.allocate_new_blocks(req.request_id, pages * PAGE + 1, pages * PAGE + 1)
    req.num_computed_tokens = pages * PAGE
    m.cache_blocks(req, pages * PAGE + 1)


def test_the_floor_is_the_hot_slots_with_the_host_tier():
    m, pool = manager(41)                             # 40 usable blocks
    assert m.floor_blocks == S
    a = prefill(m, request("a", 6), 6)
    m.new_step_starts()
    n = m.get_num_blocks_to_allocate("b", 7 * PAGE, a[:5], 5 * PAGE, 5 * PAGE, 7 * PAGE)
    assert n == 2 + S                                 # pages 5, 6 + the floor's copies
    m.add_local_computed_blocks("b", a[:5], 5 * PAGE, 0)
    m.allocate_new_blocks("b", 7 * PAGE, 7 * PAGE)
    b = m.req_to_blocks["b"]
    assert all(b[i] is not a[i] for i in range(S)) and b[S] is a[S] and len(b) == 7
    copies = m.take_pending_cow_copies()
    assert copies == [(a[i], b[i]) for i in range(S)]
    assert all(a[i].ref_cnt == 2 and b[i].ref_cnt == 2 for i in range(S)) and a[S].ref_cnt == 2
    pool.free_blocks([blk for pair in copies for blk in pair])   # _free_cow_retained_blocks
    assert all(a[i].ref_cnt == 1 and b[i].ref_cnt == 1 for i in range(S))
    assert all(b[i].block_hash is None for i in range(S))       # copies are never hashed
    for rid in ("a", "b"):
        m.free(rid)
    assert pool.get_num_free_blocks() == 40


def test_hashed_slots_are_donated_in_the_step_they_are_first_overwritten():
    m, pool = manager(41)
    req = request("a", 6)
    a = prefill(m, req, 6)
    hashes = [blk.block_hash for blk in a]
    first_decode(m, req, 6)                           # pages 4, 5 given back: slots written now
    assert m.req_to_blocks["a"][S].is_null and a[S].ref_cnt == 0
    copies = m.take_pending_cow_copies()
    assert [src for src, _ in copies] == a[:S] and m.donation == {"donated": S, "dropped": 0}
    from vllm_hisparse.vllm.spill_ledger import ledger_of
    assert ledger_of(pool).donation is m.donation        # what the connector reports (/metrics)
    for i, (src, dst) in enumerate(copies):
        assert src.block_hash is None and dst.block_hash == hashes[i]
        assert pool.get_cached_block(req.block_hashes[i], [0]) == [dst]
        assert src.ref_cnt == 2 and dst.ref_cnt == 1                 # owner + retention; retention
        assert dst.block_id not in {blk.block_id for blk in a[S:]}  # not a page given back now
    pool.free_blocks([blk for pair in copies for blk in pair])   # after the copies were queued
    assert all(src.ref_cnt == 1 and dst.ref_cnt == 0 for src, dst in copies)
    assert pool.get_cached_block(req.block_hashes[S], [0]) == [a[S]]   # given back, still cached
    m.new_step_starts()                               # once per request: nothing more
    m.cache_blocks(req, 6 * PAGE + 2)
    assert m.take_pending_cow_copies() == []
    # a later hit on the donated prefix takes the copies, and copies them again (F = S)
    hits = [dst for _, dst in copies] + [a[S]]
    m.add_local_computed_blocks("b", hits, 5 * PAGE, 0)
    m.allocate_new_blocks("b", 6 * PAGE, 6 * PAGE)
    assert [src for src, _ in m.take_pending_cow_copies()] == hits[:S]


def test_without_a_free_block_the_entries_are_dropped_never_left():
    m, pool = manager(9)                              # 8 usable: a's 6 + its decode page + 1
    req = request("a", 6)
    a = prefill(m, req, 6)
    first_decode(m, req, 6)                           # frees 4, 5; takes one: 3 free
    free = {blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()}
    given_back = {a[4].block_id, a[5].block_id}
    assert given_back < free and len(free) == 3
    copies = m.take_pending_cow_copies()
    # one block that no plan reads: a[0]'s entries move there; the pages given back in this step
    # are never a copy's destination (the worker's plan still reads them): the rest are dropped
    assert len(copies) == 1 and copies[0][0] is a[0]
    assert copies[0][1].block_id in free - given_back
    assert m.donation == {"donated": 1, "dropped": S - 1}
    assert all(blk.block_hash is None for blk in a[:S])
    assert all(pool.get_cached_block(req.block_hashes[i], [0]) is None for i in range(1, S))


def test_a_slot_hashed_after_the_donation_is_dropped_at_once():
    """A block whose hash is known only after the step its slots were first overwritten (vLLM
    caches up to the tokens it knows: under async scheduling an output token is known a step
    late): its bytes may be another page's by then, so its entries go at once."""
    m, pool = manager(41)
    req = request("a", 6)
    m.allocate_new_blocks("a", 6 * PAGE, 6 * PAGE)
    m.cache_blocks(req, 3 * PAGE)                     # tokens of pages 3.. not known yet
    a = list(m.req_to_blocks["a"])
    m.take_pending_cow_copies()
    m.new_step_starts()
    m.remove_skipped_blocks("a", 6 * PAGE, 6 * PAGE)
    m.allocate_new_blocks("a", 6 * PAGE + 1, 6 * PAGE + 1)
    req.num_computed_tokens = 6 * PAGE
    m.cache_blocks(req, 3 * PAGE)
    assert len(m.take_pending_cow_copies()) == 3      # the hashed slots 0..2
    m.new_step_starts()
    m.cache_blocks(req, 6 * PAGE + 1)                 # slot 3 hashed now: dropped
    assert a[3].block_hash is None and m.donation == {"donated": 3, "dropped": 1}
    assert pool.get_cached_block(req.block_hashes[3], [0]) is None


def _given_back_step(num_blocks: int):
    """c's 2-page prompt cached and free; a at its first decode step, its pages 4, 5 given back
    in this step (still free): ``num_blocks - 1 - 7 + 2`` free blocks."""
    m, pool = manager(num_blocks)
    c = prefill(m, request("c", 2, seed=1), 2)
    m.free("c")
    req = request("a", 6)
    a = prefill(m, req, 6)
    first_decode(m, req, 6)
    return m, pool, c, {a[4].block_id, a[5].block_id}


def test_a_hit_copied_in_a_step_with_pages_given_back_waits_when_too_few_others():
    """The floor's copies must not land on blocks given back in this step (the worker's plan
    still reads them after vLLM's copies ran): with fewer other free blocks than copies (the
    evictable hits, touched first, not counted) the request waits a step."""
    m, pool, c, _ = _given_back_step(11)              # 10 usable: 5 free, 2 given back now
    assert pool.get_num_free_blocks() == 5
    args = ("b", 3 * PAGE, c, 2 * PAGE, 2 * PAGE, 3 * PAGE)
    n_now = m.get_num_blocks_to_allocate(*args)       # others: 5 - 2 - c's 2 = 1 < 2 copies
    m.new_step_starts()
    n_next = m.get_num_blocks_to_allocate(*args)
    assert n_next == 1 + 2 + 2                        # its new page, c's 2 cached blocks, 2 copies
    assert n_now > pool.num_gpu_blocks > pool.get_num_free_blocks() >= n_next


def test_a_hit_copied_in_a_step_with_pages_given_back_is_admitted_with_enough_others():
    """Enough other free blocks for the copies: the count is what allocation takes (its new
    page, the evictable hits, the copies), not more, so a resident_first admission that spilled
    in this very step (its spills are given-back blocks) is not put off a step; the copies land
    on the others."""
    m, pool, c, given_back = _given_back_step(12)     # 11 usable: 6 free, 2 given back now
    assert pool.get_num_free_blocks() == 6
    n = m.get_num_blocks_to_allocate("b", 3 * PAGE, c, 2 * PAGE, 2 * PAGE, 3 * PAGE)
    assert n == 1 + 2 + 2 <= pool.get_num_free_blocks()    # (counting those 2 too: 7 > 6)
    m.add_local_computed_blocks("b", c, 2 * PAGE, 0)
    m.allocate_new_blocks("b", 3 * PAGE, 3 * PAGE)
    copies = m.take_pending_cow_copies()
    assert [src for src, _ in copies] == c
    assert not {dst.block_id for _, dst in copies} & given_back


# ---- step 2b: the scheduler connector's shared host pages (core/host_pages.py) ---------------------
def _req(rid: str, hashes: list, prompt: int, max_tokens: int = 16):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, max_tokens=max_tokens,
                           num_tokens=prompt, block_hashes=list(hashes))


def _running(*rids_computed):
    """A SchedulerOutput whose scheduled_cached_reqs are running requests (not resumed) with
    their num_computed_tokens before the step."""
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=[r for r, _ in rids_computed], resumed_req_ids=set(),
        new_block_ids=[None] * len(rids_computed),
        num_computed_tokens=[n for _, n in rids_computed]))


def test_connector_shares_publishes_swaps_at_resumption_and_releases():
    """a (160-token prompt, 11 pages of life) is admitted, runs, publishes its 10 full pages; b
    hits a's first 6 pages and shares them; b resumes with a shorter hit (64 tokens): its shared
    pages 4, 5 (a reads them) are swapped for fresh ones; a resumes from 0: its pages b reads are
    swapped, those only the index holds unpublished. After both are released the index holds the
    rest; a reset frees everything."""
    from test_hostless_admission import make, sched_out

    conn, _, _ = make(quest_rows=4)
    conn._shared.guard = None     # stand-in requests: no KV manager hashed a block (the guard: below)
    hp = conn.host_pages
    ha = [("a", p) for p in range(10)]
    a = _req("a", ha, 160)
    assert conn.get_num_new_matched_tokens(a, 0) == (0, False)
    pa = list(conn._pages["a"])
    assert len(pa) == 11 and hp.used == 11
    md = conn.build_connector_meta(sched_out(new=[("a", 1)]))
    assert md.pages == {"a": (pa, 0)}
    conn.build_connector_meta(_running(("a", 160)))      # its prefill ran: 10 full pages
    assert hp.lookup(ha) == pa[:10] and hp.used == 11
    b = _req("b", ha[:6] + [("b", p) for p in range(6, 8)], 128)
    assert conn.get_num_new_matched_tokens(b, 96) == (0, False)
    pb = conn._pages["b"]
    assert pb[:6] == pa[:6] and not set(pb[6:]) & set(pa) and len(pb) == 9
    assert conn._shared_upto["b"] == 6 and hp.used == 11 + 3
    assert conn.build_connector_meta(sched_out(new=[("b", 40)])).pages["b"] == (pb, 6)
    # b preempted, resumed with 64 tokens hit: pages 4, 5 are a's (and the index's): swapped
    assert conn.get_num_new_matched_tokens(b, 64) == (0, False)
    pb = conn._pages["b"]
    assert pb[:4] == pa[:4] and not set(pb[4:]) & set(pa) and conn._shared_upto["b"] == 4
    assert hp.used == 11 + 5
    # a resumed from token 0: pages 0..3 b reads -> swapped, 4..9 only the index's -> unpublished
    assert conn.get_num_new_matched_tokens(a, 0) == (0, False)
    pa2 = conn._pages["a"]
    assert not set(pa2[:4]) & set(pb) and pa2[4:] == pa[4:]
    assert hp.lookup(ha) == pa[:4] and len(hp.index) == 4
    # released (the worker's drop report): the index keeps pages 0..3, cache-only
    conn._release("a")
    conn._release("b")
    assert hp.used == len(hp.index) == hp.evictable == 4 and sum(hp.ref) == 4
    assert conn.reset_cache() is True and hp.used == 0


def test_connector_without_publishing_shares_nothing_and_admission_counts_fresh_pages():
    """Publishing off: the same admissions hold a private page for every page of every life.
    Admission counts fresh pages only: with the pool nearly full, a hit on published pages is
    admitted where a miss of the same life waits."""
    from test_hostless_admission import make

    conn, _, _ = make(quest_rows=4, hostless="wait")
    conn._shared.guard = None      # stand-in requests (as above)
    hp = conn.host_pages
    hashes = [("s", p) for p in range(40)]
    big = _req("big", hashes, 640, 16)                  # 41 pages of the 80
    assert conn.get_num_new_matched_tokens(big, 0) == (0, False)
    conn.build_connector_meta(_running(("big", 640)))   # publishes pages 0..39
    mid = _req("mid", [("m", p) for p in range(30)], 480, 16)   # 31 pages: 72 of 80 held
    assert conn.get_num_new_matched_tokens(mid, 0) == (0, False)
    miss = _req("miss", [("x", p) for p in range(20)], 320, 16)   # 21 fresh: waits
    assert conn.get_num_new_matched_tokens(miss, 0) == (None, False)
    hit = _req("hit", hashes[:20], 320, 16)              # 20 shared + 1 fresh: admitted
    assert conn.get_num_new_matched_tokens(hit, 320) == (0, False)
    assert conn._shared_upto["hit"] == 20 and hp.used == 73
    off, _, _ = make(quest_rows=4, hostless="wait")
    off._shared.guard = None      # stand-in requests (as above)
    off.host_pages.publish_enabled = False
    assert off.get_num_new_matched_tokens(_req("big", hashes, 640, 16), 0) == (0, False)
    off.build_connector_meta(_running(("big", 640)))
    assert off.host_pages.index == {}
    assert off.get_num_new_matched_tokens(_req("mid", [("m", p) for p in range(30)], 480, 16),
                                          0) == (0, False)
    assert off.get_num_new_matched_tokens(_req("hit", hashes[:20], 320, 16), 320) == (None, False)


def test_a_hostless_hit_moving_into_the_host_tier_shares_the_published_pages():
    """h (a 20-page hit on big's published pages, 30 pages of life) finds 8 free pages: host-less.
    Once mid is released, it moves into the host tier (``_move_to_host``) taking big's 20 pages
    shared and 10 fresh; the worker learns both (``md.pages``, shared_upto 20)."""
    from test_hostless_admission import make

    conn, _, _ = make(quest_rows=4)
    conn._shared.guard = None     # stand-in requests: no KV manager hashed a block (the guard: below)
    hp = conn.host_pages
    hashes = [("s", p) for p in range(40)]
    assert conn.get_num_new_matched_tokens(_req("big", hashes, 640, 16), 0) == (0, False)
    conn.build_connector_meta(_running(("big", 640)))
    assert conn.get_num_new_matched_tokens(_req("mid", [("m", p) for p in range(30)], 480, 16),
                                           0) == (0, False)
    h = _req("h", hashes[:20] + [("h", p) for p in range(20, 29)], 464, 16)
    assert conn.get_num_new_matched_tokens(h, 320) == (0, False)
    assert conn._hostless == {"h": 30} and "h" not in conn._pages
    conn._release("mid")
    md = conn.build_connector_meta(_running(("big", 641), ("h", 464)))
    assert md.hosted == ["h"]
    pages, upto = md.pages["h"]
    assert upto == 20 and pages[:20] == conn._pages["big"][:20] and len(pages) == 30
    assert not set(pages[20:]) & set(conn._pages["big"])
    conn._release("h")
    conn._release("big")
    assert hp.used == len(hp.index) == 40 and conn.reset_cache() and hp.used == 0


def test_a_page_is_shared_only_while_a_hit_reads_the_block_its_copy_came_from():
    """vllm/publish_guard.py: each published host page keeps the GPU block its bytes came from; a
    hit shares the page only while vLLM's lookup for the hash returns that block. A duplicate
    computed by another request does not void it while the source is cached first; once the
    source is evicted (the lookup returns the duplicate: other bytes in bf16) or reused for a
    recompute of the same hash, the entry is void. A donation moves the source to its copy."""
    m, pool = manager(41)
    guard = m._shared.guard
    ra = request("a", 6)
    a = prefill(m, ra, 6)
    h = ra.block_hashes
    assert all(guard.publishable("a", p, h[p]) for p in range(6))
    assert not guard.publishable("a", 0, h[1])                  # another page's hash
    assert not guard.publishable("x", 0, h[0])                  # a request that read nothing
    assert all(guard.valid(h[p]) for p in range(6))
    # c computes the same prompt itself (no hit taken): duplicates; the lookup still returns a's
    m.new_step_starts()
    c = prefill(m, request("c", 6), 6)
    assert all(c[p] is not a[p] for p in range(6)) and all(guard.valid(h[p]) for p in range(3))
    # a's blocks go back and are evicted: a hit now reads c's bytes -> a's copies are void
    m.free("a")
    for blk in a[3:]:
        pool.evict_blocks({blk.block_id})
    assert all(guard.valid(h[p]) for p in range(3)) and not any(guard.valid(h[p]) for p in (3, 4, 5))
    assert guard.dropped == 3 and not guard.valid(h[3])          # dropped, stays dropped
    # c publishes its own copies of pages 3..5 (the lookup's block now)
    assert all(guard.publishable("c", p, h[p]) and guard.valid(h[p]) for p in (3, 4, 5))
    # c's block 5 recomputed for the same hash (evicted and reused: the manager hashes it for a
    # computation again): c's record is void, its generation moved on
    guard.computed("z", 5, c[5])
    assert not guard.valid(h[5]) and guard.valid(h[4])
    # a donation moves c's source of page 3 to its copy: still valid there
    dst = pool.get_new_blocks(1)[0]
    pool.move_block_hashes(c[3], dst)
    guard.moved(c[3], dst)
    assert guard.valid(h[3]) and c[3].block_hash is None
