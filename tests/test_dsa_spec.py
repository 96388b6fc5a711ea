"""DSA speculative decoding's verify rows (core/latent_spec.py): requests decoding n in {1, 2, 4}
query tokens a step (the verified token + drafts), each token with its own causal top-k, all
through ONE row set of B = n x top_k hot slots, against resident mode (every row in a region),
over several steps with random draft acceptance (rejected positions written again with other
rows), selections that overlap between sibling tokens and drift between steps (misses,
evictions), under each served policy:

- every token's attention output ``torch.equal`` to resident mode's, its rows == the ground truth
  rows of its positions when it attends, valid counts == its selection's;
- no two positions of a request in one slot (the step's position -> row map is one-to-one, and
  the RESOLVE state's slot <-> position tables agree);
- three negative controls, each of which must be detected: today's per-token RESOLVE with the
  one-token refusal bypassed (two batch rows racing on one state row), a union missing the last
  token's positions, and no write-through of a rewritten (rejected draft) position into its slot;
- n = 1 through the union path == today's one-decode-token path: same rows, same slots, same
  RESOLVE state and counts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hisparse.core import latent_spec
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.latent_admission import LatentAdmission
from vllm_hisparse.core.latent_graph import LatentGraphStep
from vllm_hisparse.core.latent_pool import LatentPool
from vllm_hisparse.core.latent_step import LatentStep
from vllm_hisparse.ops import fp8_ds_mla
from vllm_hisparse.ops.selection_union import selection_union
from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK, LATENT_ROW, sparse_mla_decode

BF = torch.bfloat16
H_MLA, SCALE = 2, 192 ** -0.5
LAYERS, MML, K = 2, 256, 8
PROMPTS = [120, 75, 151]              # > B: the row sets cannot hold a request
STEPS = 7
QUERY_TOKENS = [1, 2, 4]              # n = num_speculative_tokens + 1
POLICIES = ["lru", "crf"]


def as_stored(rows: torch.Tensor, fp8: bool) -> torch.Tensor:
    """(T, 576) bf16 latent values as the pool stores them: themselves, or fp8_ds_mla bytes."""
    return fp8_ds_mla.pack(rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:]) if fp8 else rows


def as_values(pool_rows: torch.Tensor, fp8: bool) -> torch.Tensor:
    """What the attention reads from pool rows: the values, fp8_ds_mla's dequantized."""
    return fp8_ds_mla.unpack(pool_rows) if fp8 else pool_rows


class Engine:
    def __init__(self, resident: bool, n: int, policy: str, fp8: bool = False):
        R = len(PROMPTS)
        self.max_tokens = STEPS * n
        row, dt = (fp8_ds_mla.ROW_BYTES, torch.uint8) if fp8 else (LATENT_ROW, BF)
        pool = LatentPool(LAYERS, MML, n * K, 0 if resident else R, R if resident else 1,
                          row, dt, policy=policy)
        pages = sum(PROMPTS) + R * self.max_tokens
        self.host = None if resident else HostKVPool(LAYERS, pages, 1, 1, row // 2, dt, pin=False)
        self.pool, self.adm = pool, LatentAdmission(pool, self.host)
        g = torch.Generator().manual_seed(99)
        for rows in pool.rows:                      # poison: a wrong row read shows
            rows.copy_(as_stored(torch.randn(rows.shape[0], LATENT_ROW, generator=g).to(BF)
                                 * (5 if resident else -9), fp8))


def per_token(step: LatentStep) -> LatentStep:
    """Control: today's path with the one-token refusal bypassed, one RESOLVE row per token."""
    v = step.verify
    live = v.pos >= 0
    n = v.pos.shape[1]
    return LatentStep(step.adm, step.host_row, step.pool_row, step.region_base, v.tok[live],
                      v.rows[:, None].expand(-1, n)[live], v.pos[live] + 1,
                      v.slots[:, None].expand(-1, n, -1)[live])


def union_without_last_token(sel, pos):
    """Control: the union with the positions first selected by each request's last token dropped."""
    union, first = selection_union(sel, pos)
    K_ = sel.shape[2]
    last = (pos >= 0).sum(1) - 1                                   # (R,)
    col = torch.arange(union.shape[1]) // K_
    return torch.where(col[None] == last[:, None], -1, union), first


def no_write_through(self, state, pool_row):
    """Control: verify tokens written to the host only, not to a slot holding their position."""
    return pool_row


def selections(g, pos_tok, p0, hot_set, n_live):
    """(n, K) causal selections of one request's tokens at positions pos_tok (p0 = the first):
    each from its request's hot set (hits across steps), fresh positions (misses) and its
    siblings' newest positions (overlap; drafts made resident), in a random order, -1 padded."""
    out = torch.full((len(pos_tok), K), -1, dtype=torch.int32)
    fresh = torch.randint(0, p0, (K,), generator=g)
    for j, p in enumerate(pos_tok[:n_live]):
        cand = torch.cat([torch.arange(p0, p + 1), hot_set, fresh[: 2 + j]]).unique()
        cand = cand[cand <= p]
        pick = cand[torch.randperm(len(cand), generator=g)][: K - int(torch.randint(0, 2, (1,),
                                                                                    generator=g))]
        out[j, :len(pick)] = pick.int()
    return out


def run(n: int, policy: str, verify_tokens: int | None = "n", control: str | None = None,
        seed: int = 0, pad: int | None = None, fp8: bool = False) -> dict:
    """The episode; returns its counts (mismatches, hits, misses, evictions, rewrites). pad: None =
    the hisparse side's decode steps run the plan's own tensors (LatentStep); an int = they run
    through the fixed buffers of the FULL graphs (LatentGraphStep, loaded per step) with pad
    vLLM padding tokens after the step's own. fp8: both sides hold fp8_ds_mla rows (656 B)."""
    g = torch.Generator().manual_seed(seed)
    hs, rs = Engine(False, n, policy, fp8), Engine(True, n, policy, fp8)
    vt = n if verify_tokens == "n" else verify_tokens
    R = len(PROMPTS)
    gs = None if pad is None else LatentGraphStep(hs.adm, R * n + 2 + pad, R + 1, K, vt)
    truth = [torch.randn(LAYERS, MML, LATENT_ROW, generator=g).to(BF) for _ in range(R)]
    for r, P in enumerate(PROMPTS):             # prefill in the one region, then decode
        for e in (hs, rs):
            e.adm.admit(r, P, e.max_tokens)
        plans = [LatentStep.plan(e.adm, [r], np.zeros(P, np.int64), np.arange(P)) for e in (hs, rs)]
        for layer in range(LAYERS):
            rows = truth[r][layer, :P]
            for p in plans:
                p.write(layer, rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:])
        for e in (hs, rs):
            e.adm.prompt_done(r)
    c = dict(out_diff=0, wrong_rows=0, valid_diff=0, conflicts=0, evictions=0, rewrites=0)
    p0 = list(PROMPTS)
    written = [set() for _ in range(R)]
    hot = [torch.randint(0, P, (K // 2,), generator=g) for P in PROMPTS]
    for step_no in range(STEPS):
        n_live = [n if n == 1 else int(torch.randint(1, n + 1, (1,), generator=g)) for _ in range(R)]
        keys = list(range(R)) + [None]          # + a padding request
        req = np.concatenate([np.full(k, r) for r, k in enumerate(n_live)] + [np.full(2, R)])
        pos = np.concatenate([np.arange(p0[r], p0[r] + k) for r, k in enumerate(n_live)]
                             + [np.zeros(2, np.int64)])
        for r, k in enumerate(n_live):
            for p in range(p0[r], p0[r] + k):
                c["rewrites"] += p in written[r]
                written[r].add(p)
                truth[r][:, p] = torch.randn(LAYERS, LATENT_ROW, generator=g).to(BF)
        hp = LatentStep.plan(hs.adm, keys, req, pos, verify_tokens=vt)
        if control == "per_token":
            hp = per_token(hp)
        rp = LatentStep.plan(rs.adm, keys, req, pos)
        T = len(req)
        if gs is not None:
            gs.load(hp)
        for layer in range(LAYERS):
            rows = torch.stack([truth[r][layer, p] if r < R else torch.zeros(LATENT_ROW, dtype=BF)
                                for r, p in zip(req, pos)])
            if gs is None:
                hp.write(layer, rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:])
            else:                                   # + vLLM's padding tokens (noise: never read)
                padded = torch.cat([rows, torch.randn(pad, LATENT_ROW, generator=g).to(BF)])
                gs.write(layer, padded[:, :KV_LORA_RANK], padded[:, KV_LORA_RANK:])
            rp.write(layer, rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:])
            topk = torch.full((T, K), -1, dtype=torch.int32)
            t0 = 0
            for r, k in enumerate(n_live):
                topk[t0:t0 + k] = selections(g, list(range(p0[r], p0[r] + k)), p0[r], hot[r], k)
                t0 += k
            before = hs.pool.states[layer].slot_unit.clone()
            if gs is None:
                ih, vh = hp.convert(layer, topk)
            else:
                noise = torch.randint(0, MML, (pad, K), generator=g, dtype=torch.int32)
                ih, vh = gs.convert(layer, torch.cat([topk, noise]))
                assert (ih[T:] == -1).all() and (vh[T:] == 0).all()   # padding reads nothing
                ih, vh = ih[:T], vh[:T]
            ir, vr = rp.convert(layer, topk)
            su = hs.pool.states[layer].slot_unit
            c["evictions"] += int(((before >= 0) & (su != before)).sum())
            ql = torch.randn(T, H_MLA, KV_LORA_RANK, generator=g).to(BF)
            qpe = torch.randn(T, H_MLA, LATENT_ROW - KV_LORA_RANK, generator=g).to(BF)
            oh = sparse_mla_decode(ql, qpe, as_values(hs.pool.rows[layer], fp8), ih, SCALE)
            orr = sparse_mla_decode(ql, qpe, as_values(rs.pool.rows[layer], fp8), ir, SCALE)
            t0 = 0
            for r, k in enumerate(n_live):
                seen: dict[int, int] = {}
                for t in range(t0, t0 + k):
                    ok = topk[t] >= 0
                    want = as_stored(truth[r][layer, topk[t][ok].long()], fp8)
                    assert torch.equal(rs.pool.rows[layer][ir[t][ok].long()], want)   # reference
                    c["wrong_rows"] += not torch.equal(hs.pool.rows[layer][ih[t][ok].long()], want)
                    c["valid_diff"] += int(vh[t]) != int(ok.sum())
                    c["out_diff"] += not torch.equal(oh[t], orr[t])
                    for u, row in zip(topk[t][ok].tolist(), ih[t][ok].tolist()):
                        c["conflicts"] += seen.setdefault(u, row) != row
                t0 += k
                rows_used = list(seen.values())
                c["conflicts"] += len(rows_used) - len(set(rows_used))   # two positions, one row
                row = hs.adm.grant(r).row_set
                held = su[row][su[row] >= 0]
                c["conflicts"] += len(held) - len(held.unique())
                us = hs.pool.states[layer].unit_slot[row]
                c["conflicts"] += int((su[row][us[held.long()].long()] != held).sum())
        for r, k in enumerate(n_live):           # accept 1..k of the tokens (the rest rewritten)
            p0[r] += 1 + int(torch.randint(0, k, (1,), generator=g))
    c["hits"], c["misses"] = hs.pool.counts.tolist()
    return c


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", QUERY_TOKENS)
def test_verify_rows_equal_resident(n, policy):
    c = run(n, policy)
    assert c["misses"] > 0 and c["hits"] > 0 and c["evictions"] > 0, c
    if n > 1:
        assert c["rewrites"] > 0, c
    assert (c["out_diff"], c["wrong_rows"], c["valid_diff"], c["conflicts"]) == (0, 0, 0, 0), c


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", [2, 4])
def test_verify_rows_in_graph_buffers_equal_resident(n, policy, pad):
    """The same episode through LatentGraphStep's fixed buffers (what FULL CUDA graphs replay),
    with vLLM's padding tokens after the step's own."""
    c = run(n, policy, pad=pad)
    assert c["misses"] > 0 and c["hits"] > 0 and c["evictions"] > 0 and c["rewrites"] > 0, c
    assert (c["out_diff"], c["wrong_rows"], c["valid_diff"], c["conflicts"]) == (0, 0, 0, 0), c


@pytest.mark.parametrize("pad", [None, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_fp8_ds_mla_rows_equal_resident(policy, pad):
    """The episode with fp8_ds_mla rows (656 packed bytes: RESOLVE, write-through and the host
    pool move them as opaque bytes), eager and through the graph buffers: every row read is the
    packed truth byte for byte, every output equal to resident's."""
    c = run(2, policy, pad=pad, fp8=True)
    assert c["misses"] > 0 and c["hits"] > 0 and c["evictions"] > 0 and c["rewrites"] > 0, c
    assert (c["out_diff"], c["wrong_rows"], c["valid_diff"], c["conflicts"]) == (0, 0, 0, 0), c


def test_fp8_ds_mla_rows_control_is_detected(monkeypatch):
    """Control: the hisparse side's misses fetch the neighbouring host row (a byte copy off by one
    row) -> rows and outputs differ."""
    from vllm_hisparse.ops import resolve_given as rg

    orig = rg.resolve_given_reference

    def shifted(sel, seq, bt, locs, hot, rows, state, host_pt, host, kv, counts):
        orig(sel, seq, bt, locs, hot, rows, state, host_pt, host.roll(1, 0), kv, counts)
    monkeypatch.setattr(rg, "resolve_given_reference", shifted)
    c = run(2, "lru", fp8=True)
    assert c["out_diff"] > 0 and c["wrong_rows"] > 0, c


@pytest.mark.parametrize("control", ["union", "write_through"])
def test_graph_buffers_controls_are_detected(control, monkeypatch):
    if control == "union":
        monkeypatch.setattr(latent_spec, "selection_union", union_without_last_token)
    else:
        monkeypatch.setattr(latent_spec.VerifyRows, "write_rows", no_write_through)
    c = run(4, "lru", pad=2)
    assert c["out_diff"] > 0 and (c["valid_diff"] if control == "union" else c["wrong_rows"]) > 0


@pytest.mark.parametrize("n", [2, 4])
def test_per_token_resolve_races(n):
    c = run(n, "lru", control="per_token")
    assert c["out_diff"] > 0 and c["wrong_rows"] > 0, c


@pytest.mark.parametrize("n", [2, 4])
def test_union_missing_a_token_is_detected(n, monkeypatch):
    monkeypatch.setattr(latent_spec, "selection_union", union_without_last_token)
    c = run(n, "lru")
    assert c["out_diff"] > 0 and c["valid_diff"] > 0, c


@pytest.mark.parametrize("n", [2, 4])
def test_stale_draft_rows_without_write_through_are_detected(n, monkeypatch):
    monkeypatch.setattr(latent_spec.VerifyRows, "write_rows", no_write_through)
    c = run(n, "lru")
    assert c["out_diff"] > 0 and c["wrong_rows"] > 0, c


@pytest.mark.parametrize("policy", POLICIES)
def test_one_token_union_is_todays_path(policy, monkeypatch):
    """n = 1 through VerifyRows == LatentStep's one-decode-token path, step by step: the same pool
    rows, the same bytes in the pool, the same RESOLVE state and counts."""
    states = {}
    orig = LatentStep.convert
    for vt in (None, 1):
        outs = []

        def spy(self, layer, topk, out=None, valid=None):
            o, v = orig(self, layer, topk, out, valid)
            if self.adm.resident:
                return o, v
            assert (self.verify is not None) == (vt == 1)
            st = self.adm.pool.states[layer]
            outs.append((o.clone(), v.clone(), st.slot_unit.clone(), st.unit_slot.clone(),
                         *(t.clone() for t in st.pstate.values()), self.adm.pool.rows[layer].clone(),
                         self.adm.pool.counts.clone()))
            return o, v
        monkeypatch.setattr(LatentStep, "convert", spy)
        c = run(1, policy, verify_tokens=vt)
        assert c["misses"] > 0 and c["hits"] > 0 and c["out_diff"] == 0, c
        states[vt] = outs
    assert len(states[None]) == len(states[1]) > 0
    for i, (a, b) in enumerate(zip(states[None], states[1])):
        assert [j for j, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)] == [], i
