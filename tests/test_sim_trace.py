"""The trace format: round trip, validation errors, the runtime TraceWriter, the shipped trace."""
import json

import numpy as np
import pytest
import torch

from vllm_hisparse.sim import trace
from vllm_hisparse.sim.recorder_hook import TraceWriter

META = {"model": "m", "text": "t", "indexer": "exact", "unit": 1, "k_max": 3}


def _ok():
    pos = np.array([[[5, 1, -1], [0, 2, 4]], [[6, 5, 3], [1, -1, -1]]], np.int32)
    return pos, np.array([6, 7], np.int32)


def test_round_trip(tmp_path):
    pos, ctx = _ok()
    p = trace.save(str(tmp_path / "a.npz"), pos, ctx, META)
    t = trace.load(p)
    assert t.positions.dtype == np.int32 and np.array_equal(t.positions, pos)
    assert np.array_equal(t.context_len, ctx) and t.meta == META
    assert (t.steps, t.layers, t.k_max, t.unit, t.name) == (2, 2, 3, 1, "a")
    assert np.array_equal(t.first_k(2), pos[:, :, :2])
    with np.load(p) as z:                                    # the raw format other tools read
        assert set(z.files) == {"positions", "context_len", "meta"}
        assert json.loads(str(z["meta"][()]))["k_max"] == 3


@pytest.mark.parametrize("mutate, match", [
    (lambda p, c, m: (p.astype(np.int64), c, m), "int32"),
    (lambda p, c, m: (p[0], c, m), "int32 array"),
    (lambda p, c, m: (p, c[:1], m), "context_len"),
    (lambda p, c, m: (p, c, {k: v for k, v in m.items() if k != "indexer"}), "indexer"),
    (lambda p, c, m: (p, c, dict(m, k_max=5)), "k_max"),
    (lambda p, c, m: (p, c, dict(m, unit=0)), "unit"),
    (lambda p, c, m: (np.where(p == 5, -2, p).astype(np.int32), c, m), "-1 is the only padding"),
    (lambda p, c, m: (p[:, :, ::-1].copy(), c, m), "padding must come last"),
    (lambda p, c, m: (np.where(p == 6, 9, p).astype(np.int32), c, m), "beyond its context"),
    (lambda p, c, m: (np.where(p == 1, 5, p).astype(np.int32), c, m), "repeats a unit"),
])
def test_validation_errors(tmp_path, mutate, match):
    pos, ctx, meta = mutate(*_ok(), dict(META))
    with pytest.raises(trace.TraceError, match=match):
        trace.save(str(tmp_path / "bad.npz"), pos, ctx, meta)


def test_load_errors(tmp_path):
    with pytest.raises(trace.TraceError, match="not found"):
        trace.load(str(tmp_path / "none.npz"))
    np.savez(tmp_path / "x.npz", positions=_ok()[0])
    with pytest.raises(trace.TraceError, match="missing array"):
        trace.load(str(tmp_path / "x.npz"))
    (tmp_path / "y.npz").write_bytes(b"not a zip")
    with pytest.raises(trace.TraceError, match="not a readable"):
        trace.load(str(tmp_path / "y.npz"))
    pos, ctx = _ok()
    t = trace.load(trace.save(str(tmp_path / "z.npz"), pos, ctx, META))
    with pytest.raises(trace.TraceError, match="--k"):
        t.first_k(4)


def test_trace_writer(tmp_path):
    w = TraceWriter(str(tmp_path), meta={"model": "tiny", "indexer": "dsa"})
    w.append("req/1", 0, 0, torch.tensor([3, -1, 1]), 4)            # padding moved last
    w.append("req/1", 1, 0, [0, 2], 4)
    w.append_batch(["req/1", "req 2"], 1, [1, 0], torch.tensor([[4, 0, 1], [2, -1, -1]]), [5, 3])
    paths = w.close()
    assert len(paths) == 2 and all(p.startswith(str(tmp_path)) for p in paths)
    t = trace.load(w.path_of("req/1"))
    assert t.positions.shape == (2, 2, 3)
    assert t.positions[0, 0].tolist() == [3, 1, -1] and t.positions[0, 1].tolist() == [0, 2, -1]
    assert t.positions[1, 0].tolist() == [-1, -1, -1]              # never appended: padding
    assert t.positions[1, 1].tolist() == [4, 0, 1] and t.context_len.tolist() == [4, 5]
    assert t.meta["model"] == "tiny" and t.meta["request_id"] == "req/1"
    assert trace.load(w.path_of("req 2")).positions[0, 1].tolist() == [2, -1, -1]
    with pytest.raises(ValueError, match="must match"):
        w.append_batch(["a"], 0, [0, 1], [[1]], [2])


def test_shipped_trace_is_real_and_valid():
    t = trace.load(trace.default_trace_path())
    assert t.layers == 30 and t.k_max >= 256 and t.steps >= 256
    assert "SmolLM2" in t.meta["model"] and "GPL-3" in t.meta["text"]
    assert (t.context_len >= 4096).all()
