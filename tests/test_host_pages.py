"""HostPageTable (core/host_pages.py, docs/design/prefix-caching.md section 3.3): host page ids
shared by block hash, scripted scenarios on a small table and random sequences against a plain
model (a dict of holders per page)."""
from __future__ import annotations

import random

import pytest
import torch

from vllm_hisparse.core.host_pages import HostPageTable

SEEDS = list(range(6))


def check(t: HostPageTable, held: dict[str, list[int]]) -> None:
    """Invariants: ref = request holders + index; free pages unheld; LRU = cache-only pages."""
    holders = [0] * t.num_pages
    for pages in held.values():
        for p in pages:
            holders[p] += 1
    indexed = set(t.index.values())
    assert len(indexed) == len(t.index)
    for p in range(t.num_pages):
        assert t.ref[p] == holders[p] + (p in indexed), p
    assert sorted(t._free) == [p for p in range(t.num_pages) if t.ref[p] == 0]
    assert set(t._lru) == {p for p in indexed if holders[p] == 0}
    assert t.used == t.num_pages - t.free


def test_share_publish_release():
    t = HostPageTable(8)
    a = t.acquire([], 3)
    assert a == [0, 1, 2] and t.free == 5
    assert t.publish("h0", a[0]) and t.publish("h1", a[1])
    assert not t.publish("h0", a[2])          # the hash has a copy already
    assert not t.publish("h9", a[0])          # the page is indexed already
    assert t.lookup(["h0", "h1", "h2"]) == [0, 1]
    assert t.lookup(["h1"]) == [1] and t.lookup(["hx", "h0"]) == []
    b = t.acquire(t.lookup(["h0", "h1"]), 2)
    assert b == [0, 1, 3, 4] and t.used == 5
    check(t, {"a": a, "b": b})
    t.release(a)                              # pages 0, 1 still b's and the index's; 2 free
    check(t, {"b": b})
    assert t.evictable == 0 and t.free == 4
    t.release(b)                              # 0, 1 cache-only now, 3, 4 free
    check(t, {})
    assert t.evictable == 2 and t.used == 2 == len(t.index)


def test_lru_evicts_cache_only_pages_oldest_first():
    t = HostPageTable(4)
    a, b = t.acquire([], 1), t.acquire([], 1)          # pages 0, 1
    t.publish("A", a[0])
    t.publish("B", b[0])
    t.release(a)
    t.release(b)                                       # LRU: A, B
    c = t.acquire(t.lookup(["A"]), 0)                  # A held again: not evictable
    assert t.evictable == 1 and t.can_take(3) and not t.can_take(4)
    d = t.acquire([], 3)                               # 2 free + B evicted
    assert sorted(d) == [1, 2, 3] and "B" not in t.index and t.index["A"] == 0
    check(t, {"c": c, "d": d})
    with pytest.raises(RuntimeError, match="can_acquire"):
        t.acquire([], 1)
    t.release(c)                                       # A cache-only again
    assert t.acquire([], 1) == [0] and t.index == {}


def test_lru_order_follows_release():
    t = HostPageTable(3)
    pages = t.acquire([], 3)
    for h, p in zip("xyz", pages):
        t.publish(h, p)
    t.release([pages[2]])
    t.release([pages[0]])
    t.release([pages[1]])                 # released z, x, y: evicted in that order
    assert t.take(1) == [2] and t.take(1) == [0] and list(t.index) == ["y"]


def test_resume_swaps_pages_others_read_and_unpublishes_the_rest():
    t = HostPageTable(8)
    a = t.acquire([], 4)                  # 0..3, all published
    for i, p in enumerate(a):
        t.publish(i, p)
    b = t.acquire(t.lookup([0, 1, 2]), 1)  # shares 0, 1, 2
    t.release(b[2:3] + b[3:])             # b drops page 2 and its own page (test shortcut)
    b = b[:2]
    # a resumes from token page 1: page 1 is b's too -> swapped; 2 only the index's -> unpublished;
    # 3 the same; page 0 below the start stays shared
    assert t.writable_cost(a, 1) == 1
    t.make_writable(a, 1)
    assert a[0] == 0 and a[1] not in (0, 1, 2, 3) and a[2:] == [2, 3]
    assert t.index == {0: 0, 1: 1}
    check(t, {"a": a, "b": b})
    assert t.ref[1] == 2                  # b and the index still read the old copy


def test_reset_drops_the_index_only():
    t = HostPageTable(6)
    a = t.acquire([], 3)
    for i, p in enumerate(a):
        t.publish(i, p)
    t.release(a[2:])
    a = a[:2]
    assert t.used == 3 and t.reset() == 3
    assert t.index == {} and t.evictable == 0 and t.used == 2
    check(t, {"a": a})
    t.release(a)
    assert t.used == 0


def test_publishing_off_shares_nothing():
    t = HostPageTable(4)
    t.publish_enabled = False
    a = t.acquire([], 2)
    assert not t.publish("h", a[0]) and t.lookup(["h"]) == []
    t.release(a)
    assert t.used == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sequences_against_a_plain_model(seed):
    """Requests acquire (sharing what the index holds of their hash chain), publish, resume and
    release at random; after every operation the invariants hold, no request's page is ever
    handed to another as fresh, and a page a request writes is read by no one else."""
    rng = random.Random(seed)
    t = HostPageTable(24)
    held: dict[int, list[int]] = {}
    chain_of: dict[int, list] = {}
    chains = [[(c, i) for i in range(6)] for c in range(4)]   # 4 conversations' hash chains
    nxt = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            chain = rng.choice(chains)
            hit = rng.randrange(7)
            shared = t.lookup(chain[:hit])
            life = rng.randrange(max(len(shared), 1), 7)
            fresh = life - len(shared)
            if not t.can_acquire(shared, fresh):
                assert not (fresh <= t.free + t.evictable - len(set(shared) & set(t._lru)))
                continue
            before = {p for ps in held.values() for p in ps}
            pages = t.acquire(shared, fresh)
            assert not (set(pages[len(shared):]) & before)          # fresh = nobody's
            held[nxt] = pages
            chain_of[nxt] = chain
            nxt += 1
        elif op < 0.6 and held:
            rid = rng.choice(list(held))
            pages = held[rid]
            upto = rng.randrange(len(pages) + 1)
            for p in range(upto):
                t.publish(chain_of[rid][p], pages[p])
        elif op < 0.75 and held:
            rid = rng.choice(list(held))
            pages = held[rid]
            first = rng.randrange(len(pages) + 1)
            if not t.can_take(t.writable_cost(pages, first)):
                continue
            t.make_writable(pages, first)
            others = {p for r, ps in held.items() if r != rid for p in ps}
            assert not (set(pages[first:]) & others)
            assert not (set(pages[first:]) & set(t.index.values()))
        elif held:
            rid = rng.choice(list(held))
            t.release(held.pop(rid))
        elif rng.random() < 0.1:
            t.reset()
        check(t, held)
    for rid in list(held):
        t.release(held.pop(rid))
    check(t, {})
    assert t.used == len(t.index)
    t.reset()
    assert t.used == 0



# ---- the worker side: a hit reading shared host pages (no engine) -------------------------------
def _shared_hit(host_tier: bool, poison: bool = False, shared_upto: int = 8):
    """Request a prefills 80 tokens (host pages 0..11 from the scheduler, here the test); b's first
    64 tokens are a prefix-cache hit on a's blocks (pages [0, S) its floor copies, [S, 8) a's
    blocks) and its host pages 0..7 are a's (shared, ``shared_upto`` 8), 8.. its own. b prefills
    8 more, decodes, is spilled to its floor (the Driver poisons the blocks it gives back, a's
    shared ones among them) and reads its prefix from a's host pages. poison: those shared pages
    are overwritten after a wrote them (the control). Returns (every layer's outputs of every step,
    stats, whether the shared host pages are byte-identical after b's steps)."""
    from test_sparse_runtime_exact import P, W, Driver
    from vllm_hisparse.config import HiSparseConfig

    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                         resident_first=True)
    S = cfg.num_slots
    d = Driver(cfg)
    d.add("a", 80)
    if host_tier:
        for layer in d.rt.pool.data:            # never-written pages read as NaN
            layer.fill_(float("nan"))
        d.rt.assign_host("a", list(range(12)), 0)
    d.step({"a": 80})
    d.rt.add("b", 72)
    d.blocks["b"] = torch.arange(1 + W, 1 + 2 * W, dtype=torch.int32)
    d.lens["b"], d.prompt["b"] = 64, 72
    for kv in d.kv:                                     # the floor's copies (vLLM's CoW)
        kv[d.blocks["b"][:S].long()] = kv[d.blocks["a"][:S].long()]
    d.blocks["b"][S:8] = d.blocks["a"][S:8]             # shared GPU blocks
    before = None
    if host_tier:
        d.rt.assign_host("b", list(range(8)) + list(range(100, 104)), shared_upto)
        if poison:
            d.rt.pool.data[:, :8] = 1.0e4
        before = d.rt.pool.data[:, :8].clone()
    d.step({"b": 8})
    for _ in range(2):
        d.step({"b": 1})
    d.spill("b", 0)
    for _ in range(6):
        d.step({"b": 1})
    untouched = before is None or torch.equal(d.rt.pool.data[:, :8], before)
    written = before is None or not torch.isnan(d.rt.pool.data[:, 100:102]).any()
    stats = d.rt.stats_dict()
    assert d.rt.finish("a") and d.rt.finish("b") and not d.rt.reqs
    assert d.rt.host_pages_used == 0
    return d.outs, stats, untouched and written


def test_a_hit_reads_the_shared_host_pages_and_never_writes_them():
    ref, _, _ = _shared_hit(False)                      # resident mode: the reference
    outs, stats, ok = _shared_hit(True)
    assert stats["misses"] > 0 and stats["spills"] == 1 and stats["prefix_hits"] == 1
    assert ok                                           # shared: untouched; its own: written
    assert len(outs) == len(ref) and all(torch.equal(a, b) for a, b in zip(outs, ref))
    bad, _, _ = _shared_hit(True, poison=True)          # b reads them: poisoned -> differs
    assert not all(torch.equal(a, b) for a, b in zip(bad, ref))


def test_a_start_inside_the_shared_pages_is_refused():
    with pytest.raises(RuntimeError, match="shared \\(read-only\\) host pages"):
        _shared_hit(True, shared_upto=9)                # starts at 64 < 9 pages x 8
