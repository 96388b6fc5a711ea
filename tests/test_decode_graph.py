"""Decode graphs (config decode_graphs, core/decode_graph.py) on the CPU: the static step the graph
captures, run without capture on padded static buffers, gives every real row exactly the eager
path's output, Quest bounds, hot-slot state and hit/miss counts; padding rows touch only the
scratch row and the null block; pre-capturing on all-padding batches changes nothing. (The GPU test
replays real CUDA graphs.)"""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.decode_graph import bucket

from test_sparse_runtime_exact import P, Driver


def precapture_all(d) -> int:
    """What vLLM's graph-capture dummy batches do: every layer, every batch size up to max_rows+1."""
    done = 0
    for layer in range(d.L):
        for rows in range(1, d.rt.max_rows + 2):
            done += d.rt.precapture(layer, rows, d.kv[layer], d.d ** -0.5)
    return done


def scenario(decode_graphs: bool, host_tier: bool = True, dense_layers=(0,), dense_pool_gib=0.0,
             precapture: bool = False, **driver):
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=dense_layers,
                         min_context=0, host_pool_gib=0.01, host_tier=host_tier,
                         decode_graphs=decode_graphs, dense_pool_gib=dense_pool_gib)
    d = Driver(cfg, **driver)
    if precapture:                                      # at startup, before any request
        d.precaptured = precapture_all(d)
    prompts = {"a": 150, "b": 93, "c": 61}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 64, "b": 93, "c": 61})
    d.step({"a": 86, "b": 1, "c": 1})                   # mixed: prefill chunk + decodes (eager)
    for i in range(30):                                 # 3 decode rows: bucket 4, one padding row
        d.step({rid: 1 for rid in prompts})
        if precapture and i == 10:                      # again with live state: must not touch it
            precapture_all(d)
    assert d.rt.finish("c")
    for _ in range(12):                                 # 2 rows: bucket 2, no padding
        d.step({"a": 1, "b": 1})
    state = [(h.slot_unit.clone(), h.unit_slot.clone(), h.lru.clone()) if h is not None else None
             for h in d.rt.hot]
    bounds = [(a.clone(), b.clone()) if a is not None else None for a, b in zip(d.rt.kmin, d.rt.kmax)]
    return d, d.outs, d.rt.stats_dict(), state, bounds


@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((0,), 0.0), ((), 0.0), ((0,), 0.001)])
def test_static_step_equals_eager(dense_layers, dense_pool_gib):
    dg, outs_g, stats_g, state_g, bounds_g = scenario(True, True, dense_layers, dense_pool_gib)
    de, outs_e, stats_e, state_e, bounds_e = scenario(False, True, dense_layers, dense_pool_gib)
    assert dg.rt.graphs is not None and de.rt.graphs is None
    assert set(dg.rt.graphs.static) == {2, 4}            # both buckets were used
    for i, (a, b) in enumerate(zip(outs_g, outs_e)):
        assert torch.equal(a, b), f"step/layer {i} differs"
    for key in ("hits", "misses"):
        assert stats_g[key] == stats_e[key] and stats_g[key] > 0
    scratch = dg.rt.scratch_row
    for sg, se in zip(state_g, state_e):
        if sg is not None:
            for tg, te in zip(sg, se):
                assert torch.equal(tg[:scratch], te[:scratch])      # every request row identical
    for bg, be in zip(bounds_g, bounds_e):
        if bg is not None:
            for tg, te in zip(bg, be):
                assert torch.equal(tg[:scratch], te[:scratch])


def test_graphs_keep_hisparse_equal_to_resident():
    _, hs, _, _, _ = scenario(True, True)
    _, res, _, _, _ = scenario(True, False)
    for i, (a, b) in enumerate(zip(hs, res)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, b), f"step/layer {i} differs"


def test_bucket():
    assert [bucket(n, 256) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert bucket(300, 256) == 256 and bucket(7, 6) == 6


@pytest.mark.parametrize("host_tier", [True, False])
def test_precapture_changes_nothing(host_tier):
    """Pre-capturing every (layer, bucket) on all-padding batches, at startup and again mid-run with
    live requests, leaves outputs, hot state, Quest bounds and hit/miss counts bit-identical."""
    dp, outs_p, stats_p, state_p, bounds_p = scenario(True, host_tier, precapture=True)
    d0, outs_0, stats_0, state_0, bounds_0 = scenario(True, host_tier)
    # every sparse layer (all but layer 0) x rows 1..max_rows (max_rows + 1 is refused); on the CPU
    # nothing is recorded, so each call runs, and the mid-run pass runs them all again
    calls = (dp.L - 1) * dp.rt.max_rows
    assert dp.precaptured == calls and dp.rt.graphs.stats["precaptures"] == 2 * calls
    assert dp.rt.precapture(0, 1, dp.kv[0], 1.0) is False           # dense layer 0: no graph
    for i, (a, b) in enumerate(zip(outs_p, outs_0)):
        assert torch.equal(a, b), f"step/layer {i} differs"
    assert (stats_p["hits"], stats_p["misses"]) == (stats_0["hits"], stats_0["misses"])
    # every request row identical (the scratch rows are the padding's sink, their bytes are junk)
    for rows, (got, want) in ((dp.rt.scratch_row, (state_p, state_0)),
                              (dp.rt.quest_scratch, (bounds_p, bounds_0))):
        for sp, s0 in zip(got, want):
            if sp is not None:
                for tp, t0 in zip(sp, s0):
                    assert torch.equal(tp[:rows], t0[:rows])
