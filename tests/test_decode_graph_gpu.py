"""Decode graphs on the GPU: real CUDA graph capture and replay of the sparse layers (Triton Quest
scores and attention, CUDA RESOLVE and write-through inside the graph). hisparse == resident bit for
bit with graphs on (same padded batch, same kernels); graphs vs eager within the attention kernel's
split tolerance (its split count depends on the batch size, so padding may change the bits);
padding never corrupts a request (no NaN from the poisoned freed blocks)."""
from __future__ import annotations

import pytest
import torch

from test_decode_graph import scenario

pytestmark = [pytest.mark.cuda, pytest.mark.ext]
GPU = dict(device="cuda", dtype=torch.bfloat16, dims=(8, 2, 64))


def test_graphs_hisparse_equals_resident_on_gpu():
    dg, hs, stats, _, _ = scenario(True, True, **GPU)
    _, res, _, _, _ = scenario(True, False, **GPU)
    assert dg.rt.graphs.stats["captures"] > 0 and dg.rt.graphs.stats["replays"] > 0
    for i, (a, b) in enumerate(zip(hs, res)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN"
        assert torch.equal(a, b), f"step/layer {i} differs"
    assert stats["misses"] > 0


@pytest.mark.parametrize("dense_pool_gib", [0.0, 0.001])
def test_graphs_close_to_eager_on_gpu(dense_pool_gib):
    _, g, sg, _, _ = scenario(True, True, dense_pool_gib=dense_pool_gib, **GPU)
    _, e, se, _, _ = scenario(False, True, dense_pool_gib=dense_pool_gib, **GPU)
    assert (sg["hits"], sg["misses"]) == (se["hits"], se["misses"])    # same selections, same state
    for i, (a, b) in enumerate(zip(g, e)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"step/layer {i}")


def test_precaptured_graphs_equal_lazy_ones_on_gpu():
    """Graphs captured ahead on all-padding batches (what vLLM's capture dummy batches trigger) serve
    the whole run: no capture after startup, and every output equals the lazily captured run's."""
    dp, pre, sp, _, _ = scenario(True, True, precapture=True, **GPU)
    _, lazy, sl_, _, _ = scenario(True, True, **GPU)
    stats = dp.rt.graphs.stats
    assert dp.precaptured == (dp.L - 1) * 3                 # buckets 1, 2, 4 per sparse layer
    assert stats["captures"] == stats["precaptures"] == dp.precaptured   # mid-run pass: all cached
    assert stats["replays"] > 0
    assert (sp["hits"], sp["misses"]) == (sl_["hits"], sl_["misses"])
    for i, (a, b) in enumerate(zip(pre, lazy)):
        assert torch.equal(a, b), f"step/layer {i} differs"
