"""fp8 (e4m3) KV through the runtime without vLLM (ops/fp8.py, core/kv_quant.py): the scenario of
test_sparse_runtime_exact.py (chunked prefill, mixed batches, a short request, a request turning
sparse, dense layers, freed blocks poisoned with NaN) with every KV tier fp8 and the K/V of each
layer quantized at the runtime's door as the vLLM backend does it (``run_quantized``, scales
!= 1). hisparse mode == resident mode bit for bit, every layer of every step, with misses; the
negative control (every host fetch reads its neighbour page) must differ. On the GPU the same
with the decode body replayed from CUDA graphs (test_decode_body_gpu.py's driver and scenario)."""
from __future__ import annotations

import pytest
import torch

import test_sparse_runtime_exact as tse
from vllm_hisparse.core import indexers
from vllm_hisparse.core.kv_quant import run_quantized
from vllm_hisparse.core.page_table import CORRUPT_FETCH_ENV
from vllm_hisparse.core.sparse_runtime import SparseRuntime
from vllm_hisparse.ops.fp8 import FP8
from vllm_hisparse.sim.recorder_hook import TraceWriter

SCALES = {0: (0.5, 2.0), 1: (1.0, 1.0), 2: (3.0, 0.25)}      # layer -> (k_scale, v_scale)


class Fp8Door:
    """The runtime as the fp8 backend calls it: forward_layer / full_layer quantize K/V per layer
    (run_quantized); everything else is the runtime's."""

    def __init__(self, rt):
        self._rt = rt

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def forward_layer(self, layer, plan, q, k, v, kv, scale, out):
        run_quantized(lambda *a: self._rt.forward_layer(layer, plan, *a), q, k, v, kv, scale,
                      out, *SCALES[layer])

    def full_layer(self, layer, N, q, k, v, kv, bt, scale, out):
        run_quantized(lambda q8, k8, v8, kv8, s, o: self._rt.full_layer(
            layer, N, q8, k8, v8, kv8, bt, s, o), q, k, v, kv, scale, out, *SCALES[layer])


class Fp8Driver(tse.Driver):
    """tse.Driver with fp8 caches and pools; queries and the Quest bounds in the driver's dtype."""

    def __init__(self, cfg, rows=4, **kw):
        super().__init__(cfg, rows=rows, **kw)
        ix = indexers.get(cfg.indexer)
        W, P = self.W * self.P, self.P
        dep_rows = (cfg.quest_rows or rows)
        state = ix.allocate_state(cfg, self.L, dep_rows, W, self.hkv, self.d, self.dt,
                                  self.dev)
        self.rt = Fp8Door(SparseRuntime(cfg, self.L, self.hkv, self.d, FP8, self.dev, rows, W,
                                        host_pages=400, trace_writer=TraceWriter,
                                        indexer_state=state))
        self.kv = [torch.zeros(1 + rows * self.W, 2, P, self.hkv, self.d, dtype=FP8,
                               device=self.dev) for _ in range(self.L)]
        self.rt.bind_kv_caches(self.kv)


@pytest.fixture
def fp8_driver(monkeypatch):
    monkeypatch.setattr(tse, "Driver", Fp8Driver)


def _run(**kw):
    outs, stats = tse.run(**kw)
    return outs, stats


@pytest.mark.parametrize("full", [False, True])
def test_fp8_hisparse_equals_resident(fp8_driver, monkeypatch, full):
    monkeypatch.delenv(CORRUPT_FETCH_ENV, raising=False)
    hs, stats = _run(host_tier=True, dense_layers=(0,), full=full)
    res, _ = _run(host_tier=False, dense_layers=(0,), full=full)
    assert stats["misses"] > 0 and stats["hits"] > 0
    assert len(hs) == len(res)
    for i, (a, b) in enumerate(zip(hs, res)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN (read a freed block or a row)"
        assert torch.equal(a, b), f"step/layer {i} differs"
    if full:                       # the corrupted fetch must be seen: the same harness differs
        monkeypatch.setenv(CORRUPT_FETCH_ENV, "1")
        bad, s_bad = _run(host_tier=True, dense_layers=(0,), full=full)
        assert s_bad["misses"] > 0
        assert any(not torch.equal(a, b) for a, b in zip(bad, res)), \
            "the negative control matched resident mode"


@pytest.mark.cuda
@pytest.mark.ext
def test_gpu_fp8_replayed_graphs_equal_eager_and_resident():
    from test_decode_body_gpu import GraphDriver, run

    class Fp8GraphDriver(Fp8Driver, GraphDriver):
        pass

    g_hs, stats = run(Fp8GraphDriver, True, (0,), 0.01)
    e_hs, _ = run(lambda *a, **k: Fp8Driver(*a, full=True, **k), True, (0,), 0.01)
    g_res, _ = run(Fp8GraphDriver, False, (0,), 0.0)
    assert stats["misses"] > 0 and stats["full_steps"] >= 30
    assert len(g_hs) == len(e_hs) == len(g_res)
    for i, (a, b, c) in enumerate(zip(g_hs, e_hs, g_res)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN in the replay"
        assert torch.equal(a, b), f"step/layer {i}: replay differs from eager"
        assert torch.equal(a, c), f"step/layer {i}: hisparse differs from resident"
