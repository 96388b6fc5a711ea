"""Pages given back, copied into hot slots first (core/give_back.py): the pages a spill gives back
that the row selected at its previous step, and (HISPARSE_WINDOW_EXITS=1) the page leaving a
window. Which rows and pages; each inserted slot's bytes against the host pool's copy of the page
(written through when the page was new); outputs equal to resident mode's and to the runtime
without inserts."""
from __future__ import annotations

import pytest
import torch

import test_sparse_runtime_exact as ex
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import give_back
from vllm_hisparse.core.residency import freed_pages
from vllm_hisparse.core.step_plan import ReqStep


class _Rt:
    def __init__(self, cfg, reqs):
        self.cfg, self.reqs, self.P = cfg, reqs, cfg.page_size


@pytest.fixture
def exits_on(monkeypatch):
    monkeypatch.setattr(give_back, "WINDOW_EXITS", True)


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_exits_are_the_pages_the_window_gives_back_after_the_step(keep, exits_on):
    """Over a run of steps, the exits are exactly the pages freed after a step that were complete
    before it, each once; none with the floor (keep 0: the exit is the page the step completes)."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=8, min_context=40,
                         host_pool_gib=0.01, resident_first=True)
    from vllm_hisparse.core.sparse_runtime import Req
    rt = _Rt(cfg, {"a": Req(row=2, num_prompt=90, sparse=True, irow=0, keep=keep)})
    seen = []
    for start in range(90, 170):
        freed = freed_pages(cfg, start, 90, keep)
        s = ReqStep(5, "a", 7, 8, start, start + 1, 2, True, freed, 0)
        for idx, row, page in give_back.exits(rt, [s]):
            assert (idx, row) == (5, 2)
            assert freed[1] <= page < freed_pages(cfg, start + 1, 90, keep)[1]   # freed after it
            assert page < start // cfg.page_size                                # complete before
            seen.append(page)
    assert seen == sorted(set(seen))
    if keep == 0:
        assert seen == []
    else:     # every page the window gave back once the row was through its slots
        first = freed_pages(cfg, 90, 90, keep)[1]
        assert first > cfg.num_slots and seen == list(range(first, seen[-1] + 1)) and len(seen) >= 9
    # prefill chunks, dense rows and resident rows have none
    for s in (ReqStep(0, "a", 0, 2, 120, 122, 2, True, freed_pages(cfg, 120, 90, keep), 0),
              ReqStep(0, "a", 0, 1, 120, 121, 2, False, freed_pages(cfg, 120, 90, keep), 0)):
        assert give_back.exits(rt, [s]) == []
    rt.reqs["a"].keep = None
    s = ReqStep(0, "a", 0, 1, 127, 128, 2, True, freed_pages(cfg, 127, 90, None), 0)
    assert give_back.exits(rt, [s]) == []


@pytest.mark.parametrize("policy", ["lru", "crf"])
@pytest.mark.parametrize("full", [False, True])
def test_runtime_inserts_equal_resident_and_the_slots_hold_the_host_copy(policy, full,
                                                                        monkeypatch, exits_on):
    """Each insert (window exits and spills alike) leaves every page it was given in a hot slot of
    its row whose block's bytes equal the host pool's copy of the page; outputs equal resident
    mode's and the runtime's without inserts; some of both kinds happen."""
    real = give_back._insert
    seen = {"pages": 0, "calls": 0}

    def insert(rt, bt, rows, pages):
        real(rt, bt, rows, pages)
        for i, layer in enumerate(rt.hot.layers):      # each layer's own state, after the call
            hs = rt.hot[layer]
            for e, row in enumerate(rows.tolist()):
                for page in pages[i, e].tolist():
                    if page < 0:
                        continue
                    slot = int(hs.unit_slot[row, page])
                    assert slot >= 0, f"layer {layer}: page {page} not in a hot slot"
                    assert int(hs.slot_unit[row, slot]) == page
                    hp = int(rt.host_pt.table[row, page])
                    assert torch.equal(rt.kv_cache(layer)[int(bt[e, slot])],
                                       rt.host_layer(layer)[hp]), \
                        f"layer {layer} row {row} page {page}: slot bytes differ from the host's"
                    seen["pages"] += 1
        seen["calls"] += 1

    monkeypatch.setattr(give_back, "_insert", insert)
    ins, s_ins = ex.run(True, full=full, policy=policy, resident_first=True, spills=ex.PARTIAL)
    assert seen["pages"] == s_ins["inserts"] > 0
    spill_pages = seen["pages"]
    monkeypatch.setattr(give_back, "WINDOW_EXITS", False)      # spills alone (the default)
    seen["pages"] = 0
    ex.run(True, full=full, policy=policy, resident_first=True, spills=ex.PARTIAL)
    assert 0 < seen["pages"] < spill_pages
    monkeypatch.setattr(give_back, "insert", lambda rt, steps, bt: 0)
    off, s_off = ex.run(True, full=full, policy=policy, resident_first=True, spills=ex.PARTIAL)
    res, _ = ex.run(False, full=full)
    for i, (a, b, c) in enumerate(zip(ins, off, res, strict=True)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, c) and torch.equal(b, c), f"step/layer {i} differs"
    assert s_off["inserts"] == 0
    assert s_ins["resolved_units"] == s_off["resolved_units"]


def test_unknown_window_exits_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("HISPARSE_WINDOW_EXITS", "yes")
    with pytest.raises(ValueError, match="HISPARSE_WINDOW_EXITS='yes'"):
        give_back._window_exits()


def test_spills_with_no_sparse_layer_insert_nothing(exits_on):
    """Every layer dense (a dense pool holds them): spills and window exits have no hot slots to
    fill; the runtime runs and equals resident mode."""
    kw = dict(dense_layers=(0, 1, 2), dense_pool_gib=0.001)
    out, stats = ex.run(True, resident_first=True, spills=ex.PARTIAL, **kw)
    res, _ = ex.run(False, **kw)
    assert stats["spills"] > 0 and stats["inserts"] == 0
    for i, (a, b) in enumerate(zip(out, res, strict=True)):
        assert torch.equal(a, b), f"step/layer {i} differs"
