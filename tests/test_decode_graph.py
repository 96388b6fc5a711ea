"""Decode graphs (config decode_graphs, core/decode_graph.py) on the CPU: the static step the graph
captures, run without capture on padded static buffers, gives every real row exactly the eager
path's output, Quest bounds, hot-slot state and hit/miss counts; padding rows touch only the
scratch row and the null block. (The GPU test replays real CUDA graphs.)"""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.decode_graph import bucket

from test_sparse_runtime_exact import P, Driver


def scenario(decode_graphs: bool, host_tier: bool = True, dense_layers=(0,), dense_pool_gib=0.0,
             **driver):
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=dense_layers,
                         min_context=0, host_pool_gib=0.01, host_tier=host_tier,
                         decode_graphs=decode_graphs, dense_pool_gib=dense_pool_gib)
    d = Driver(cfg, **driver)
    prompts = {"a": 150, "b": 93, "c": 61}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 64, "b": 93, "c": 61})
    d.step({"a": 86, "b": 1, "c": 1})                   # mixed: prefill chunk + decodes (eager)
    for _ in range(30):                                 # 3 decode rows: bucket 4, one padding row
        d.step({rid: 1 for rid in prompts})
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
