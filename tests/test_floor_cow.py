"""Prefix caching step 1 (docs/design/prefix-caching.md), without an engine: the KV manager's
floor copy-on-write on a real vLLM BlockPool (a hit block 0 becomes a private copy, the rest stays
shared), the worker's RequestRows refusing two batch rows on one block 0, and the runtime's
first-step switch folding a hit's prefix into its fresh Quest row (section 3.2)."""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import L, P, W, Driver
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.deployment import EngineLimits, resolve

PAGE = 16


def manager(num_blocks, floor=1):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_hisparse.vllm.spec import HiSparseManager, HiSparseSpec

    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=PAGE, min_context=64,
                         host_tier=False)
    spec = HiSparseSpec(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32,
                        deployment=resolve(cfg, EngineLimits(4, 1024, 16, 2, 32, 4)))
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=PAGE)
    m = HiSparseManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                        scheduler_block_size=PAGE)
    m.floor_blocks = floor
    return m, pool


def admit(m, rid, hits, tokens):
    """What KVCacheManager.allocate_slots does for a new request with prefix-cache hits ``hits``
    (len(hits) * PAGE tokens computed); returns the count it checked against the free blocks."""
    n = m.get_num_blocks_to_allocate(rid, tokens, hits, len(hits) * PAGE, len(hits) * PAGE,
                                     tokens)
    if hits:
        m.add_local_computed_blocks(rid, hits, len(hits) * PAGE, 0)
    m.allocate_new_blocks(rid, tokens, tokens)
    return n


@pytest.mark.vllm
def test_a_hit_block_0_is_copied_the_rest_shared():
    m, pool = manager(41)                             # 40 usable blocks
    admit(m, "a", [], 5 * PAGE)                       # a computes pages 0..4 itself
    a = list(m.req_to_blocks["a"])
    assert pool.get_num_free_blocks() == 35
    n = admit(m, "b", a[:4], 6 * PAGE)                # b hits a's pages 0..3
    assert n == 2 + 1                                 # pages 4, 5 + the floor's copy
    b = m.req_to_blocks["b"]
    assert b[0] is not a[0] and b[1:4] == a[1:4] and len(b) == 6
    assert pool.get_num_free_blocks() == 35 - 3
    # the copy (source, private block) waits for the scheduler; both endpoints retained
    copies = m.take_pending_cow_copies()
    assert copies == [(a[0], b[0])]
    assert a[0].ref_cnt == 2 and b[0].ref_cnt == 2 and a[1].ref_cnt == 2
    pool.free_blocks([blk for pair in copies for blk in pair])   # _free_cow_retained_blocks
    assert a[0].ref_cnt == 1 and b[0].ref_cnt == 1
    # the copy is never hashed by b's cache_blocks: the cache keeps the source
    assert m.num_cached_block["b"] == 4
    for rid in ("a", "b"):
        m.free(rid)
    assert pool.get_num_free_blocks() == 40 and not m._floor_cow


@pytest.mark.vllm
def test_a_hit_on_blocks_computed_in_this_step_waits_for_the_next():
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import BlockHash

    m, pool = manager(41)
    m.new_step_starts()
    admit(m, "a", [], 3 * PAGE)
    req = SimpleNamespace(request_id="a", num_prompt_tokens=3 * PAGE, shared_prefix_boundary=None,
                          block_hashes=[BlockHash(bytes([i]) * 32) for i in range(3)])
    m.cache_blocks(req, 3 * PAGE)                     # hashed now, computed by this step
    a = list(m.req_to_blocks["a"])
    assert all(b.block_hash is not None for b in a)
    assert m.get_num_blocks_to_allocate("b", 4 * PAGE, a[:2], 32, 32, 4 * PAGE) == 41 + 1
    m.new_step_starts()                               # a's prefill ran: b may hit it now
    assert admit(m, "b", a[:2], 4 * PAGE) == 2 + 1


@pytest.mark.vllm
def test_floor_0_shares_block_0_and_a_request_freed_before_allocation_leaves_nothing():
    m, pool = manager(41, floor=0)                    # the negative control's manager
    admit(m, "a", [], 3 * PAGE)
    a = list(m.req_to_blocks["a"])
    assert admit(m, "b", a[:2], 3 * PAGE) == 1
    assert m.req_to_blocks["b"][0] is a[0] and not m.take_pending_cow_copies()
    m2, pool2 = manager(41)
    admit(m2, "a", [], 3 * PAGE)
    hits = list(m2.req_to_blocks["a"][:2])
    m2.add_local_computed_blocks("c", hits, 2 * PAGE, 0)       # allocated, then aborted
    assert "c" in m2._floor_cow
    m2.free("c")
    assert "c" not in m2._floor_cow and not m2.take_pending_cow_copies()
    m2.free("a")
    assert pool2.get_num_free_blocks() == 40


@pytest.mark.vllm
def test_request_rows_refuse_two_rows_on_one_block_0():
    from vllm_hisparse.vllm.request_rows import RequestRows

    rows = RequestRows()
    rows.bind("a", 7)
    rows.bind("b", 9)
    assert rows.ids_of([7, 9]) == ["a", "b"]
    rows.bind("c", 7)                 # a was preempted (its blocks freed): c takes block 7
    assert rows.req_to_block == {"b": 9, "c": 7} and rows.ids_of([7]) == ["c"]
    rows.bind("a", 11)                # a resumes on a new block 0
    assert rows.ids_of([11, 7]) == ["a", "c"]
    with pytest.raises(RuntimeError, match="share first blocks \\[7\\]"):
        rows.ids_of([7, 9, 7])
    for rid in ("a", "b", "c"):
        rows.unbind(rid)
    assert not rows.req_to_block and not rows.block_to_req


def _hit_run(switch: bool):
    """Resident mode: request a prefills 40 tokens (sparse: min_context 32); request b's first 32
    tokens are a prefix-cache hit on a's blocks (logical pages 0..3; its block 0 would be the
    floor's copy, the same bytes) and its first step prefills 8 more. Returns b's and a's Quest
    bounds (kmin, kmax of sparse layer 1, pages 0..3) and the stats."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=32, host_tier=False)
    d = Driver(cfg)
    d.add("a", 40)
    d.step({"a": 40})
    d.add("b", 40)
    d.blocks["b"][:4] = d.blocks["a"][:4]            # shared pages (the floor copy: same bytes)
    d.lens["b"] = 32
    if not switch:
        d.rt.reqs["b"].fresh = False
    d.step({"b": 8})
    ix, ra, rb = d.rt.ix, d.rt.reqs["a"].irow, d.rt.reqs["b"].irow
    rows = [(ix.kmin[1][r, :4].clone(), ix.kmax[1][r, :4].clone()) for r in (rb, ra)]
    stats = d.rt.stats_dict()
    assert d.rt.finish("a") and d.rt.finish("b") and not d.rt.reqs
    return rows, stats


def test_first_step_of_a_hit_folds_the_prefix_into_its_quest_row():
    (b, a), stats = _hit_run(True)
    assert stats["prefix_hits"] == 1
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1])      # bit for bit, pages 0..3
    (b, a), stats = _hit_run(False)                                   # the switch off
    assert stats["prefix_hits"] == 0
    assert not (torch.equal(b[0], a[0]) and torch.equal(b[1], a[1]))


def _hostless_hit_moved(host_tier: bool, copy: bool = True):
    """Step 2a's host-less path: request b runs host-less with a prefix-cache hit of 64 tokens
    on a's blocks (pages [0, S) its private floor copies, the same bytes; pages [S, 8) a's
    blocks, shared), moves into the host tier (core/hostless.py ``host_back``: its next step
    copies [0, start) from its GPU blocks, the shared ones included, to its new host pages),
    then is spilled to its floor: the pages it gives back (a's blocks among them) are poisoned
    after every step (Driver), so it reads them from that copy. copy False: the move's copy is
    skipped (the control). Returns every layer's outputs of every step."""
    from vllm_hisparse.core.hostless import host_back

    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                         resident_first=True)
    S = cfg.num_slots
    d = Driver(cfg)
    if host_tier:                  # never-written host pages read as NaN (not a previous run's)
        for layer in d.rt.pool.data:
            layer.fill_(float("nan"))
    d.add("a", 80)
    d.step({"a": 80})
    d.rt.add("b", 72, hostless=host_tier)
    d.blocks["b"] = torch.arange(1 + W, 1 + 2 * W, dtype=torch.int32)
    d.lens["b"], d.prompt["b"] = 64, 72
    for kv in d.kv:                                     # the floor's copies (vLLM's CoW)
        kv[d.blocks["b"][:S].long()] = kv[d.blocks["a"][:S].long()]
    d.blocks["b"][S:8] = d.blocks["a"][S:8]             # shared
    d.step({"b": 8})                                    # host-less: its Quest row only
    for _ in range(3):
        d.step({"b": 1})
    host_back(d.rt, "b")
    if not copy:
        d.rt.reqs["b"].moving = False
    d.step({"b": 1})
    d.spill("b", 0)
    for _ in range(6):
        d.step({"b": 1})
    stats = d.rt.stats_dict()
    assert d.rt.finish("a") and d.rt.finish("b") and not d.rt.reqs
    return d.outs, stats


def test_a_hostless_hit_moved_into_the_host_tier_reads_its_shared_prefix_from_its_host_copy():
    ref, _ = _hostless_hit_moved(False)                  # resident mode: the reference
    outs, stats = _hostless_hit_moved(True)
    assert stats["misses"] > 0 and stats["spills"] == 1 and stats["prefix_hits"] == 1
    assert len(outs) == len(ref) and all(torch.equal(a, b) for a, b in zip(outs, ref))
    bad, _ = _hostless_hit_moved(True, copy=False)
    same = [torch.equal(a, b) for a, b in zip(bad, ref)]
    assert all(same[:L * 6]) and not all(same)           # equal until the first step after the move
