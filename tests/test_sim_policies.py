"""Cache policies on scripted scenarios over tiny buffers, through the runtime's resolve engine."""
import numpy as np
import pytest
import torch

from vllm_hisparse.slots.engine import HotBufferState, resolve
from vllm_hisparse.slots import available, make, online
from vllm_hisparse.slots.base import StepInfo, positions_of, reorder
from vllm_hisparse.sim import engine
from vllm_hisparse.sim.trace import Trace

A, B, C, D, E, F = range(6)


def run(policy, steps, slots=4, units=16, **kw):
    """Resolve one row through ``steps`` (lists of units); returns (misses per step, final state)."""
    st = HotBufferState.create(1, slots, units, make(policy, **kw) if kw else policy)
    out = []
    for t, sel in enumerate(steps):
        _, miss = resolve(st, torch.tensor([sel], dtype=torch.int32), step=t)
        out.append([u for u, m in zip(sel, miss[0].tolist()) if m])
    return out, st


def test_lru_evicts_least_recent_in_selection_order():
    # B=4: A B C D then A E -> E replaces B (A was hit; B is the oldest entry of the first step).
    misses, st = run("lru", [[A, B, C, D], [A, E]])
    assert misses == [[A, B, C, D], [E]]
    assert st.resident_units(0) == {A, C, D, E}


def test_lru_hit_refreshes_and_fifo_does_not():
    steps = [[A, B, C, D], [A], [E]]
    _, lru = run("lru", steps)
    _, fifo = run("fifo", steps)
    assert lru.resident_units(0) == {A, C, D, E}     # A was refreshed, B is oldest: evicted
    assert fifo.resident_units(0) == {B, C, D, E}    # A entered first: evicted despite the hit


def test_vanilla_keeps_only_the_last_selection():
    misses, st = run("vanilla", [[A, B], [B, C], [A, C]])
    assert misses == [[A, B], [C], [A]]
    assert st.resident_units(0) == {A, C}


def test_random_is_seeded():
    g = torch.Generator().manual_seed(3)
    steps = [torch.randperm(12, generator=g)[:3].tolist() for _ in range(40)]
    a, _ = run("random", steps, seed=7)
    b, _ = run("random", steps, seed=7)
    c, _ = run("random", steps, seed=8)
    assert a == b
    assert a != c


def test_belady_evicts_the_farthest_next_use():
    # S=2, one unit per step: A B C A B. At C, A is needed at step 3 and B at step 4: evict B.
    seq = [A, B, C, A, B]
    sel = np.array(seq, np.int64)[:, None, None]
    oracle = engine.NextUse(sel, 8)
    st = HotBufferState.create(1, 2, 8, make("belady", next_use=oracle))
    misses = []
    for t, u in enumerate(seq):
        _, m = resolve(st, torch.tensor([[u]], dtype=torch.int32), step=t)
        oracle.advance(t)
        misses.append(bool(m[0, 0]))
    assert misses == [True, True, True, False, True]          # LRU would miss all five


def test_belady_without_oracle_refuses():
    with pytest.raises(RuntimeError, match="simulator only"):
        run("belady", [[A], [B]], slots=1)


def test_crf_keeps_a_frequent_unit_through_one_off_selections():
    steps = [[A], [A], [A], [B], [C], [D]]
    _, lru = run("lru", steps, slots=3)
    _, crf = run("crf", steps, slots=3)
    assert A not in lru.resident_units(0)
    assert crf.resident_units(0) == {A, C, D}                # B, seen once, went first


def test_crf_decay_sets_the_memory():
    # A selected 3x long ago, B 2x recently: a long memory (decay 15/16) keeps A, a short one
    # (decay 1/2) keeps B. Values: shift 4: A 2140 vs B 1504; shift 1: A 416 vs B 1280.
    steps = [[A], [A], [A], [B], [B], [C]]
    _, slow = run("crf", steps, slots=2)
    _, fast = run("crf", steps, slots=2, shift=1)
    assert slow.resident_units(0) == {A, C} and fast.resident_units(0) == {B, C}


def test_crf_ties_go_to_the_lower_slot():
    # A, B, C fetched together (equal values); A is hit again; D takes B's slot (slot 1 < slot 2).
    _, crf = run("crf", [[A, B, C], [A], [D]], slots=3)
    assert crf.resident_units(0) == {A, C, D} and int(crf.slot_unit[0, 1]) == D


def test_crf_rejects_bad_shift():
    with pytest.raises(ValueError, match="shift"):
        make("crf", shift=9)


def test_registry_lists_choices_and_online_excludes_belady():
    assert {"lru", "fifo", "random", "vanilla", "belady", "crf"} <= set(available())
    assert "belady" not in online() and "crf" in online()
    with pytest.raises(ValueError, match="choose one of"):
        make("nope")


def _random_trace(seed, steps=40, layers=3, k=6, ctx0=30):
    g = np.random.default_rng(seed)
    ctx = (ctx0 + np.arange(steps)).astype(np.int32)
    pos = np.full((steps, layers, k), -1, np.int32)
    for t in range(steps):
        for layer in range(layers):
            # skewed popularity, like attention: a few units are picked often
            p = 1.0 / (1 + np.arange(ctx[t])) ** 0.8
            pos[t, layer] = g.choice(ctx[t], size=k, replace=False, p=p / p.sum())
    return Trace(pos, ctx, {"model": "random", "text": "-", "indexer": "random", "unit": 1, "k_max": k})


@pytest.mark.parametrize("wa", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_beats_every_online_policy_on_random_traces(seed, wa):
    tr = _random_trace(seed)
    cfgs = [engine.Config(6, 7, wa), engine.Config(6, 12, wa), engine.Config(3, 8, wa)]
    best = [m.sum() for m in engine.replay(tr, "belady", cfgs).misses]
    for name in online():
        got = [m.sum() for m in engine.replay(tr, name, cfgs, seed=seed).misses]
        assert all(b <= g for b, g in zip(best, got)), (name, best, got)


def test_sort_free_reorder_matches_the_sort_formulation():
    """slots/base.reorder must equal sorting the keys hits k-1-j, misses 2k-1-j, rest 2k+pos."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        R, S = 3, int(torch.randint(2, 20, (1,), generator=g))
        k = int(torch.randint(1, S + 1, (1,), generator=g))
        order = torch.stack([torch.randperm(S, generator=g) for _ in range(R)])
        locs = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(R)])
        kind = torch.randint(0, 3, (R, k), generator=g)             # 0 pad, 1 hit, 2 miss
        hit, miss = kind == 1, kind == 2
        locs = torch.where(kind > 0, locs, -1)
        info = StepInfo(torch.zeros(R, k, dtype=torch.int32), locs, hit, miss, torch.arange(R))
        for hk, mk in [(True, True), (False, True)]:
            key = positions_of(order) + 2 * k
            j = torch.arange(k - 1, -1, -1).expand(R, k)
            for use, mask, off in [(hk, hit, 0), (mk, miss, k)]:
                if use:
                    for r in range(R):
                        key[r, locs[r][mask[r]]] = (j + off)[r][mask[r]]
            assert torch.equal(reorder(order, info, hk, mk), torch.argsort(key, dim=1))
