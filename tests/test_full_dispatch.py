"""vllm/full_dispatch.py: vLLM's FULL graphs are turned off for a step whose batch holds a sparse
request or one the runtime has not added yet (new this step: it may be sparse), and left alone for
batches of known dense requests and for vLLM's capture / dummy runs."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.sparse_runtime import SparseRuntime
from vllm_hisparse.vllm import full_dispatch, worker_state


def runtime(full: bool) -> SparseRuntime:
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=8, min_context=40,
                         host_pool_gib=0.01, dense_layers=(), full_decode_graphs=full,
                         decode_graphs=False)
    rt = SparseRuntime(cfg, 3, 2, 8, torch.float32, torch.device("cpu"), 4, 320, host_pages=100,
                       num_heads=4)
    rt.add("dense", 20)                 # < min_context: dense
    rt.add("long", 150)                 # sparse
    return rt


@pytest.fixture
def runner_cls():
    class Runner:                       # what the wrap reads of vLLM's GPUModelRunner
        def __init__(self, ids):
            self.input_batch = type("B", (), {"req_ids": ids})()
            self.got = None

        def _determine_batch_execution_and_padding(self, **kw):
            self.got = kw
            return "dispatched"

    full_dispatch.wrap(Runner)
    return Runner


def call(runner_cls, ids, **extra):
    r = runner_cls(ids + ["stale"])     # rows past num_reqs are not the step's
    kw = dict(num_tokens=len(ids), num_reqs=len(ids), use_cascade_attn=False, **extra)
    assert r._determine_batch_execution_and_padding(**kw) == "dispatched"
    return r.got["use_cascade_attn"], worker_state.sparse_batch


@pytest.mark.parametrize("ids,off", [
    (["dense"], False),                 # known dense requests: FULL allowed
    (["dense", "long"], True),          # a sparse request: FULL off, builder told
    (["dense", "new"], True),           # a request new this step (not added yet): FULL off
])
def test_full_graphs_off_for_steps_that_may_hold_sparse_rows(runner_cls, monkeypatch, ids, off):
    monkeypatch.setattr(worker_state, "runtime", runtime(True))
    monkeypatch.setattr(worker_state, "sparse_batch", not off)     # reset by every call
    assert call(runner_cls, ids) == (off, off)


def test_capture_runs_and_runs_without_full_graphs_are_left_alone(runner_cls, monkeypatch):
    monkeypatch.setattr(worker_state, "runtime", runtime(True))
    assert call(runner_cls, ["long"], force_uniform_decode=True) == (False, False)   # capture
    monkeypatch.setattr(worker_state, "runtime", runtime(False))
    assert call(runner_cls, ["long"]) == (False, False)
    monkeypatch.setattr(worker_state, "runtime", None)
    assert call(runner_cls, ["long"]) == (False, False)
