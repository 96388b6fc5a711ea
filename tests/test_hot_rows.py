"""Seeded hot slots (core/hot_rows.py): at a row's first step through its hot slots, slot s holds
page s (s < S), which the floor's blocks hold since the prompt. The engine's seed against the
policies' rules; the runtime seeds exactly once per (re)start; outputs equal resident mode's and
the unseeded runtime's, with fewer misses."""
from __future__ import annotations

import pytest
import torch

import test_sparse_runtime_exact as ex
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.hot_rows import HotRows
from vllm_hisparse.slots import HotBufferState
from vllm_hisparse.slots.engine import resolve


def test_seeded_row_hits_its_first_pages_and_evicts_from_the_lru_end():
    S, U = 6, 40
    st = HotBufferState.create(3, S, U, "lru")
    st.seed(1, S)
    assert st.slot_unit[1].tolist() == list(range(S))
    assert st.unit_slot[1, :S].tolist() == list(range(S)) and (st.unit_slot[1, S:] == -1).all()
    assert (st.slot_unit[[0, 2]] == -1).all()                      # other rows untouched
    sel = torch.tensor([[0, 2, 20, 21]], dtype=torch.int32)
    locs, miss = resolve(st, sel, rows=torch.tensor([1]))
    assert miss[0].tolist() == [False, False, True, True]
    assert locs[0, :2].tolist() == [0, 2]
    # lru's initial order ranks slot 0 most recent: the misses take the slots of the highest
    # seeded pages not hit, from the LRU end
    assert sorted(locs[0, 2:].tolist()) == [4, 5]
    assert st.unit_slot[1, 4].item() == st.unit_slot[1, 5].item() == -1


def test_crf_seeded_slots_are_present_and_cheapest():
    S = 4
    st = HotBufferState.create(1, S, 32, "crf")
    st.seed(0, 3)                                   # slot 3 stays empty: value -1
    assert st.pstate["value"][0].tolist() == [0, 0, 0, -1]
    sel = torch.tensor([[1, 9]], dtype=torch.int32)
    locs, miss = resolve(st, sel)
    assert miss[0].tolist() == [False, True]
    assert locs[0].tolist() == [1, 3]               # the empty slot before any seeded one
    locs, miss = resolve(st, torch.tensor([[1, 10]], dtype=torch.int32))
    assert locs[0, 1].item() == 0                    # then the lowest (value, slot): slot 0


def test_hot_rows_seed_once_per_start():
    S = 4
    h = HotRows(3, [0, 2], 3, S, 32, "lru", "cpu")
    assert h[1] is None and h.stacked.rows == 6
    h.step(2, (S, S))                               # nothing given back: not through the slots
    assert (h[0].slot_unit[2] == -1).all()
    h.step(2, (S, S + 3))
    for st in (h[0], h[2]):
        assert st.slot_unit[2].tolist() == list(range(S))
        assert (st.slot_unit[:2] == -1).all() and (st.unit_slot[:2] == -1).all()   # rows 0, 1
    assert h[2].slot_unit.data_ptr() == h.stacked.slot_unit[3].data_ptr()          # views
    resolve(h[0], torch.tensor([[7]], dtype=torch.int32), rows=torch.tensor([2]))
    after = h[0].slot_unit[2].clone()
    h.step(2, (S, S + 4))                           # later steps leave the state to RESOLVE
    assert torch.equal(h[0].slot_unit[2], after)
    h.reset(2)
    assert (h[0].slot_unit[2] == -1).all() and (h[2].unit_slot[2] == -1).all()
    h.step(2, (S, S + 5))                           # a restart is seeded again
    assert h[2].slot_unit[2].tolist() == list(range(S))


@pytest.mark.parametrize("policy", ["lru", "crf"])
@pytest.mark.parametrize("full", [False, True])
def test_runtime_seeded_equals_unseeded_and_resident_with_fewer_misses(policy, full, monkeypatch):
    seeded, s_seeded = ex.run(True, full=full, policy=policy, resident_first=True,
                              spills=ex.PARTIAL)
    monkeypatch.setattr(HotRows, "step", lambda self, row, freed: None)
    empty, s_empty = ex.run(True, full=full, policy=policy, resident_first=True,
                            spills=ex.PARTIAL)
    res, _ = ex.run(False, full=full)
    for i, (a, b, c) in enumerate(zip(seeded, empty, res, strict=True)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, c) and torch.equal(b, c), f"step/layer {i} differs"
    assert s_seeded["resolved_units"] == s_empty["resolved_units"] > 0
    assert s_seeded["misses"] < s_empty["misses"]


def test_fixed_buffer_seeded_after_prefill():
    """resident_first off: a long prompt's row is seeded at its first decode step."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=ex.P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01, resident_first=False)
    d = ex.Driver(cfg, rows=2)
    d.add("a", 93)
    d.step({"a": 93})
    assert (d.rt.hot[1].slot_unit[d.rt.reqs["a"].row] == -1).all()
    d.step({"a": 1})
    # the first step through the slots: an empty state would make every selected page a miss
    assert d.rt.stats_dict()["hits"] > 0


@pytest.mark.parametrize("policy", ["lru", "crf"])
def test_one_resolve_over_the_stacked_state_equals_one_per_layer(policy):
    """give_back's resolve over every layer at once (rows of the stacked state) leaves each layer's
    state, locs and misses as resolving layer by layer does."""
    g = torch.Generator().manual_seed(5)
    S, U, R, layers = 8, 40, 4, [1, 2, 4]

    def make():
        h = HotRows(5, layers, R, S, U, policy, "cpu")
        h.step(1, (S, S + 2))
        return h

    a, b = make(), make()
    for _ in range(6):
        rows = torch.tensor([0, 1, 3])
        pages = torch.full((len(layers), 3, 5), -1, dtype=torch.int32)
        for i in range(len(layers)):
            for e in range(3):
                n = int(torch.randint(0, 6, (1,), generator=g))
                pages[i, e, :n] = torch.randperm(U, generator=g)[:n].to(torch.int32)
        locs, miss = resolve(a.stacked, pages.reshape(-1, 5), rows=a.stacked_rows(rows).reshape(-1))
        for i, layer in enumerate(layers):
            l1, m1 = resolve(b[layer], pages[i], rows=rows)
            assert torch.equal(locs.view(len(layers), 3, 5)[i], l1)
            assert torch.equal(miss.view(len(layers), 3, 5)[i], m1)
    for layer in layers:
        assert torch.equal(a[layer].slot_unit, b[layer].slot_unit)
        assert torch.equal(a[layer].unit_slot, b[layer].unit_slot)
        for k in a[layer].pstate:
            assert torch.equal(a[layer].pstate[k], b[layer].pstate[k])
