"""An engine where no request can be sparse (max_model_len < min_context) decodes every layer through
the runtime's decode_fn (decode_body.stock_layer: the GPU adapter plugs in FlashAttention with its
own split-KV, as stock vLLM decodes). Here decode_fn is the plain-torch paged attention, a
different computation from the decode body's dense-decode reference it replaces: every layer of
every step (mixed prefill + decode, and FULL-graph steps padded with junk rows) must agree with the
usual body's output, the KV caches bit for bit; a runtime that may hold sparse requests refuses it.
"""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import Driver, P, W
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import decode_body
from vllm_hisparse.core.sparse_layer import paged_dense_reference


def _cfg(min_context: int) -> HiSparseConfig:
    return HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                          min_context=min_context, host_pool_gib=0.01)


def _run(stock: bool, full: bool):
    d = Driver(_cfg(W * P + 1), rows=4, full=full)        # max_model_len W * P: never sparse
    calls = []
    if stock:
        def fn(*a):
            calls.append(a[6:8])                          # (max_q, max_k)
            paged_dense_reference(*a)
        d.rt.use_decode_fn(fn)
    prompts = {"a": 70, "b": 33, "c": 5}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 40, "b": 33, "c": 5})
    d.step({"a": 30, "b": 1, "c": 1})                     # a mixed step: prefill + decode rows
    for _ in range(12):
        d.step({rid: 1 for rid in prompts})
    stats = d.rt.stats_dict()
    for rid in prompts:
        assert d.rt.finish(rid)
    return d, calls, stats


@pytest.mark.parametrize("full", [False, True])
def test_stock_decode_equals_the_decode_body(full):
    s, calls, stats = _run(True, full)
    b, none, _ = _run(False, full)
    assert not none and stats["decode_rows"] == 0          # no sparse row ever
    # every layer of every step with decode rows took decode_fn, keys bound = the table's width
    assert len(calls) == 13 * s.L and set(calls) == {(1, W * P)}
    assert len(s.outs) == len(b.outs)
    for i, (x, y) in enumerate(zip(s.outs, b.outs)):
        assert not torch.isnan(x).any(), f"step/layer {i}: a row left unwritten"
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=f"step/layer {i}")
    for kx, ky in zip(s.kv, b.kv):
        assert torch.equal(kx, ky)                         # the new tokens in the same blocks
    assert s.rt._body(0) is decode_body.stock_layer and b.rt._body(1) is decode_body.sparse_layer


@pytest.mark.parametrize("full", [False, True])
def test_decode_fn_plan_once_a_step_to_every_layer(full):
    """A decode_fn with a ``plan`` (FA3's scheduler metadata on the GPU): planned at each step's
    first layer from that step's keys and shapes, the result handed to every layer of that step
    and to no other step (a stale plan would point FlashAttention at last step's lengths)."""
    d = Driver(_cfg(W * P + 1), rows=4, full=full)
    plans, got = [], []

    def fn(*a, plan):
        got.append(plan)
        paged_dense_reference(*a)

    def plan(q, k_cache, cu_q, seq_k, max_q, max_k):
        plans.append((seq_k.clone(), q.shape[0], max_k))
        return len(plans)                                 # this step's token

    fn.plan = plan
    d.rt.use_decode_fn(fn)
    for rid, n in {"a": 70, "b": 33}.items():
        d.add(rid, n)
    d.step({"a": 40, "b": 33})
    d.step({"a": 30, "b": 1})                             # mixed: b's decode row, a's chunk
    for _ in range(5):
        d.step({"a": 1, "b": 1})
    assert len(plans) == 6 and got == [t for t in range(1, 7) for _ in range(d.L)]
    seq = [p[0][:p[1]].tolist() for p in plans]           # each plan saw its own step's lengths
    assert seq[0][0] == 34 and [s[0] for s in seq[1:]] == [71 + i for i in range(5)]
    assert {p[2] for p in plans} == {W * P}


def test_decode_fn_refused_where_requests_can_be_sparse():
    d = Driver(_cfg(W * P), rows=2)                        # max_model_len reaches min_context
    assert d.rt.sparse_possible
    with pytest.raises(ValueError, match="no request can be sparse"):
        d.rt.use_decode_fn(paged_dense_reference)
