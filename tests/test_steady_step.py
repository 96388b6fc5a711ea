"""A steady decode step planned as the previous one plus a token (core/steady_step.py) sends the
decode batch the full plan would have built, byte for byte, at every FULL-graph step of a schedule
with every event that must fall back to the full plan: page boundaries, rows joining and leaving,
a dense row turning sparse, partial and full spills, padded batches, dense rows."""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import P, Driver
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import steady_step

SPILLS = {4: [("a", 6)], 11: [("b", 0)], 23: [("a", 0)], 33: [("grow", 1)]}


def run(steady: bool, host_tier: bool = True, dense_layers=(0,), dense_pool_gib=0.0,
        resident_first: bool = True):
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=dense_layers,
                         min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                         dense_pool_gib=dense_pool_gib, resident_first=resident_first)
    d = Driver(cfg, rows=5, full=True)
    d.rt.steady.enabled = steady
    sent = []                                  # (N, the decode batch's meta) after each plan_full
    plan_full = d.rt.plan_full

    def recorded(ids, seq, N, bt=None):
        plan_full(ids, seq, N, bt)
        sent.append((N, d.rt._batch(N).meta.clone()))
    d.rt.plan_full = recorded
    prompts = {"a": 150, "b": 93, "short": 20, "c": 61, "grow": 9}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 64, "b": 93, "short": 20, "grow": 9})
    d.step({"a": 86, "b": 1, "short": 1, "c": 61, "grow": 1})
    live = dict(prompts)
    for i in range(45):
        for rid, keep in SPILLS.get(i, ()) if resident_first else ():
            d.spill(rid, keep)
        if i == 15:                            # a row leaves: a new batch (4 -> 4 of 4, padded)
            assert d.rt.finish("short")
            del live["short"]
        if i == 30:                            # and another: a smaller padded size
            assert d.rt.finish("c")
            del live["c"]
        d.step({rid: 1 for rid in live})
    assert d.rt.reqs["grow"].sparse
    return d.outs, sent, d.rt.stats_dict()


@pytest.mark.parametrize("host_tier,dense_layers,dense_pool_gib,resident_first,steady_min", [
    (True, (0, 2), 0.001, True, 10), (True, (), 0.0, True, 10), (True, (0,), 0.001, False, 10),
    (False, (0,), 0.0, False, 10),
    (True, (0,), 0.0, True, 0)])    # dense layers read given-back pages from the host: full plans
def test_steady_plans_send_the_full_plans_bytes(host_tier, dense_layers, dense_pool_gib,
                                                resident_first, steady_min):
    on, sent_on, s_on = run(True, host_tier, dense_layers, dense_pool_gib, resident_first)
    off, sent_off, s_off = run(False, host_tier, dense_layers, dense_pool_gib, resident_first)
    assert len(sent_on) == len(sent_off) == 45
    for i, ((n1, a), (n2, b)) in enumerate(zip(sent_on, sent_off)):
        assert n1 == n2 and torch.equal(a, b), f"FULL step {i}: the decode batch differs"
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert torch.equal(a, b), f"step/layer {i} differs"
    host = {k for k in s_on if k.startswith("host_ms_")} | {"steady_steps"}
    assert {k: v for k, v in s_on.items() if k not in host} == \
        {k: v for k, v in s_off.items() if k not in host}
    # steady: all but the page boundaries (one step in P per row, rows out of phase), the
    # batches that changed and the steps after a spill; never with the knob off
    assert s_off["steady_steps"] == 0
    assert steady_min <= s_on["steady_steps"] < 45


def test_one_row_is_steady_but_at_its_page_boundaries():
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01)
    d = Driver(cfg, rows=2, full=True)
    d.add("a", 100)
    d.step({"a": 100})
    for _ in range(64):
        d.step({"a": 1})
    # steps with 101..164 keys; a boundary when the new token starts a page ((seq - 1) % P == 0),
    # and the first FULL step has no previous one
    boundaries = sum((s - 1) % P == 0 for s in range(101, 165))
    assert d.rt.stats["steady_steps"] == 64 - 1 - boundaries


def test_knob_takes_0_or_1(monkeypatch):
    monkeypatch.setenv("HISPARSE_STEADY_PLAN", "0")
    assert steady_step.SteadyStep().enabled is False
    monkeypatch.setenv("HISPARSE_STEADY_PLAN", "yes")
    with pytest.raises(ValueError, match="HISPARSE_STEADY_PLAN='yes'"):
        steady_step.SteadyStep()
