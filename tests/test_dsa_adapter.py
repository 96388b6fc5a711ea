"""The DSA adapter's CPU-runnable parts against vLLM 0.26's interfaces, without an engine (the CPU
platform has no MLA backend): the connector (vllm/connector.py, with vllm/mla_connector.py's MLA
halves) in both roles driven by a scripted vLLM scheduler (chunked prefill under a token budget,
FULL-graph padding rows and tokens, a preemption, requests waiting for a region, admissions whose
block allocation fails), the worker
object the MLA impl makes (vllm/mla_worker.py: ``LatentWorker.start``, ``note``, the write and
conversion the impl forwards to), attention by ops/sparse_mla.py where the impl calls FA3.

Every attention output (prefill and decode, every layer) must be bit-identical to the same
attention over the ground-truth rows gathered by the selection (a different computation: no pool,
no conversion), in hisparse and in resident mode; the pool's size is what mla_worker computes;
nothing is held at the end."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK, LATENT_ROW, sparse_mla_decode

pytestmark = pytest.mark.vllm

BF = torch.bfloat16
LAYERS, MML, K, B, H = 2, 160, 16, 24, 2
SCALE = 192 ** -0.5
BUDGET, SEQS = 32, 4
DSA = {"indexer": "dsa", "top_k": K, "device_buffer_size": B, "dense_layers": [],
       "host_pool_gib": 0.002, "quest_rows": 3}
PROMPTS = [70, 25, 100, 40, 130]
MAX_TOKENS = [10, 30, 6, 12, 8]
PREEMPT = ("r1", 5)           # preempt r1 after its 5th output token


def vconfig(extra: dict):
    hf = SimpleNamespace(index_topk=K, kv_lora_rank=KV_LORA_RANK,
                         qk_rope_head_dim=LATENT_ROW - KV_LORA_RANK)
    mc = SimpleNamespace(max_model_len=MML, hf_config=hf, dtype=BF,
                         get_num_layers=lambda pc: LAYERS)
    return SimpleNamespace(
        additional_config={"hisparse": {**DSA, **extra}}, model_config=mc,
        parallel_config=SimpleNamespace(),
        scheduler_config=SimpleNamespace(max_num_seqs=SEQS, max_num_batched_tokens=BUDGET),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=0,
                                           static_forward_context={}),
        kv_transfer_config=SimpleNamespace(kv_connector="HiSparseMLAConnector"))


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % (1 << 31))


def latent(rid: str, layer: int) -> torch.Tensor:
    """Ground truth: every latent row of a request's positions (MML, 576) bf16."""
    return torch.randn(MML, LATENT_ROW, generator=_gen("lat", rid, layer)).to(BF)


def selection(rid: str, pos: int, layer: int) -> torch.Tensor:
    """The indexer's choice for a token: up to K positions <= pos, any order, -1 after."""
    sel = torch.full((K,), -1, dtype=torch.int32)
    m = min(K, pos + 1)
    sel[:m] = torch.randperm(pos + 1, generator=_gen("sel", rid, pos, layer))[:m].int()
    return sel


class Req(SimpleNamespace):
    pass


def with_worker(vc, w):
    """vc's static forward context holds a layer whose impl keeps ``w``, as the first MLA impl
    leaves it (vllm/worker.py)."""
    vc.compilation_config.static_forward_context["model.layers.0.self_attn.mla_attn"] = \
        SimpleNamespace(impl=SimpleNamespace(hisparse_worker=w))
    return vc


def run_engine(extra: dict):
    from vllm_hisparse.vllm.compat import KVConnectorRole
    from vllm_hisparse.vllm.deployment import deployment_of
    from vllm_hisparse.vllm.connector import HiSparseConnector as HiSparseMLAConnector
    from vllm_hisparse.vllm.mla_worker import LatentWorker, pool_bytes

    vc = vconfig(extra)
    w = LatentWorker.start(vc, LATENT_ROW, K, BF)
    rt = w.runtime
    s = deployment_of(vc).latent
    assert s.row_bytes == 2 * LATENT_ROW
    assert rt.pool.nbytes == pool_bytes(s, LAYERS, MML, B)
    with pytest.raises(RuntimeError, match="without the MLA attention backend"):
        HiSparseMLAConnector(vc, KVConnectorRole.WORKER)          # no impl made the worker
    with_worker(vc, w)
    sched = HiSparseMLAConnector(vc, KVConnectorRole.SCHEDULER)
    work = HiSparseMLAConnector(vc, KVConnectorRole.WORKER)
    lat = {(f"r{i}", l): latent(f"r{i}", l) for i in range(len(PROMPTS)) for l in range(LAYERS)}
    reqs = [Req(request_id=f"r{i}", num_prompt_tokens=p, max_tokens=m, num_tokens=p, computed=0,
                outputs=0, block=None, resumed=False, seen=False)
            for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    waiting, running, outs, blocks = list(reqs), [], {}, iter(range(1, 10 ** 6))
    max_prefill = max_live = 0
    preempted = False
    checks = 0
    for step in range(400):
        budget, sched_n = BUDGET, {}
        for r in running:
            sched_n[r.request_id] = n = min(r.num_tokens - r.computed, budget)
            budget -= n
        while waiting and len(running) < SEQS and budget > 0:
            r = waiting[0]
            got, _ = sched.get_num_new_matched_tokens(r, r.computed)
            if got is None:
                break
            checks += 1
            if checks % 3 == 2:            # vLLM's allocate_slots found no blocks: not scheduled
                break
            sched.update_state_after_alloc(r, None, 0)
            waiting.pop(0)
            running.append(r)
            r.resumed, r.block = r.seen, next(blocks)
            sched_n[r.request_id] = n = min(r.num_tokens - r.computed, budget)
            budget -= n
        running = [r for r in running if sched_n.get(r.request_id, 0) > 0] + \
            [r for r in running if sched_n.get(r.request_id, 0) == 0]
        batch = [r for r in running if sched_n.get(r.request_id, 0) > 0]
        new = [r for r in batch if not r.seen]
        cached = [r for r in batch if r.seen]
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=([r.block],),
                                                num_computed_tokens=r.computed) for r in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.request_id for r in cached],
                resumed_req_ids={r.request_id for r in cached if r.resumed},
                new_block_ids=[([r.block],) if r.resumed else None for r in cached],
                num_computed_tokens=[r.computed for r in cached]),
            num_scheduled_tokens=sched_n)
        md = sched.build_connector_meta(so)
        for r in batch:
            r.seen, r.resumed = True, False
        # the worker: vLLM's batch plus one padding row and two padding tokens (a FULL graph's)
        qsl, seq, first = [0], [], []
        for r in batch:
            qsl.append(qsl[-1] + sched_n[r.request_id])
            seq.append(r.computed + sched_n[r.request_id])
            first.append(r.block)
        qsl.append(qsl[-1])
        seq.append(0)
        first.append(-1)
        w.note(qsl, seq, first)
        work.bind_connector_metadata(md)
        work.start_load_kv(None)
        max_prefill = max(max_prefill, sum(g.in_region for g in rt.adm.grants.values()))
        max_live = max(max_live, len(rt.adm.grants))
        toks = [(r.request_id, p) for r in batch
                for p in range(r.computed, r.computed + sched_n[r.request_id])]
        T = len(toks)
        pad = min(2, BUDGET - T)                # vLLM pads up to a capture size <= the budget
        for layer in range(LAYERS):
            rows = [lat[rid, layer][p] for rid, p in toks] + [torch.ones(LATENT_ROW, dtype=BF)] * pad
            rows = torch.stack(rows)
            rt.write(layer, rows[:, :KV_LORA_RANK], rows[:, None, KV_LORA_RANK:])
            topk = torch.stack([selection(rid, p, layer) for rid, p in toks]
                               + [torch.arange(K, dtype=torch.int32)] * pad)
            idx, valid = rt.convert(layer, topk)
            assert (idx[T:] == -1).all() and (valid[T:] == 0).all()
            q = torch.stack([torch.randn(H, LATENT_ROW, generator=_gen("q", rid, p, layer))
                             for rid, p in toks]).to(BF)
            got = sparse_mla_decode(q[:T, :, :KV_LORA_RANK], q[:T, :, KV_LORA_RANK:],
                                    rt.pool.rows[layer], idx[:T], SCALE)
            for t, (rid, p) in enumerate(toks):
                sel = topk[t]
                truth = lat[rid, layer][sel.long().clamp(min=0)]
                want = sparse_mla_decode(q[t:t + 1, :, :KV_LORA_RANK], q[t:t + 1, :, KV_LORA_RANK:],
                                         truth, torch.where(sel >= 0, torch.arange(K), -1)[None],
                                         SCALE)
                assert torch.equal(got[t:t + 1], want), (extra, rid, p, layer)
                assert int(valid[t]) == int((sel >= 0).sum())
                outs.setdefault((rid, p, layer), []).append(got[t])
        finished = set()
        for r in batch:
            r.computed += sched_n[r.request_id]
            if r.computed == r.num_tokens:
                r.outputs += 1
                if r.outputs == r.max_tokens:
                    finished.add(r.request_id)
                    sched.request_finished(r, ([r.block],))
                else:
                    r.num_tokens += 1
        running = [r for r in running if r.request_id not in finished]
        work.get_finished(finished)
        victim = next((r for r in running if (r.request_id, r.outputs) == PREEMPT), None)
        if victim is not None and not preempted:        # vLLM's recompute preemption
            preempted = True
            running.remove(victim)
            victim.computed = 0
            waiting.insert(0, victim)
        if not waiting and not running:
            break
    empty = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                            scheduled_cached_reqs=SimpleNamespace(
                                req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                num_computed_tokens=[]))
    w.note([0], [], [])
    work.bind_connector_metadata(sched.build_connector_meta(empty))    # the last releases
    work.start_load_kv(None)
    assert preempted and all(r.outputs == r.max_tokens for r in reqs)
    return rt, outs, max_prefill, max_live


@pytest.mark.parametrize("resident_first", [False, True])
def test_connector_and_impl_path_hisparse_and_resident_equal_the_ground_truth(resident_first):
    """resident_first off: every complete prompt decodes through its row set; on (the default): a
    complete prompt keeps its region, decoding from it, until an admission takes it (demote), then
    through its row set: fewer misses over the same schedule, the same outputs."""
    hs, hs_out, hs_prefill, hs_live = run_engine({"resident_first": resident_first})
    st = hs.stats()
    assert st["misses"] > 0 and st["hits"] > 0 and not st["resident"]
    assert {s.policy.name for s in hs.pool.states} == {"lru"}      # the default
    assert hs_prefill == 1 and hs_live <= DSA["quest_rows"]       # prefill_slots, row sets bind
    assert hs.adm.leaks() == [] and st["regions_lent"] == 0
    if resident_first:
        fixed = run_engine({"resident_first": False})[0].stats()
        assert st["demotions"] >= 3 and st["misses"] < fixed["misses"], (st, fixed)
    else:
        assert st["demotions"] == 0
    rs, rs_out, _, _ = run_engine({"host_tier": False})
    assert rs.stats()["misses"] == 0 and rs.adm.leaks() == []
    assert hs_out.keys() == rs_out.keys()
    for key, vals in hs_out.items():
        assert len(vals) == len(rs_out[key]) and all(torch.equal(a, b)
                                                     for a, b in zip(vals, rs_out[key])), key
    assert any(len(v) > 1 for v in hs_out.values())               # the preempted recompute


def test_connector_and_impl_path_serve_the_configured_policy():
    """policy crf reaches every layer's RESOLVE state of the worker's pool; the outputs still
    equal the ground truth (run_engine checks each) and misses happen."""
    rt, _, _, _ = run_engine({"policy": "crf"})
    assert {s.policy.name for s in rt.pool.states} == {"crf"} and rt.pool.policy == "crf"
    st = rt.stats()
    assert st["misses"] > 0 and st["hits"] > 0 and rt.adm.leaks() == []
    assert st["policy"] == "crf" and st["host_ms_plan"] > 0      # what bench.serving reads


def test_stub_spec_keeps_the_group_and_shrinks_the_page():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    from vllm_hisparse.vllm.mla_spec import stub_spec

    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=LATENT_ROW, dtype=BF,
                              cache_dtype_str="auto")
    index = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    stub = stub_spec(latent)
    assert type(stub) is MLAAttentionSpec and stub.head_size == 8
    assert stub.page_size_bytes == 64 * 16 and latent.page_size_bytes == 64 * 1152
    assert UniformTypeKVCacheSpecs.is_uniform_type({"a": stub, "i": index})
    assert type(stub).merge([stub, stub]).head_size == 8


def test_impl_writes_and_converts_for_its_own_layer_and_calls_fa3_over_the_pool(monkeypatch):
    """vllm/mla_backend.py's impl methods on the CPU: vLLM's flash-attention module replaced by a
    stand-in (the real one needs CUDA) whose FA3 computes the paged call's meaning with
    ops/sparse_mla.py; the builder subclass notes each batch (the stock build stubbed); one
    request through a prefill step and decode steps, layer 1 of 2: outputs
    equal attention over the ground-truth rows, the call gets views of the pool, layer 0 stays
    untouched."""
    import importlib
    import sys
    import types

    from vllm_hisparse.vllm.mla_worker import LatentWorker

    calls = []

    def fake_fa3(q, k, v, q_v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, block_table,
                 softmax_scale, causal, num_splits, fa_version):
        T = q.shape[0]
        assert (max_seqlen_q, causal, fa_version, max_seqlen_k) == (1, True, 3, K)
        assert k.shape[1:] == (1, 1, LATENT_ROW - KV_LORA_RANK) and v.shape[1:] == (1, 1, KV_LORA_RANK)
        assert torch.equal(cu_seqlens_q, torch.arange(T + 1, dtype=torch.int32))
        calls.append((k.data_ptr(), v.data_ptr(), num_splits))
        kv = torch.cat([v[:, 0, 0], k[:, 0, 0]], 1)
        idx = torch.where(torch.arange(K) < seqused_k[:, None].long(), block_table, -1)
        return sparse_mla_decode(q_v, q, kv, idx, softmax_scale)

    fa = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    fa.flash_attn_varlen_func = fake_fa3
    pkg = types.ModuleType("vllm.vllm_flash_attn")
    pkg.__path__, pkg.flash_attn_interface = [], fa
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", fa)
    for name in ("vllm.v1.attention.backends.mla.flashattn_mla_sparse",
                 "vllm_hisparse.vllm.mla_backend"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    mb = importlib.import_module("vllm_hisparse.vllm.mla_backend")
    assert mb.HiSparseMLASparseBackend.get_name() == "CUSTOM"
    assert mb.HiSparseMLASparseBackend.get_kv_cache_shape(10, 64, 1, 8) == (10, 64, 8)

    w = LatentWorker.start(vconfig({"resident_first": False}), LATENT_ROW, K, BF)   # RESOLVE
    rt = w.runtime
    monkeypatch.setattr(mb.FlashAttnMLASparseMetadataBuilder, "build",
                        lambda self, cpl, cm, fast_build=False: "stock metadata")
    builder = object.__new__(mb.HiSparseMLASparseMetadataBuilder)
    builder.worker = w                                   # what __init__ finds through the layers
    impl = object.__new__(mb.HiSparseMLASparseImpl)
    impl.hisparse_worker = w
    impl.kv_lora_rank, impl.qk_rope_head_dim = KV_LORA_RANK, LATENT_ROW - KV_LORA_RANK
    impl.scale, impl.num_splits, impl._layer = SCALE, 0, None
    impl.topk_indices_buffer = torch.full((BUDGET, K), -1, dtype=torch.int32)
    layer = SimpleNamespace(impl=impl, layer_name="model.layers.1.self_attn.mla_attn")
    impl._static = {"model.layers.0.self_attn.mla_attn": SimpleNamespace(impl=object()),
                    "model.layers.0.self_attn.indexer.k_cache": SimpleNamespace(),
                    layer.layer_name: layer}
    rt.apply([("admit", "a", 30, 6)])
    w.rows.bind("a", 7)
    lat = latent("a", 1)
    layer0 = rt.pool.rows[0].clone()
    stub = torch.zeros(4, 64, 8, dtype=BF)
    steps = [(0, 30), (30, 1), (31, 1), (32, 1)]          # (first position, tokens)
    for first, n in steps:
        if first == 30:
            rt.apply([("prompt_done", "a")])
        cm = SimpleNamespace(num_reqs=2, query_start_loc_cpu=torch.tensor([0, n, n]),
                             _seq_lens_cpu=torch.tensor([first + n, 0]),
                             block_table_tensor=torch.tensor([[7, 9], [0, 0]], dtype=torch.int32))
        assert builder.build(0, cm) == "stock metadata"      # a padding row after the request's
        w.plan()
        pos = list(range(first, first + n))
        impl.do_kv_cache_update(lat[pos, :KV_LORA_RANK], lat[pos, None, KV_LORA_RANK:], stub,
                                torch.zeros(n, dtype=torch.int64), "auto", None)
        sel = torch.stack([selection("a", p, 1) for p in pos])
        impl.topk_indices_buffer[:n] = sel
        q = torch.randn(n, H, LATENT_ROW, generator=_gen("q", first)).to(BF)
        out, lse = impl.forward_mqa((q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]), stub, None,
                                    layer)
        assert lse is None
        for t in range(n):
            want = sparse_mla_decode(q[t:t + 1, :, :KV_LORA_RANK], q[t:t + 1, :, KV_LORA_RANK:],
                                     lat[sel[t].long().clamp(min=0)],
                                     torch.where(sel[t] >= 0, torch.arange(K), -1)[None], SCALE)
            assert torch.equal(out[t:t + 1], want), (first, t)
    rows = rt.pool.rows[1]
    assert all(c == (rows.data_ptr() + KV_LORA_RANK * 2, rows.data_ptr(), 0) for c in calls)
    assert len(calls) == len(steps) and torch.equal(rt.pool.rows[0], layer0)
    assert rt.stats()["misses"] > 0 and impl._layer == 1


def test_a_lent_region_is_demoted_only_for_a_request_vllm_schedules():
    """resident_first, one prefill region: r0's complete prompt keeps it, lent. r1 passes the
    check (get_num_new_matched_tokens -> 0) but vLLM finds no blocks for it: nothing is taken,
    r0 keeps its region. Asked again and allocated, r1 takes it: r0's demotion comes before r1's
    admission in the worker's events. Taking the admission in get_num_new_matched_tokens (as
    before) fails the first assertion."""
    from vllm_hisparse.vllm.compat import KVConnectorRole
    from vllm_hisparse.vllm.connector import HiSparseConnector as HiSparseMLAConnector

    sched = HiSparseMLAConnector(vconfig({"resident_first": True}), KVConnectorRole.SCHEDULER)
    r0 = Req(request_id="r0", num_prompt_tokens=20, max_tokens=4, num_tokens=20)
    r1 = Req(request_id="r1", num_prompt_tokens=30, max_tokens=4, num_tokens=30)
    assert sched.get_num_new_matched_tokens(r0, 0) == (0, False)
    sched.update_state_after_alloc(r0, None, 0)
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r0", block_ids=([1],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"r0": 20})
    sched.build_connector_meta(so)                       # r0's prompt completes: lent
    ledger = sched.connector_scheduler.ledger
    assert list(ledger.lent) == ["r0"] and ledger.free_regions == 0
    ledger.take_events()
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)   # admissible: r0's is lent
    assert ledger.demotions == 0 and list(ledger.lent) == ["r0"] and "r1" not in ledger.held
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)   # asked again next step
    sched.update_state_after_alloc(r1, None, 0)                     # and scheduled
    assert ledger.demotions == 1 and not ledger.lent
    assert [e[:2] for e in ledger.take_events()] == [("demote", "r0"), ("admit", "r1")]
