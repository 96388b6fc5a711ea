"""SparseRuntime with config trace_dir (no vLLM): every decode step of every sparse request lands in
<trace_dir>/<id>.npz, loadable by sim.trace and replayable by the simulator (unit = page)."""
from __future__ import annotations

import numpy as np

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.sim import trace as tr

from test_sparse_runtime_exact import Driver as _Driver

P, L, W = 16, 4, 16                               # W pages per request (max_model_len 256)


def Driver(cfg, rows=3):
    return _Driver(cfg, rows, shape=(P, L, W))


def test_trace_per_request(tmp_path):
    """One trace per request that was sparse: from its first decode step for a long prompt, from
    the step its context reaches min_context for a short one (core/residency.py); none for a
    request that never gets there."""
    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=P, dense_layers=(0,),
                         min_context=60, host_pool_gib=0.01, trace_dir=str(tmp_path / "tr"),
                         resident_first=False)
    d = Driver(cfg, rows=4)
    # "short" stays below min_context (dense, untraced); "grow" turns sparse at 60 tokens
    prompts = {"a/1": 100, "b": 70, "short": 20, "grow": 40}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step(dict(prompts))                                 # prefill
    decode = 30
    for _ in range(decode):
        d.step({rid: 1 for rid in prompts})
    for rid in prompts:
        assert d.rt.finish(rid)
    files = sorted(p.name for p in (tmp_path / "tr").iterdir())
    assert files == ["a_1.npz", "b.npz", "grow.npz"]
    for rid, name in (("a/1", "a_1.npz"), ("b", "b.npz"), ("grow", "grow.npz")):
        t = tr.load(str(tmp_path / "tr" / name))
        assert t.unit == P and t.meta["request_id"] == rid
        assert t.meta["sparse_layers"] == [1, 2, 3]
        first = max(prompts[rid] + 1, cfg.min_context_tokens)    # the current token included
        ctx = np.arange(first, prompts[rid] + decode + 1)
        assert t.positions.shape == (len(ctx), L - 1, cfg.top_k_units)
        assert (t.context_len == ctx).all()
        pages = (ctx + P - 1) // P
        assert (t.positions[:, :, 0] == (pages - 1)[:, None]).all()   # newest page first
        assert ((t.positions < pages[:, None, None]) | (t.positions == -1)).all()
        assert (t.positions[:, :, 1:] >= 0).all()                     # >= 3 pages: k = 3 filled
        assert d.rt.stats_dict()["misses"] > 0


def test_restart_traces_from_step_zero(tmp_path):
    """A request that restarts (preemption: recompute from token 0) traces its new run only."""
    cfg = HiSparseConfig(top_k=32, device_buffer_size=32, page_size=P, dense_layers=(0, 1),
                         host_pool_gib=0.01, trace_dir=str(tmp_path), min_context=0)
    d = Driver(cfg)
    d.add("r", 40)
    d.step({"r": 40})
    for _ in range(20):
        d.step({"r": 1})
    d.add("r", 40)                                        # resumed: recompute 60 tokens
    d.lens["r"] = 0
    d.step({"r": 60})
    for _ in range(5):
        d.step({"r": 1})
    d.rt.finish("r")
    t = tr.load(str(tmp_path / "r.npz"))
    assert t.positions.shape[:2] == (5, 2)
    assert (t.context_len == 61 + np.arange(5)).all()


def test_no_trace_without_trace_dir(tmp_path):
    d = Driver(HiSparseConfig(top_k=32, device_buffer_size=32, page_size=P, host_pool_gib=0.01,
                               min_context=0))
    assert d.rt.trace is None
    d.add("r", 40)
    d.step({"r": 40})
    d.step({"r": 1})
    d.rt.finish("r")
