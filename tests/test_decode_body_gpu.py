"""On the GPU: the decode batch's body recorded into CUDA graphs as vLLM's FULL graphs record it
(one graph per padded batch size over every layer, captured on an all-padding batch, every row
kind's kernels recorded), replayed on real steps: equal to the same body run eagerly, bit for bit,
and hisparse == resident."""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import Driver
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import give_back
from vllm_hisparse.core import sparse_runtime
from vllm_hisparse.core.hot_rows import HotRows
from vllm_hisparse.core.sparse_runtime import SparseRuntime

pytestmark = [pytest.mark.cuda, pytest.mark.ext]


class GraphDriver(Driver):
    """Driver whose FULL-graph steps replay one CUDA graph per padded batch size over every layer,
    recorded on an all-padding batch (as vLLM records its FULL graphs)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, full=True, **kw)
        self.graphs = {}

    def _full_step(self, ids, seq, bt):
        n = len(ids)
        N = 1 << (n - 1).bit_length()
        if N not in self.graphs:
            self._record(N, bt.shape[1])
        g, io = self.graphs[N]
        self.rt.plan_full(ids, seq, N, bt)
        io["bt"][:n] = bt
        for layer in range(self.L):
            q, k, v = self._rand(n, self.hq, self.d), self._rand(n, self.hkv, self.d), \
                self._rand(n, self.hkv, self.d)
            io["q"][layer][:n], io["k"][layer][:n], io["v"][layer][:n] = q, k, v
        for o in io["out"]:
            o.fill_(float("nan"))
        g.replay()
        self.outs.extend(o[:n].clone() for o in io["out"])

    def _record(self, N, W):
        z = lambda *s: torch.zeros(*s, dtype=self.dt, device=self.dev)  # noqa: E731
        io = {"q": [z(N, self.hq, self.d) for _ in range(self.L)],
              "k": [z(N, self.hkv, self.d) for _ in range(self.L)],
              "v": [z(N, self.hkv, self.d) for _ in range(self.L)],
              "out": [z(N, self.hq, self.d) for _ in range(self.L)],
              "bt": torch.zeros(N, W, dtype=torch.int32, device=self.dev)}

        def layers():
            for layer in range(self.L):
                self.rt.full_layer(layer, N, io["q"][layer], io["k"][layer], io["v"][layer],
                                   self.kv[layer], io["bt"], self.d ** -0.5, io["out"][layer])

        self.rt.plan_full([], [], N)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layers()                                   # warm-up on the padding batch: inert
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layers()
        self.graphs[N] = (g, io)


def run(cls, host_tier: bool, dense_layers, dense_pool_gib):
    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=16, dense_layers=dense_layers,
                         min_context=160, host_pool_gib=0.05, host_tier=host_tier,
                         dense_pool_gib=dense_pool_gib,
                         resident_first=False)   # the fixed hot buffer: misses to check
    d = cls(cfg, rows=4, device="cuda", dtype=torch.bfloat16, dims=(8, 2, 64), shape=(16, 3, 40))
    prompts = {"a": 500, "b": 330, "short": 60, "c": 210}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 256, "b": 330, "short": 60})
    d.step({"a": 244, "b": 1, "short": 1, "c": 210})
    for i in range(30):                      # 4, then 3 rows (a padded batch of 4 with junk)
        d.step({rid: 1 for rid in prompts if not (rid == "short" and i >= 20)})
    stats = d.rt.stats_dict()
    for rid in prompts:
        assert d.rt.finish(rid)
    assert d.rt.host_pages_used == 0
    return d.outs, stats


@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((0,), 0.01), ((), 0.0)])
def test_replayed_graphs_equal_eager_and_resident(dense_layers, dense_pool_gib):
    g_hs, stats = run(GraphDriver, True, dense_layers, dense_pool_gib)
    e_hs, _ = run(lambda *a, **k: Driver(*a, full=True, **k), True, dense_layers, dense_pool_gib)
    g_res, _ = run(GraphDriver, False, dense_layers, 0.0)
    assert stats["misses"] > 0 and stats["full_steps"] >= 30
    assert len(g_hs) == len(e_hs) == len(g_res)
    for i, (a, b, c) in enumerate(zip(g_hs, e_hs, g_res)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN in the replay"
        assert torch.equal(a, b), f"step/layer {i}: replay differs from eager"
        assert torch.equal(a, c), f"step/layer {i}: hisparse differs from resident"


def test_capture_refuses_a_config_full_graphs_cannot_run():
    """Dense layers without a dense pool read given-back pages from the host: recording them
    would replay stale reads (NaN outputs), so the capture stops, naming the fix."""
    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=16, dense_layers=(0,),
                         min_context=160, host_pool_gib=0.05, resident_first=False)
    d = GraphDriver(cfg, rows=4, device="cuda", dtype=torch.bfloat16, dims=(8, 2, 64),
                    shape=(16, 3, 40))
    d.add("a", 300)
    d.step({"a": 300})
    with pytest.raises(RuntimeError, match="dense_pool_gib > 0"):
        d.step({"a": 1})


def run_spills(cls, host_tier: bool):
    """resident_first with partial spills mid-decode: the plan copies each spill's pages into
    hot slots (core/give_back.py) on the GPU, replayed graphs reading the decode batch's kept
    selections; blocks given back are poisoned after each step (the driver)."""
    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=16, dense_layers=(0,),
                         min_context=160, host_pool_gib=0.05, host_tier=host_tier,
                         dense_pool_gib=0.01 if host_tier else 0.0, resident_first=True)
    d = cls(cfg, rows=4, device="cuda", dtype=torch.bfloat16, dims=(8, 2, 64), shape=(16, 3, 40))
    prompts = {"a": 500, "b": 330, "c": 210}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 256, "b": 330})
    d.step({"a": 244, "b": 1, "c": 210})
    spills = {3: [("a", 6)], 8: [("b", 2)], 14: [("a", 1), ("c", 3)], 20: [("b", 0)]}
    for i in range(30):
        for rid, keep in spills.get(i, ()) if host_tier else ():
            d.spill(rid, keep)
        d.step({rid: 1 for rid in prompts})
    return d.outs, d.rt.stats_dict()


def test_spill_inserts_replayed_equal_eager_and_resident():
    g, stats = run_spills(GraphDriver, True)
    e, _ = run_spills(lambda *a, **k: Driver(*a, full=True, **k), True)
    res, _ = run_spills(GraphDriver, False)
    assert stats["inserts"] > 0 and stats["shrinks"] >= 4
    for i, (a, b, c) in enumerate(zip(g, e, res, strict=True)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN in the replay"
        assert torch.equal(a, b), f"step/layer {i}: replay differs from eager"
        assert torch.equal(a, c), f"step/layer {i}: hisparse differs from resident"


def test_inserts_and_row_resets_never_wait_for_the_gpu(monkeypatch):
    """The plan's inserts (spills, and window exits with HISPARSE_WINDOW_EXITS=1), a row's reset
    and seeding over every layer (core/hot_rows.py), the page tables' flushes (a prompt's pages in
    one copy, a decode step's as scalar writes: core/page_table.py) and whole FULL-step plans
    (steady ones among them: core/steady_step.py) run under torch's sync debug mode set to error:
    nothing in them waits for the GPU."""
    monkeypatch.setattr(give_back, "WINDOW_EXITS", True)
    calls = []

    def strict(fn, name):
        def run(*a, **k):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                calls.append(name)
        return run

    monkeypatch.setattr(give_back, "insert", strict(give_back.insert, "insert"))
    monkeypatch.setattr(HotRows, "reset", strict(HotRows.reset, "reset"))
    monkeypatch.setattr(HotRows, "step", strict(HotRows.step, "step"))
    monkeypatch.setattr(sparse_runtime, "flush_tables",
                        strict(sparse_runtime.flush_tables, "flush"))
    monkeypatch.setattr(SparseRuntime, "plan_full", strict(SparseRuntime.plan_full, "plan_full"))
    _, stats = run_spills(GraphDriver, True)
    assert stats["inserts"] > 0
    assert {"insert", "reset", "step", "flush", "plan_full"} <= set(calls)
    # window exits turn the steady plan off (core/steady_step.py): the steady steps run without
    monkeypatch.setattr(give_back, "WINDOW_EXITS", False)
    calls.clear()
    _, stats = run_spills(GraphDriver, True)
    assert stats["steady_steps"] > 0 and {"flush", "plan_full"} <= set(calls)
