"""The DSA step plan in fixed-address buffers (core/latent_graph.py), against the core's own
per-step tensors (core/latent_step.py, itself checked against loops in tests/test_dsa_core.py):
the same pool rows in the same order, the same RESOLVE state, hits and misses, the same bytes
written, over several steps through one set of buffers, with vLLM's padding tokens after the
step's own; a cleared plan writes and reads nothing; batch_tokens against a loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.latent_admission import LatentAdmission
from vllm_hisparse.core.latent_graph import LatentGraphStep, batch_tokens
from vllm_hisparse.core.latent_pool import LatentPool
from vllm_hisparse.core.latent_step import LatentStep, plan_arrays
from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK, LATENT_ROW

BF = torch.bfloat16
LAYERS, MML, B, K = 2, 96, 24, 16
PAD = (0, 3)                 # vLLM's padding tokens after the step's own (CUDA-graph sizes)


def engine(resident: bool, seed: int, policy: str = "lru"):
    g = torch.Generator().manual_seed(seed)
    pool = LatentPool(LAYERS, MML, B, 0 if resident else 3, 3 if resident else 2, policy=policy)
    host = None if resident else HostKVPool(LAYERS, 600, 1, 1, LATENT_ROW // 2, BF, pin=False)
    for rows in pool.rows:
        rows.copy_(torch.randn(rows.shape, generator=g).to(BF))
    if host is not None:
        host.data.copy_(torch.randn(host.data.shape, generator=g).to(BF))
    return pool, host, LatentAdmission(pool, host)


def admit_all(adm):
    for key, n in (("a", 60), ("b", 40), ("c", 30)):
        assert adm.admit(key, n, 20) is not None
        if key != "c":
            adm.prompt_done(key)        # a, b decode (row sets); c is in prefill (a region)


STEPS = [  # keys, tokens per key (0 = a row without tokens), their first position
    (["a", "b", "c"], [1, 1, 5], [60, 40, 0]),
    (["b", None, "a", "c"], [1, 0, 1, 7], [41, 0, 61, 5]),
    (["c"], [3], [12]),
    (["a", "b"], [1, 1], [62, 42]),
]


def step_inputs(keys, counts, first):
    req = np.concatenate([np.full(n, i) for i, n in enumerate(counts)])
    pos = np.concatenate([np.arange(f, f + n) for f, n in zip(first, counts)])
    return req, pos


@pytest.mark.parametrize("resident, policy", [(False, "lru"), (False, "crf"), (True, "lru")])
@pytest.mark.parametrize("pad", PAD)
def test_graph_step_equals_the_core_step(resident, policy, pad):
    pa, ha, adm_a = engine(resident, 1, policy)
    pb, hb, adm_b = engine(resident, 1, policy)
    admit_all(adm_a)
    admit_all(adm_b)
    graph = LatentGraphStep(adm_b, max_tokens=16, max_decodes=4, top_k=K)
    g = torch.Generator().manual_seed(2)
    for keys, counts, first in STEPS:
        req, pos = step_inputs(keys, counts, first)
        n = len(req)
        core = LatentStep.plan(adm_a, keys, req, pos)
        graph.load(LatentStep.plan(adm_b, keys, req, pos))
        for layer in range(LAYERS):
            kv_c = torch.randn(n + pad, KV_LORA_RANK, generator=g).to(BF)
            k_pe = torch.randn(n + pad, LATENT_ROW - KV_LORA_RANK, generator=g).to(BF)
            core.write(layer, kv_c[:n], k_pe[:n])
            graph.write(layer, kv_c, k_pe)                 # padding tokens: planned -1
            topk = torch.full((n + pad, K), -1, dtype=torch.int32)
            for t in range(n):                             # a causal selection, -1 after
                m = min(K, int(pos[t]) + 1)
                topk[t, :m] = torch.randperm(int(pos[t]) + 1, generator=g)[:m].int()
            topk[:n, -1] = MML + 3                         # past max_model_len -> -1
            want, want_valid = core.convert(layer, topk[:n])
            got, got_valid = graph.convert(layer, topk)
            assert torch.equal(got[:n], want) and torch.equal(got_valid[:n], want_valid)
            assert (got[n:] == -1).all() and (got_valid[n:] == 0).all()
            assert torch.equal(pa.rows[layer], pb.rows[layer])
            for sa, sb in zip(pa.states, pb.states):
                assert torch.equal(sa.slot_unit, sb.slot_unit)
                assert torch.equal(sa.unit_slot, sb.unit_slot)
                assert all(torch.equal(sa.pstate[n], sb.pstate[n]) for n in sa.pstate)
        assert torch.equal(pa.counts, pb.counts)
    if ha is not None:
        assert torch.equal(ha.data, hb.data)
        assert pa.counts[1] > 0                            # misses happened


def test_cleared_plan_writes_and_reads_nothing():
    pool, host, adm = engine(False, 3)
    admit_all(adm)
    graph = LatentGraphStep(adm, max_tokens=8, max_decodes=4, top_k=K)
    keys, counts, first = STEPS[0]
    graph.load(LatentStep.plan(adm, keys, *step_inputs(keys, counts, first)))
    graph.clear()                                          # what a dummy run / a capture sees
    rows, hdata, counts0 = [r.clone() for r in pool.rows], host.data.clone(), pool.counts.clone()
    kv_c = torch.randn(8, KV_LORA_RANK).to(BF)
    k_pe = torch.randn(8, LATENT_ROW - KV_LORA_RANK).to(BF)
    graph.write(0, kv_c, k_pe)
    out, valid = graph.convert(0, torch.arange(8 * K, dtype=torch.int32).view(8, K) % 50)
    assert (out == -1).all() and (valid == 0).all()
    assert all(torch.equal(a, b) for a, b in zip(rows, pool.rows))
    assert torch.equal(hdata, host.data) and torch.equal(counts0, pool.counts)


def test_graph_step_refuses_what_its_buffers_cannot_hold():
    pool, host, adm = engine(False, 4)
    admit_all(adm)
    graph = LatentGraphStep(adm, max_tokens=4, max_decodes=1, top_k=K)
    with pytest.raises(ValueError, match="exceeds the buffers"):
        graph.load(LatentStep.plan(adm, ["a", "b"], [0, 1], [60, 40]))      # 2 decodes > 1
    with pytest.raises(ValueError, match="exceed the plan's 4"):
        graph.write(0, torch.zeros(5, KV_LORA_RANK, dtype=BF),
                    torch.zeros(5, LATENT_ROW - KV_LORA_RANK, dtype=BF))
    with pytest.raises(ValueError, match="int32"):
        graph.convert(0, torch.zeros(2, K + 1, dtype=torch.int32))
    wide = LatentGraphStep(adm, max_tokens=4, max_decodes=4, top_k=K)
    wide.load_arrays(plan_arrays(adm, ["a", "b"], [0, 1], [60, 40]))        # 2 decode tokens
    with pytest.raises(ValueError, match="a call of 1 tokens for a plan of 2 decode tokens"):
        wide.convert(0, torch.zeros(1, K, dtype=torch.int32))   # RESOLVE covers min(D, T) = 1


@pytest.mark.parametrize("qsl, seq", [([0, 1, 6, 6, 9], [10, 5, 7, 3]), ([0], []),
                                      ([0, 0, 4], [0, 4]), ([2, 3, 5], [8, 2])])
def test_batch_tokens_matches_a_loop(qsl, seq):
    req, pos = batch_tokens(qsl, seq)
    want_r, want_p = [], []
    for i in range(len(seq)):
        n = qsl[i + 1] - qsl[i]
        for j in range(n):
            want_r.append(i)
            want_p.append(seq[i] - n + j)
    assert req.tolist() == want_r and pos.tolist() == want_p
    with pytest.raises(ValueError, match="at most seq_len"):
        batch_tokens([0, 5], [4])


@pytest.mark.parametrize("resident, verify", [(False, None), (True, None), (False, 3),
                                              (True, 3)])
def test_one_copy_load_equals_the_tensor_load(resident, verify):
    """LatentRuntime's load (``plan_arrays`` on the host, ``load_arrays``: one H2D copy, then the
    host-row gather and slot rows on the device) fills the buffers as ``load(LatentStep.plan)``
    does: every live entry equal, over the steps above and, with verify rows, requests of 2 and 3
    tokens; then the same layer results."""
    from vllm_hisparse.core.latent_step import plan_arrays

    _, _, adm_a = engine(resident, 1)
    pb, _, adm_b = engine(resident, 1)
    admit_all(adm_a)
    admit_all(adm_b)
    ga = LatentGraphStep(adm_a, max_tokens=16, max_decodes=4, top_k=K, verify_tokens=verify)
    gb = LatentGraphStep(adm_b, max_tokens=16, max_decodes=4, top_k=K, verify_tokens=verify)
    steps = STEPS + ([(["a", "b", "c"], [2, 3, 4], [63, 43, 16])] if verify else [])
    most = 0
    for keys, counts, first in steps:
        req, pos = step_inputs(keys, counts, first)
        ga.load(LatentStep.plan(adm_a, keys, req, pos, verify))
        gb.load_arrays(plan_arrays(adm_b, keys, req, pos, verify))
        for name in ("host_row", "pool_row", "region_base", "dec_gather", "dec_scatter",
                     "dec_seq"):
            assert torch.equal(getattr(ga, name), getattr(gb, name)), name
        d = int((ga.dec_seq > 0).sum()) if ga.D else 0
        assert torch.equal(ga.dec_rows[:d], gb.dec_rows[:d])
        assert torch.equal(ga.dec_slots[:d], gb.dec_slots[:d])
        assert (ga.verify is None) == (gb.verify is None) == (resident or verify is None)
        if ga.verify is not None:
            va, vb = ga.verify, gb.verify
            g = int((va.seq > 0).sum())
            assert g == int((vb.seq > 0).sum()) and torch.equal(va.tok, vb.tok)
            assert torch.equal(va.pos, vb.pos) and torch.equal(va.seq, vb.seq)
            assert torch.equal(va.rows[:g], vb.rows[:g]) and torch.equal(va.slots[:g], vb.slots[:g])
            most = max(most, g, int((va.pos >= 0).sum()) - g)
    assert most >= (2 if verify and not resident else 0)
    with pytest.raises(ValueError, match="exceeds the buffers' 16"):
        gb.load_arrays(plan_arrays(adm_b, ["c"], np.zeros(17, np.int64), np.arange(17)))
    assert pb is not None
