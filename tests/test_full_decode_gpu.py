"""The FULL-graph decode body on the GPU: every (layer, batch size) recorded once in a real CUDA graph
on an all-padding batch (as vLLM's capture does at startup), then replayed for steps that mix
sparse, dense and padding rows; each real row equals the eager body's output bit for bit, and
hisparse equals resident. The dense rows' attention is a fixed-shape torch function here (vLLM's
FlashAttention is not on the path of these tests)."""
from __future__ import annotations

import pytest
import torch

from test_full_decode import PAD, FullDriver, scenario
from test_sparse_runtime_exact import Driver

pytestmark = [pytest.mark.cuda, pytest.mark.ext]
GPU = dict(device="cuda", dtype=torch.bfloat16, dims=(8, 2, 64))


def fixed_dense(q, k_cache, v_cache, block_table, cu_q, seq_k, max_q, max_k, scale, out):
    """One query per row (cu_q = arange) over every page of its table, keys >= seq_k masked; no
    host sync, fixed shapes: capturable. Rows with seq_k 0 get zeros."""
    N, W = block_table.shape
    P, Hkv, D = k_cache.shape[1:]
    G = q.shape[1] // Hkv
    k = k_cache[block_table.long()].reshape(N, W * P, Hkv, D).float()
    v = v_cache[block_table.long()].reshape(N, W * P, Hkv, D).float()
    s = torch.einsum("nhgd,nlhd->nhgl", q.float().view(N, Hkv, G, D), k) * scale
    live = torch.arange(W * P, device=q.device)[None] < seq_k[:, None]
    p = torch.softmax(s.masked_fill(~live[:, None, None, :], float("-inf")), -1).nan_to_num(0.0)
    out.copy_(torch.einsum("nhgl,nlhd->nhgd", p, v).reshape(N, -1, D).to(out.dtype))


class CapturedDriver(FullDriver):
    """FullDriver whose full layers replay CUDA graphs recorded on all-padding batches up front."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.rt.full.dense_fn = fixed_dense
        self.graphs, self.io = {}, {}

    def capture(self, sizes):
        rt, sc = self.rt, self.d ** -0.5
        for N in sizes:
            io = self.io[N] = [torch.zeros(N, h, self.d, dtype=self.dt, device=self.dev)
                               for h in (self.hq, self.hkv, self.hkv, self.hq)]
            rt.full.padding(N)
            for layer in range(self.L):
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):                     # warm-up: JIT, allocator
                    rt.full_layer(layer, N, *io[:3], self.kv[layer], sc, io[3])
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    rt.full_layer(layer, N, *io[:3], self.kv[layer], sc, io[3])
                self.graphs[(layer, N)] = g

    def run_layer(self, layer, N, q, k, v, kv, scale, out):
        io = self.io[N]
        for t, x in zip(io[:3], (q, k, v)):
            t.copy_(x)
        self.graphs[(layer, N)].replay()
        out.copy_(io[3])


def run(captured: bool, host_tier=True):
    d, outs, stats, _, _ = scenario(
        True, host_tier, (0, 2), 0.001, driver_cls=CapturedDriver if captured else FullDriver,
        driver_kw=GPU, before=(lambda d: d.capture([4 + PAD, 1 + PAD, 2 + PAD])) if captured else None,
        dense_fn=fixed_dense)
    return d, outs, stats


def test_captured_full_body_equals_eager_on_gpu():
    dc, cap, sc = run(True)
    de, eag, se = run(False)
    assert len(dc.graphs) == 3 * dc.L
    assert (sc["hits"], sc["misses"]) == (se["hits"], se["misses"]) and sc["misses"] > 0
    for i, (a, b) in enumerate(zip(cap, eag)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, b), f"step/layer {i} differs"


def test_captured_full_body_hisparse_equals_resident_on_gpu():
    _, hs, _ = run(True, True)
    _, res, _ = run(True, False)
    for i, (a, b) in enumerate(zip(hs, res)):
        assert torch.equal(a, b), f"step/layer {i} differs"


class CapturedDenseOnlyDriver(CapturedDriver):
    """The dense-only body in recorded graphs, used (as the vLLM adapter does) only for steps
    without sparse rows; the other steps eager."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.rt.full.dense_only = True

    def step(self, todo):
        if self.rt.may_hold_sparse(todo):
            return Driver.step(self, todo)
        return super().step(todo)


def test_captured_dense_only_body_equals_eager_on_gpu():
    """The dense-only body recorded on an all-padding batch and replayed for the dense-only steps
    (with the batch-invariant split-KV kernel): bit for bit the eager path's rows."""
    dc, cap, sc, _, _ = scenario(True, True, (0, 2), 0.001, driver_cls=CapturedDenseOnlyDriver,
                                 driver_kw=GPU, before=lambda d: d.capture([1 + PAD]), split=True)
    _, eag, se, _, _ = scenario(False, True, (0, 2), 0.001, driver_kw=GPU, split=True)
    assert dc.rt.split_dense and len(dc.graphs) == dc.L
    assert sc["full_layers"] >= 6 * dc.L and (sc["hits"], sc["misses"]) == (se["hits"], se["misses"])
    assert len(cap) == len(eag)
    for i, (a, b) in enumerate(zip(cap, eag)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, b), f"step/layer {i} differs"
