"""A request turning sparse mid-run (core/turn_sparse.py): a short prompt whose context reaches
min_context while it decodes, a prefill chunk crossing min_context, a recompute after preemption
reading given-back pages from the host — hisparse equal to resident mode bit for bit, with the
runtime driven as tests/test_sparse_runtime_exact.py drives it (blocks the scheduler would free
poisoned with NaN)."""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import HKV, D, L, P, Driver
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.residency import freed_pages


def _switch_run(host_tier: bool, full: bool, dense_pool_gib: float = 0.0):
    """A 12-token prompt decoding to 100 tokens with min_context 40, alone: dense until the step
    whose context reaches 40, sparse from that step on. Checked at the switch step: the host pool
    holds the bytes of its first 40 positions (every host layer), its Quest row the bounds of its
    KV. Returns the outputs, the stats and the step at which it turned sparse."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                         dense_pool_gib=dense_pool_gib, resident_first=False)
    d = Driver(cfg, full=full)
    d.add("grow", 12)
    d.step({"grow": 12})
    turned_at, before = None, None
    blocks = d.blocks["grow"][:5].long()                       # pages 0..4 = positions 0..39
    for _ in range(88):
        d.step({"grow": 1})
        r = d.rt.reqs["grow"]
        seq = d.lens["grow"]
        assert r.sparse == (seq >= 40), seq                    # the length rule, to the token
        if seq == 39:                  # the cache before the switch step (which frees block 4)
            before = [kv[blocks].clone() for kv in d.kv]       # (5, 2, P, Hkv, D) per layer
        if seq != 40:
            continue
        turned_at = seq
        assert d.rt.stats["turned_sparse"] == 1 and r.irow >= 0
        for layer in range(L):
            # positions 0..38 as they were in the cache, 39 the switch step's own token
            kv39 = before[layer].transpose(1, 2).reshape(40, 2, HKV, D)[:39]
            if host_tier:
                pool, pt = d.rt.host_layer(layer), d.rt.pool
                if pool is None:                               # a dense layer in the dense pool
                    pool, pt = d.rt.dense_pool_layer(layer), d.rt.dpool
                got = pool[torch.tensor(pt.page_table("grow")[:5])]
                got = got.transpose(1, 2).reshape(40, 2, HKV, D)
                assert torch.equal(got[:39], kv39), layer        # every byte of K and V
                keys = got[:, 0]
            else:
                keys = d.kv[layer][blocks].transpose(1, 2).reshape(40, 2, HKV, D)[:, 0]
                assert torch.equal(keys[:39], kv39[:, 0])
            if layer not in cfg.dense_layers:                  # Quest bounds of every page
                pages = keys.view(5, P, HKV, D)
                assert torch.equal(d.rt.ix.kmin[layer][r.irow, :5], pages.amin(1)), layer
                assert torch.equal(d.rt.ix.kmax[layer][r.irow, :5], pages.amax(1)), layer
    stats = d.rt.stats_dict()
    assert d.rt.finish("grow") and d.rt.host_pages_used == 0
    assert d.rt.stats_dict()["dense_pool_pages_used"] == 0
    return d.outs, stats, turned_at


@pytest.mark.parametrize("full,dense_pool_gib", [(False, 0.0), (True, 0.0), (False, 0.001)])
def test_short_prompt_turns_sparse_at_min_context(full, dense_pool_gib):
    """core/residency.py's length rule at the runtime: a short prompt that generates past
    min_context turns sparse at the step its context reaches it (its KV so far copied to the host
    pool / dense pool and its Quest row: core/turn_sparse.py), then decodes through the hot buffer
    with misses, with every block the KV manager frees from then on poisoned (as for a long prompt:
    S hot blocks + the newest page kept); hisparse equals resident mode bit for bit; pools empty
    afterwards."""
    hs, stats, at = _switch_run(True, full, dense_pool_gib)
    res, res_stats, res_at = _switch_run(False, full)
    assert at == res_at == 40
    assert len(hs) == len(res)
    for i, (a, b) in enumerate(zip(hs, res)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN (read a freed block)"
        assert torch.equal(a, b), f"step/layer {i} differs"
    # decode rows from seq 13 to 100: dense up to 39, sparse from 40 on (61 rows)
    assert stats["turned_sparse"] == res_stats["turned_sparse"] == 1
    assert stats["decode_rows"] == res_stats["decode_rows"] == 100 - 40 + 1
    assert stats["dense_decode_rows"] == 40 - 13
    assert stats["misses"] > 0 and stats["hits"] > 0
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, min_context=40)

    def held(processed, prompt):                  # blocks kept while computing token `processed`
        lo, hi = freed_pages(cfg, processed, prompt)
        return -(-(processed + 1) // P) - max(hi - lo, 0)
    for processed in range(12, 101):              # as a 40-token prompt from 40 on: S + 1 blocks
        if processed >= 40:
            assert held(processed, 12) == held(processed, 40) <= cfg.num_slots + 1
        else:
            assert freed_pages(cfg, processed, 12)[1] == cfg.num_slots      # nothing freed yet


def test_prefill_chunk_crossing_min_context_turns_sparse():
    """A recomputed request (after a preemption vLLM prefills prompt + generated tokens again) whose
    chunk crosses min_context mid-way: the KV of the earlier chunk is copied at that step, the
    chunk's own tokens written through; equal to resident mode, pools empty afterwards."""
    outs = []
    for host_tier in (True, False):
        cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                             min_context=40, host_pool_gib=0.01, host_tier=host_tier)
        d = Driver(cfg)
        d.add("r", 12)
        d.step({"r": 30})
        assert not d.rt.reqs["r"].sparse
        d.step({"r": 30})                                      # 30..59: crosses 40
        assert d.rt.reqs["r"].sparse and d.rt.stats["turned_sparse"] == 1
        for _ in range(20):
            d.step({"r": 1})
        assert d.rt.stats_dict()["decode_rows"] == 20
        assert d.rt.finish("r") and d.rt.host_pages_used == 0
        outs.append(d.outs)
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        assert not torch.isnan(a).any() and torch.equal(a, b), f"step/layer {i} differs"


@pytest.mark.parametrize("dense_pool_gib", [0.0, 0.001])
def test_recompute_after_preemption_reads_given_back_pages_from_the_host(dense_pool_gib):
    """vLLM recomputes a preempted request from token 0 (prompt and generated tokens) in chunks; a
    chunk that starts past the point where the KV manager gives pages back (residency.freed_pages:
    the prompt and min_context both processed) finds them gone, in every layer, and reads them from
    the host pool (the dense layers from the dense pool when there is one). A long prompt and a
    short one that turned sparse, both recomputed in three chunks with the given-back blocks
    poisoned; equal to resident mode bit for bit."""
    outs = []
    for host_tier in (True, False):
        cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                             min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                             dense_pool_gib=dense_pool_gib if host_tier else 0.0)
        d = Driver(cfg)
        d.add("long", 60)
        d.add("grow", 12)
        d.step({"long": 60, "grow": 12})
        for _ in range(40):
            d.step({"long": 1, "grow": 1})                     # 100 and 52 tokens
        assert d.rt.reqs["grow"].sparse
        d.lens["long"] = d.lens["grow"] = 0                    # preempted: recomputed from 0
        d.step({"long": 32, "grow": 24})
        d.step({"long": 40, "grow": 24})                       # long: 32..72, grow: 24..48
        if host_tier:                                          # long: pages 4..8 given back
            assert freed_pages(cfg, 72, 60) == (4, 9) and freed_pages(cfg, 48, 12) == (4, 6)
        d.step({"long": 28, "grow": 4})                        # past them: read from the host
        for _ in range(10):
            d.step({"long": 1, "grow": 1})
        assert d.rt.finish("long") and d.rt.finish("grow") and d.rt.host_pages_used == 0
        outs.append(d.outs)
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN (read a freed block)"
        assert torch.equal(a, b), f"step/layer {i} differs"
