"""The FULL-graph decode body (config full_decode_graphs, core/full_decode.py) on the CPU: single-token
decode steps planned with plan_full and run through the one fixed per-layer body give every real row
exactly the eager path's output, Quest bounds, hot-slot state and hit/miss counts, for any mix of
sparse rows, short dense rows and vLLM-style padding rows; hisparse == resident through it; an
all-padding batch (what vLLM's capture runs) changes nothing. (Capture itself needs a GPU.)"""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError
from vllm_hisparse.core.residency import freed_pages

from test_sparse_runtime_exact import P, Driver

PAD = 3        # padding rows after the real ones, as vLLM pads a batch to its capture size


class FullDriver(Driver):
    """Driver whose single-token steps go through plan_full + full_layer with PAD padding rows
    (garbage q/k/v from another generator, so the real rows draw what the eager driver draws)."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.pad_g = torch.Generator().manual_seed(99)

    def step(self, todo: dict[str, int]):
        if any(n != 1 for n in todo.values()):
            return super().step(todo)
        ids = list(todo)
        n = len(ids)
        N = n + PAD
        seq = [self.lens[r] + 1 for r in ids]
        for r in ids:
            self.lens[r] += 1
        bt = torch.stack([self.blocks[r] for r in ids]).to(self.dev)
        self.rt.plan_full(ids, seq, bt, N)
        for layer in range(self.L):
            q, k, v = self._rand(n, self.hq, self.d), self._rand(n, self.hkv, self.d), \
                self._rand(n, self.hkv, self.d)
            junk = lambda h: torch.randn(PAD, h, self.d, generator=self.pad_g).to(self.dev, self.dt)  # noqa: E731
            qp, kp, vp = (torch.cat([x, junk(x.shape[1])]) for x in (q, k, v))
            out = torch.full((N, self.hq, self.d), float("nan"), dtype=self.dt, device=self.dev)
            self.run_layer(layer, N, qp, kp, vp, self.kv[layer], self.d ** -0.5, out)
            self.outs.append(out[:n])
        for rid in ids:
            lo, hi = freed_pages(self.cfg, self.lens[rid], self.prompt[rid])
            for kv in self.kv:
                kv[self.blocks[rid][lo:hi].long()] = float("nan")

    def run_layer(self, layer, N, q, k, v, kv, scale, out):
        self.rt.full_layer(layer, N, q, k, v, kv, scale, out)


class DenseOnlyDriver(FullDriver):
    """What the vLLM adapter does (vllm/full_dispatch.py): FULL graphs with the dense-only body for
    single-token batches without sparse rows, every other step on the eager path."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.rt.full.dense_only = True

    def step(self, todo: dict[str, int]):
        if self.rt.may_hold_sparse(todo):
            return Driver.step(self, todo)
        return super().step(todo)


def scenario(full: bool, host_tier=True, dense_layers=(), dense_pool_gib=0.0, padding_runs=False,
             driver_cls=None, driver_kw=None, before=None, dense_fn=None, split=False,
             decode_graphs=False):
    """driver_cls/driver_kw: the GPU test's capturing driver and device; before(d): runs before any
    request (capture); dense_fn: the full body's dense attention instead of the runtime's."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=dense_layers,
                         min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                         decode_graphs=decode_graphs, full_decode_graphs=full,
                         dense_pool_gib=dense_pool_gib,
                         split_dense_decode=split)
    d = (driver_cls or (FullDriver if full else Driver))(cfg, **(driver_kw or {}))
    if dense_fn is not None:
        d.rt.full.dense_fn = dense_fn
    if before is not None:
        before(d)
    if padding_runs:                                   # vLLM's capture runs, before any request
        for N in (1, 2, 5, 8):
            d.rt.full.padding(N)
            for layer in range(d.L):
                x = torch.randn(N, d.hq, d.d)
                d.rt.full_layer(layer, N, x, torch.randn(N, d.hkv, d.d), torch.randn(N, d.hkv, d.d),
                                d.kv[layer], d.d ** -0.5, torch.empty_like(x))
    prompts = {"a": 150, "b": 93, "short": 20, "c": 61}   # "short" < min_context: dense rows
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 64, "b": 93, "short": 20})
    d.step({"a": 64, "b": 1, "short": 1, "c": 61})      # mixed steps stay on the eager path
    d.step({"a": 22, "b": 1, "short": 1, "c": 1})
    for _ in range(30):                                  # sparse + dense rows + padding
        d.step({rid: 1 for rid in prompts})
    assert d.rt.finish("b")
    for _ in range(6):
        d.step({"short": 1})                             # dense rows only
    for _ in range(6):
        d.step({"a": 1, "c": 1})                         # sparse rows only
    state = [(h.slot_unit.clone(), h.unit_slot.clone(), h.lru.clone()) if h is not None else None
             for h in d.rt.hot]
    bounds = [(a.clone(), b.clone()) if a is not None else None for a, b in zip(d.rt.kmin, d.rt.kmax)]
    return d, d.outs, d.rt.stats_dict(), state, bounds


def assert_same_run(outs_f, outs_e, stats_f, stats_e):
    """Every step/layer output bit for bit (no NaN: nothing read a freed block), same counters."""
    assert len(outs_f) == len(outs_e)
    for i, (a, b) in enumerate(zip(outs_f, outs_e)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, b), f"step/layer {i} differs"
    for key in ("hits", "misses", "decode_rows", "steps"):
        assert stats_f[key] == stats_e[key], key


def assert_rows_equal(got, want, upto):
    for sg, se in zip(got, want):
        if sg is not None:
            for tg, te in zip(sg, se):
                assert torch.equal(tg[:upto], te[:upto])


@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((), 0.0), ((0, 2), 0.001)])
def test_full_body_equals_eager(dense_layers, dense_pool_gib):
    df, outs_f, stats_f, state_f, bounds_f = scenario(True, True, dense_layers, dense_pool_gib)
    de, outs_e, stats_e, state_e, bounds_e = scenario(False, True, dense_layers, dense_pool_gib)
    assert stats_f["full_steps"] == 42 and stats_f["full_layers"] == 42 * df.L
    assert set(df.rt.full.static) == {4 + PAD, 1 + PAD, 2 + PAD}
    assert_same_run(outs_f, outs_e, stats_f, stats_e)
    assert stats_f["misses"] > 0
    assert_rows_equal(state_f, state_e, df.rt.scratch_row)
    assert_rows_equal(bounds_f, bounds_e, df.rt.quest_scratch)


@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((), 0.0), ((0, 2), 0.001)])
def test_full_body_with_split_dense_decode_equals_eager(dense_layers, dense_pool_gib):
    """split_dense_decode: the FULL body's dense rows go through the split-KV decode kernel, as the
    eager path sends every one-token dense row: the same bits; hisparse == resident."""
    _, outs_f, _, _, _ = scenario(True, True, dense_layers, dense_pool_gib, split=True)
    _, outs_e, _, _, _ = scenario(False, True, dense_layers, dense_pool_gib, split=True)
    _, outs_r, _, _, _ = scenario(True, False, dense_layers, split=True)
    _, outs_plain, _, _, _ = scenario(True, True, dense_layers, dense_pool_gib)
    for i, (a, b, c) in enumerate(zip(outs_f, outs_e, outs_r)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, b), f"step/layer {i}: FULL body differs from eager"
        assert torch.equal(a, c), f"step/layer {i}: hisparse differs from resident"
    assert any(not torch.equal(a, b) for a, b in zip(outs_f, outs_plain)), "split path never taken"


def test_full_body_keeps_hisparse_equal_to_resident():
    _, hs, _, _, _ = scenario(True, True, (0, 2), 0.001)
    _, res, _, _, _ = scenario(True, False, (0, 2))
    for i, (a, b) in enumerate(zip(hs, res)):
        assert torch.equal(a, b), f"step/layer {i} differs"


def test_padding_batches_change_nothing():
    dp, outs_p, stats_p, state_p, bounds_p = scenario(True, padding_runs=True)
    d0, outs_0, stats_0, state_0, bounds_0 = scenario(True)
    for i, (a, b) in enumerate(zip(outs_p, outs_0)):
        assert torch.equal(a, b), f"step/layer {i} differs"
    assert (stats_p["hits"], stats_p["misses"]) == (stats_0["hits"], stats_0["misses"])
    assert_rows_equal(state_p, state_0, dp.rt.scratch_row)
    assert_rows_equal(bounds_p, bounds_0, dp.rt.quest_scratch)


@pytest.mark.parametrize("kw, match", [
    ({"dense_layers": (0, 1)}, "dense_pool_gib > 0"),
    ({"dense_layers": (), "trace_dir": "/tmp/x"}, "trace_dir"),
])
def test_config_refuses_what_a_graph_cannot_capture(kw, match):
    with pytest.raises(HiSparseConfigError, match=match):
        HiSparseConfig(full_decode_graphs=True, **kw)
    HiSparseConfig(full_decode_graphs=True, dense_layers=(0, 1), dense_pool_gib=4)   # fine
    HiSparseConfig(full_decode_graphs=True, dense_layers=(0, 1), host_tier=False)    # fine


@pytest.mark.parametrize("split,graphs", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((), 0.0), ((0, 2), 0.001)])
def test_dense_only_body_equals_eager(dense_layers, dense_pool_gib, split, graphs):
    """The dense-only FULL body (batches without sparse rows; the others eager, as vLLM runs them
    PIECEWISE, with the per-layer decode graphs when `graphs`: on the CPU their bodies run
    eagerly): every row bit for bit what the eager path gives, padding rows included."""
    d, outs_f, stats_f, state_f, _ = scenario(True, True, dense_layers, dense_pool_gib,
                                              driver_cls=DenseOnlyDriver, split=split,
                                              decode_graphs=graphs)
    if graphs:
        assert stats_f["graph_runs"] > 0, stats_f      # the sparse steps took the decode graphs
    _, outs_e, stats_e, state_e, _ = scenario(False, True, dense_layers, dense_pool_gib,
                                              split=split)
    assert stats_f["full_steps"] == 6 and stats_f["full_layers"] == 6 * d.L   # the "short" steps
    assert_same_run(outs_f, outs_e, stats_f, stats_e)
    assert_rows_equal(state_f, state_e, d.rt.scratch_row)


def test_dense_only_body_refuses_sparse_rows():
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(),
                         min_context=40, host_pool_gib=0.01, decode_graphs=False,
                         full_decode_graphs=True)
    d = FullDriver(cfg)
    d.rt.full.dense_only = True
    d.add("long", 150)
    d.step({"long": 150})
    with pytest.raises(RuntimeError, match="dense-only body got sparse rows"):
        d.step({"long": 1})
