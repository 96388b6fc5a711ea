"""The DSA path's vLLM-free core (docs/dsa.md sections 2-7): the latent pool's layout and size
(core/latent_pool.py), admission (core/latent_admission.py), the write path
(ops/latent_write.py) and the index conversion that replaces vLLM's
triton_convert_req_index_to_global_index (ops/latent_index.py), planned per step by
core/latent_step.py; then an episode of requests through prefill (chunked) and decode with the
DSA indexer's reference choosing top-k, attention by ops/sparse_mla.py over the rows the hook
returns, hisparse against resident mode bit for bit, under each served policy (lru, crf), which
must decide differently."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import capacity_mla, indexers
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.latent_admission import LatentAdmission
from vllm_hisparse.core.latent_pool import LatentPool
from vllm_hisparse.core.latent_step import LatentStep
from vllm_hisparse.ops.dsa_indexer import indexer_topk
from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK, LATENT_ROW, sparse_mla_decode

BF = torch.bfloat16
H_IDX, D_IDX, H_MLA = 4, 128, 2          # indexer heads, index_head_dim, attention heads
SCALE = 192 ** -0.5
POLICIES = ["lru", "crf"]                # the served policies (slots.served())


def make(layers=2, mml=64, B=8, row_sets=2, regions=1, pages=200, resident=False, policy="lru"):
    pool = LatentPool(layers, mml, B, 0 if resident else row_sets, regions, policy=policy)
    host = None if resident else HostKVPool(layers, pages, 1, 1, LATENT_ROW // 2, BF, pin=False)
    return pool, host, LatentAdmission(pool, host)


# ---- the pool -----------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, mml, B, N, regions", [(1, 33, 32, 1, 1), (3, 100, 64, 5, 2),
                                                        (2, 64, 64, 0, 3)])
def test_pool_layout_and_bytes_match_calc(layers, mml, B, N, regions):
    pool = LatentPool(layers, mml, B, N, regions)
    spans = [(pool.region_base(g), pool.region_base(g) + mml) for g in range(regions)]
    spans += [(pool.row_set_base(r), pool.row_set_base(r) + B) for r in range(N)]
    covered = sorted(spans)
    assert covered[0][0] == 0 and covered[-1][1] == pool.rows[0].shape[0]
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), "regions and row sets overlap"
    if N:
        r = torch.arange(N)
        want = torch.tensor([[pool.row_set_base(i) + s for s in range(B)] for i in range(N)])
        assert torch.equal(pool.slot_rows(r).long(), want)
    m = capacity_mla.MLAShape(layers, KV_LORA_RANK, LATENT_ROW - KV_LORA_RANK)
    calc = (regions * capacity_mla.prefill_region_bytes(m, mml)
            + N * capacity_mla.latent_row_set_bytes(m, B, 0, mml))
    assert pool.nbytes == calc


@pytest.mark.parametrize("kw, field", [(dict(buffer=0), "buffer"), (dict(row_sets=-1), "row_sets"),
                                       (dict(row_sets=0, regions=0), "regions"),
                                       (dict(dtype=torch.float32), "dtype"),
                                       (dict(policy="fifo"), "policy='fifo'.*crf, lru"),
                                       (dict(policy="crf", buffer=65537, max_model_len=1 << 17),
                                        "buffer=65537 is more slots than policy 'crf'")])
def test_pool_refuses_bad_sizes(kw, field):
    args = dict(num_layers=1, max_model_len=16, buffer=8, row_sets=1, regions=1) | kw
    with pytest.raises(ValueError, match=field):
        LatentPool(**args)
    with pytest.raises(ValueError, match="region=1 out of range"):
        LatentPool(1, 16, 8, 1, 1).region_base(1)


# ---- admission ----------------------------------------------------------------------------------
def test_admission_refuses_when_row_sets_regions_or_pages_run_out():
    pool, host, adm = make(mml=100, B=8, row_sets=2, regions=1, pages=100)
    assert adm.admit("a", 30, 10) is not None
    assert "prefill region" in adm.refusal("b", 10, 5)         # a holds the only region
    assert adm.admit("b", 10, 5) is None
    adm.prompt_done("a")
    assert adm.grant("a").region == -1
    assert adm.admit("b", 10, 5) is not None                   # 40 + 15 pages held
    adm.prompt_done("b")
    assert "row set" in adm.refusal("c", 10, 5)                # both row sets taken
    adm.release("b")
    assert "host pool" in adm.refusal("c", 50, 15)             # 65 > 100 - 40 free pages
    assert adm.admit("c", 40, 20) is not None                  # exactly the 60 free pages
    assert host.free_pages == 0
    with pytest.raises(ValueError, match="max_model_len"):
        adm.refusal("d", 90, 20)
    with pytest.raises(ValueError, match="admitted already"):
        adm.admit("c", 1, 1)
    assert adm.leaks()
    adm.release("a")
    adm.release("c")
    assert adm.leaks() == [] and host.free_pages == 100
    with pytest.raises(ValueError, match="holds nothing"):
        adm.release("c")


def test_admission_resident_keeps_the_region():
    pool, _, adm = make(mml=64, regions=2, resident=True)
    ga, gb = adm.admit("a", 30, 10), adm.admit("b", 5, 5)
    assert {ga.region, gb.region} == {0, 1} and ga.row_set == gb.row_set == -1
    adm.prompt_done("a")
    assert adm.grant("a").region == ga.region                   # no host: the region stays
    assert "full-length region" in adm.refusal("c", 3, 3)
    adm.release("a")
    adm.release("b")
    assert adm.leaks() == []


def test_admission_resets_a_reused_row_set():
    pool, host, adm = make(layers=1, mml=32, B=4, row_sets=1, regions=1)
    g = adm.admit("a", 8, 2)
    st = pool.states[0]
    st.slot_unit[g.row_set, 0] = 3
    st.unit_slot[g.row_set, 3] = 0
    adm.release("a")
    g = adm.admit("b", 8, 2)
    assert (st.slot_unit[g.row_set] == -1).all() and (st.unit_slot[g.row_set] == -1).all()
    want = torch.tensor(host.page_table("b"), dtype=torch.int32)
    assert torch.equal(pool.host_rows.table[g.row_set, :10], want)
    assert (pool.host_rows.table[g.row_set, 10:] == -1).all()


# ---- the write path -----------------------------------------------------------------------------
def test_write_path_bytes_land_at_the_host_and_region_rows():
    g = torch.Generator().manual_seed(4)
    pool, host, adm = make(layers=2, mml=40, B=8, row_sets=3, regions=1, pages=120)
    for key, n in (("x", 20), ("y", 30), ("z", 12)):
        adm.admit(key, n, 5)
        if key != "z":
            adm.prompt_done(key)                    # x, y decode; z is in prefill (the region)
    host.data.copy_(torch.randn(host.data.shape, generator=g).to(BF) * 100)
    pool.rows[1].copy_(torch.randn(pool.rows[1].shape, generator=g).to(BF) * 100)
    before_host, before_pool = host.data.clone(), pool.rows[1].clone()
    keys = ["y", None, "x", "z"]
    req = [0, 1, 2, 3, 3, 3, 1]                     # a padding request and a padding token
    pos = [22, 0, 19, 4, 5, 6, 0]
    step = LatentStep.plan(adm, keys, req, pos)
    kv_c = torch.randn(7, KV_LORA_RANK, generator=g).to(BF)
    k_pe = torch.randn(7, LATENT_ROW - KV_LORA_RANK, generator=g).to(BF)
    step.write(1, kv_c, k_pe)
    want_host, want_pool = before_host.clone(), before_pool.clone()
    for t in range(7):
        key = keys[req[t]]
        if key is None:
            continue
        row = torch.cat([kv_c[t], k_pe[t]])
        page = host.page_table(key)[pos[t]]         # the host pool's own list, not the table
        want_host[1, page] = row.view(2, 1, 1, LATENT_ROW // 2)
        if key == "z":
            want_pool[pool.region_base(adm.grant("z").region) + pos[t]] = row
    assert torch.equal(host.data, want_host)        # layer 0 and every other page unchanged
    assert torch.equal(pool.rows[1], want_pool)


def test_plan_refuses_bad_steps():
    pool, host, adm = make()
    adm.admit("a", 10, 5)
    adm.prompt_done("a")
    with pytest.raises(ValueError, match="one token a step"):
        LatentStep.plan(adm, ["a"], [0, 0], [10, 11])
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 15\)"):
        LatentStep.plan(adm, ["a"], [0], [15])
    with pytest.raises(ValueError, match="not admitted"):
        LatentStep.plan(adm, ["b"], [0], [0])


# ---- the read path (the hook) -------------------------------------------------------------------
def test_hook_region_rows_are_region_base_plus_pos():
    g = torch.Generator().manual_seed(5)
    mml, K = 50, 16
    pool, host, adm = make(layers=1, mml=mml, regions=2, resident=True)
    adm.admit("a", 30, 10)
    adm.admit("b", 20, 5)
    keys = ["b", "a", None]
    req = [0, 0, 1, 2]
    step = LatentStep.plan(adm, keys, req, [3, 4, 29, 0])
    topk = torch.randint(-1, mml + 20, (4, K), generator=g).int()   # -1, in range, past mml
    topk[1, 10:] = -1
    out, valid = step.convert(0, topk)
    for t in range(4):
        key = keys[req[t]]
        base = None if key is None else pool.region_base(adm.grant(key).region)
        for j in range(K):
            p = int(topk[t, j])
            want = -1 if key is None or p < 0 or p >= mml else base + p
            assert int(out[t, j]) == want, (t, j)
        assert int(valid[t]) == sum(int(x) >= 0 for x in out[t])


@pytest.mark.parametrize("policy", POLICIES)
def test_hook_decode_rows_hold_the_host_rows_in_order(policy):
    g = torch.Generator().manual_seed(6)
    mml, B, K = 64, 12, 10
    pool, host, adm = make(layers=1, mml=mml, B=B, row_sets=2, regions=1, policy=policy)
    assert all(st.policy.name == policy for st in pool.states)
    for key in ("a", "b"):
        adm.admit(key, 40, 10)
        adm.prompt_done(key)
    host.data.copy_(torch.randn(host.data.shape, generator=g).to(BF))
    rows = host.data[0].view(host.num_pages, -1)
    step = LatentStep.plan(adm, ["a", "b"], [0, 1], [40, 41])
    for rep in range(2):
        topk = torch.stack([torch.randperm(41, generator=g)[:K], torch.randperm(42, generator=g)[:K]])
        topk[1, 7:] = -1
        if rep == 1:
            topk = prev                              # the same selection again: all hits
        before = pool.counts.clone()
        out, valid = step.convert(0, topk.int())
        for t, key in enumerate(("a", "b")):
            base = pool.row_set_base(adm.grant(key).row_set)
            live = topk[t] >= 0
            assert ((out[t][live] >= base) & (out[t][live] < base + B)).all()
            assert (out[t][~live] == -1).all() and int(valid[t]) == int(live.sum())
            pages = torch.tensor(host.page_table(key))[topk[t][live].long()]
            assert torch.equal(pool.rows[0][out[t][live].long()], rows[pages]), "wrong row / order"
        hits, misses = (pool.counts - before).tolist()
        assert (hits, misses) == ((0, 17) if rep == 0 else (17, 0))
        prev = topk


# ---- the episode: hisparse == resident ----------------------------------------------------------
PROMPTS = [300, 150, 40, 97, 200]         # > B (misses), < top_k (selects all), odd lengths
MAX_TOKENS = [6, 8, 5, 7, 6]
LAYERS, MML, B, K, N_SETS, CHUNK = 2, 320, 80, 64, 3, 128
PREEMPT = (12, 1)                         # at step 12, request 1 (decoding then) is preempted


class Engine:
    """One mode's pool + admission; resident mode holds a full-length region per request."""

    def __init__(self, resident: bool, policy: str):
        pool, host, self.adm = make(LAYERS, MML, B, N_SETS, N_SETS if resident else 1,
                                    pages=sum(PROMPTS) + sum(MAX_TOKENS), resident=resident,
                                    policy=policy)
        self.pool, self.host = pool, host
        for rows in pool.rows:                       # poison: a wrong row read shows
            rows.copy_(torch.randn(rows.shape).to(BF) * (7 if resident else -3))


@functools.cache
def episode(policy: str) -> tuple[int, int, tuple]:
    """The episode under ``policy`` (asserting as it goes that hisparse == resident): hisparse
    mode's (hits, misses, every decode token's pool rows in step order). The steps' selections
    do not depend on the policy (one seed)."""
    g = torch.Generator().manual_seed(11)
    R = len(PROMPTS)
    total = [p + m for p, m in zip(PROMPTS, MAX_TOKENS)]
    lat = [torch.randn(LAYERS, n, LATENT_ROW, generator=g).to(BF) for n in total]
    kidx = [torch.randn(LAYERS, n, D_IDX, generator=g) for n in total]
    cfg = HiSparseConfig(indexer="dsa", top_k=K, device_buffer_size=B, dense_layers=())
    ix = indexers.get("dsa")(cfg, LAYERS, R, MML, 1, D_IDX, BF, "cpu")
    hs, rs = Engine(False, policy), Engine(True, policy)
    waiting, done = list(range(R)), [0] * R          # done: tokens computed (written)
    running, refusals, decode_rows, read = [], [], [[] for _ in range(R)], []
    step_no = decode_outputs = 0
    while waiting or running:
        if waiting:
            i = waiting[0]
            why = hs.adm.refusal(i, PROMPTS[i], MAX_TOKENS[i])
            if why is None:
                hs.adm.admit(i, PROMPTS[i], MAX_TOKENS[i])
                assert rs.adm.admit(i, PROMPTS[i], MAX_TOKENS[i]) is not None
                running.append(waiting.pop(0))
            else:
                refusals.append(why)
        # the step: one token per decoding request, then a chunk of the prompt in prefill
        spans = [(i, done[i], done[i] + 1) for i in running if done[i] >= PROMPTS[i]]
        budget = CHUNK - len(spans)
        for i in running:
            if done[i] < PROMPTS[i]:
                spans.append((i, done[i], min(PROMPTS[i], done[i] + budget)))
        keys = [i for i, _, _ in spans] + [None]     # + a padding request (CUDA-graph rows)
        req = torch.cat([torch.full((hi - lo,), n) for n, (_, lo, hi) in enumerate(spans)]
                        + [torch.full((2,), len(spans))])
        pos = torch.cat([torch.arange(lo, hi) for _, lo, hi in spans] + [torch.zeros(2).long()])
        who = [keys[r] for r in req.tolist()]
        lo_hi_i = list(zip(*spans))
        plans = [LatentStep.plan(e.adm, keys, req, pos) for e in (hs, rs)]
        upd = ix.plan_tokens(*(np.array(x) for x in (lo_hi_i[1], lo_hi_i[2], lo_hi_i[0])))
        upd = ix.device_update({n: torch.from_numpy(a) for n, a in upd.items()})
        live = [t for t, w in enumerate(who) if w is not None]
        for layer in range(LAYERS):
            ix.update(layer, upd, torch.cat([kidx[i][layer, lo:hi] for i, lo, hi in spans]))
            rows = torch.cat([lat[i][layer, lo:hi] for i, lo, hi in spans]
                             + [torch.zeros(2, LATENT_ROW, dtype=BF)])
            for p in plans:
                p.write(layer, rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:])
            T = len(req)
            q, w = torch.randn(T, H_IDX, D_IDX, generator=g), torch.rand(T, H_IDX, generator=g)
            ixrow = torch.tensor([x if x is not None else 0 for x in who])
            scores = torch.empty(T, MML)
            ix.score(layer, (q, w), ixrow, pos + 1, scores)
            topk = indexer_topk(scores, pos + 1, K)
            topk[[t for t, x in enumerate(who) if x is None]] = -1
            ql = torch.randn(T, H_MLA, KV_LORA_RANK, generator=g).to(BF)
            qpe = torch.randn(T, H_MLA, LATENT_ROW - KV_LORA_RANK, generator=g).to(BF)
            outs = []
            for e, p in zip((hs, rs), plans):
                idx, valid = p.convert(layer, topk)
                assert torch.equal(valid, (topk >= 0).sum(1).int())
                got = e.pool.rows[layer][idx.long().clamp(min=0)]
                for t in live:                          # the rows hold the tokens' latent rows
                    ok = topk[t] >= 0
                    assert torch.equal(got[t][ok], lat[who[t]][layer, topk[t][ok].long()]), t
                outs.append(sparse_mla_decode(ql, qpe, e.pool.rows[layer], idx, SCALE))
                if e is hs:
                    for t in live:                      # GPU rows: the row set, or the region
                        gr = hs.adm.grant(who[t])
                        lo = (hs.pool.region_base(gr.region) if gr.in_region
                              else hs.pool.row_set_base(gr.row_set))
                        v = idx[t][idx[t] >= 0]
                        assert ((v >= lo) & (v < lo + (MML if gr.in_region else B))).all()
                        if not gr.in_region:
                            decode_rows[who[t]] += v.tolist()
                            read.append(tuple(idx[t].tolist()))
            assert torch.equal(outs[0], outs[1]), (step_no, layer)
        decode_outputs += sum(1 for i, lo, _ in spans if lo >= PROMPTS[i])
        step_no += 1
        for i, lo, hi in spans:
            done[i] = hi
            if lo < PROMPTS[i] <= hi:
                hs.adm.prompt_done(i)
                rs.adm.prompt_done(i)
            if hi == total[i] or (step_no, i) == PREEMPT:
                for e in (hs, rs):
                    e.adm.release(i)
                running.remove(i)
                assert len(set(decode_rows[i])) <= B      # distinct GPU rows of its decode life
                decode_rows[i] = []
                if hi != total[i]:                      # preempted: recomputed from token 0
                    done[i] = 0
                    waiting.insert(0, i)
    hits, misses = hs.pool.counts.tolist()
    assert misses > 0 and hits > 0 and hits / (hits + misses) < 1
    assert decode_outputs > sum(MAX_TOKENS)         # + the preempted one's first life
    assert any("row set" in r for r in refusals) and any("region" in r for r in refusals)
    assert hs.adm.leaks() == [] and rs.adm.leaks() == [] and hs.host.free_pages == hs.host.num_pages
    return hits, misses, tuple(read)


@pytest.mark.parametrize("policy", POLICIES)
def test_episode_hisparse_equals_resident(policy):
    hits, misses, read = episode(policy)
    assert misses > 0 and hits > 0 and read


def test_episode_policies_decide_differently():
    """lru and crf over the same selections: other slots somewhere, so the policy is applied."""
    lru, crf = episode("lru"), episode("crf")
    assert len(lru[2]) == len(crf[2]) and lru[2] != crf[2]
    print(f"lru hits/misses {lru[:2]}, crf {crf[:2]}")
