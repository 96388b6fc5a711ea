"""The scheduler's ledger (core/latent_ledger.py) against the worker's admission
(core/latent_admission.py) it drives through LatentRuntime.apply: for every request over a scripted
and a random sequence, both decide as a count of what the worker holds (its grants and its host
pool's free pages: a different computation from the ledger's counters, which the admission also
asks), and every event the ledger logs succeeds on the worker; nothing held at the end."""
from __future__ import annotations

import random

import pytest
import torch

from vllm_hisparse.core.latent_ledger import LatentLedger
from vllm_hisparse.core.latent_runtime import LatentRuntime, host_pages_for
from vllm_hisparse.core.latent_step import plan_arrays
from vllm_hisparse.ops.sparse_mla import LATENT_ROW

MML, B, K = 64, 16, 8


def pair(resident: bool, row_sets=2, regions=1, pages=150, lend=False):
    rt = LatentRuntime(2, MML, B, row_sets, regions if not resident else row_sets,
                       0 if resident else pages, 32, 4, K, LATENT_ROW, torch.bfloat16, "cpu",
                       pin=False, lend=lend)
    led = LatentLedger(row_sets, regions if not resident else row_sets, pages, MML, resident,
                       lend=lend)
    return rt, led


def counted(rt, p, m, done=frozenset()) -> str | None:
    """What is short for a request of p + m positions, counted from what the worker holds (the
    admission rules of docs/dsa.md section 6), or None when it fits. done: the keys whose prompt
    is complete (with lend, a region they hold is lent: an admission may take it)."""
    held = rt.adm.grants.items()
    if not rt.resident and sum(g.row_set >= 0 for _, g in held) == rt.pool.row_sets:
        return "row set"
    busy = sum(g.region >= 0 and not (rt.adm.ledger.lend and k in done) for k, g in held)
    if busy == rt.pool.regions:
        return "region"
    if not rt.resident and p + m > rt.host.free_pages:
        return "host pool"
    return None


def same_decision(rt, led, key, p, m, done=frozenset()):
    want = counted(rt, p, m, done)
    for why in (led.refusal(key, p, m), rt.adm.refusal(key, p, m)):
        assert (why is None) == (want is None) and (want is None or want in why), (key, why, want)
    return want is None


def test_scripted_admission_waits_and_gives_back():
    rt, led = pair(False, row_sets=3, regions=1, pages=130)
    assert led.admit("a", 40, 20)
    assert led.refusal("b", 40, 20) == "no free prefill region (all 1 in use)"
    rt.apply(led.take_events())
    assert same_decision(rt, led, "b", 40, 20) is False
    led.prompt_done("a")                       # the region back; a keeps its row set
    rt.apply(led.take_events())
    assert rt.adm.grant("a").region == -1 and rt.adm.grant("a").row_set == 0
    assert led.admit("b", 40, 20)
    led.prompt_done("b")
    rt.apply(led.take_events())
    assert same_decision(rt, led, "c", 5, 5)               # exactly the 10 free pages
    assert same_decision(rt, led, "c", 6, 5) is False      # one over
    assert led.refusal("c", 10, 5) == "host pool: 15 pages needed, 10 free of 130"
    assert same_decision(rt, led, "c", 10, 5) is False
    led.release("a")
    rt.apply(led.take_events())
    assert same_decision(rt, led, "c", 10, 5) and led.admit("c", 10, 5)
    assert rt.adm.grant("b").row_set == 1
    rt.apply(led.take_events())
    assert rt.adm.grant("c").row_set == 0      # a's, reset (test_dsa_core checks the reset)
    for key in ("b", "c", "c"):                # twice: a no-op, no event
        led.release(key)
    rt.apply(led.take_events())
    assert rt.adm.leaks() == [] and led.free_pages == 130 and led.free_sets == 3


@pytest.mark.parametrize("resident,lend", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sequences_agree(resident, lend, seed):
    rng = random.Random(seed)
    rt, led = pair(resident, row_sets=3, regions=2, pages=120, lend=lend)  # each runs out
    live: list = []
    done: set = set()                          # prompts complete, counted here
    most = 0                                   # the most admitted and not released, counted here
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            key = f"r{step}"
            p = rng.randrange(1, MML)
            m = rng.randrange(0, MML - p + 1)
            rt.apply(led.take_events())        # the worker catches up (a step boundary)
            if same_decision(rt, led, key, p, m, done):
                led.admit(key, p, m)
                live.append(key)
                most = max(most, len(live))
        elif op < 0.7 and live:
            key = rng.choice(live)
            led.prompt_done(key)
            done.add(key)
        elif live:
            key = live.pop(rng.randrange(len(live)))
            led.release(key)
            done.discard(key)
    for key in live:
        led.release(key)
    rt.apply(led.take_events())
    assert rt.adm.leaks() == [] and led.free_regions == led.regions
    assert led.free_pages == (0 if resident else led.host_pages)
    assert rt.adm.ledger.events == []          # the worker's ledger counts, it logs nothing
    assert rt.stats()["max_live_requests"] == most >= 2 and rt.stats()["live_requests"] == 0
    assert (rt.stats()["demotions"] > 0) == lend and led.demotions == rt.stats()["demotions"]


def test_lent_regions_decode_until_an_admission_takes_them():
    """lend (resident_first): a complete prompt keeps its region (its decode tokens plan as
    region tokens); the next admission short of a region takes the one lent longest ago, the
    ``demote`` event just before the admission's, after which that request's tokens go through
    its row set; a lent request released gives its region back at once."""
    rt, led = pair(False, row_sets=4, regions=2, pages=300, lend=True)
    assert led.admit("a", 40, 20) and led.admit("b", 30, 20)
    led.prompt_done("a")
    led.prompt_done("b")
    led.prompt_done("a")                        # once only: no second event
    assert not led.in_prefill("a") and list(led.lent) == ["a", "b"]
    assert led.refusal("c", 10, 5) is None      # both regions lent: either may be taken
    rt.apply(led.take_events())
    assert rt.adm.grant("a").in_region and rt.adm.grant("b").in_region
    a = plan_arrays(rt.adm, ["a", "b"], [0, 1], [40, 30])     # each decodes its first token
    assert a.dec == [] and (a.rbase >= 0).all()                # region tokens, no RESOLVE
    assert led.admit("c", 10, 5)
    assert led.take_events() == [("demote", "a"), ("admit", "c", 10, 5)]
    with pytest.raises(RuntimeError, match="lent region that no 'demote' event gave back"):
        rt.apply([("admit", "c", 10, 5)])                     # the event order broken
    rt.apply([("demote", "a"), ("admit", "c", 10, 5)])
    assert not rt.adm.grant("a").in_region and rt.adm.grant("c").in_region
    a = plan_arrays(rt.adm, ["a", "b", "c"], [0, 1, 2], [41, 31, 0])
    assert a.dec == [0] and a.rbase[0] == -2 and (a.rbase[1:] >= 0).all()
    led.release("b")                            # lent: its region back at once
    assert not led.lent and led.free_regions == 1 and led.admit("d", 10, 5)
    assert led.refusal("e", 10, 5) == "no free prefill region (all 2 in use)"   # c, d in prefill
    with pytest.raises(ValueError, match="no lent region"):
        led.demote("c")
    for key in ("a", "c", "d"):
        led.release(key)
    rt.apply(led.take_events())
    assert rt.adm.leaks() == [] and rt.stats()["demotions"] == led.demotions == 1


def test_lend_is_off_in_resident_mode_and_demote_is_a_no_op_there():
    """The resident twin (core/latent_shadow.py) replays a hisparse scheduler's events."""
    rt, led = pair(True, row_sets=2, lend=True)
    assert not led.lend and led.admit("a", 10, 5)
    led.prompt_done("a")
    rt.apply(led.take_events() + [("demote", "a")])
    assert rt.adm.grant("a").in_region


def test_worker_refusing_what_the_scheduler_admitted_is_loud():
    rt, led = pair(False, row_sets=2, regions=1, pages=150)
    big = LatentLedger(2, 2, 150, MML, False)   # a scheduler that counts two regions
    assert big.admit("a", 10, 10) and big.admit("b", 10, 10)
    with pytest.raises(RuntimeError, match="cannot admit 'b' that the scheduler admitted: no free"):
        rt.apply(big.take_events())


def test_host_pages_for_counts_rows_of_every_layer():
    assert host_pages_for(61 * 1152 * 1000 + 5, 61, 1152) == 1000
    with pytest.raises(ValueError, match="regions >= 1"):
        LatentLedger(1, 0, 10, MML, False)


@pytest.mark.parametrize("verify_tokens", [None, 2])
def test_runtime_plans_verify_rows_of_ngram_speculation(verify_tokens):
    """vLLM's batch of two sparse requests with 2 query tokens each (the verified token + one
    ngram draft): refused without verify_tokens, served with it, each token's pool rows holding
    the latent rows written at its selected positions (host pool -> hot slots)."""
    from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK

    rt = LatentRuntime(2, MML, 2 * K, 2, 1, 150, 32, 4, K, LATENT_ROW, torch.bfloat16, "cpu",
                       pin=False, verify_tokens=verify_tokens)
    led = LatentLedger(2, 1, 150, MML, False)
    g = torch.Generator().manual_seed(5)
    truth = torch.randn(2, 2, MML, LATENT_ROW, generator=g).to(torch.bfloat16)  # (req, layer)
    P = 30
    for r, key in enumerate("ab"):
        assert led.admit(key, P, 10)
        rt.apply(led.take_events())
        rt.plan([key], [0, P], [P])
        for layer in range(2):
            rows = truth[r, layer, :P]
            rt.write(layer, rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:])
        led.prompt_done(key)
    rt.apply(led.take_events())
    if verify_tokens is None:
        with pytest.raises(ValueError, match="a sparse request decodes one token a step"):
            rt.plan(["a", "b"], [0, 2, 4], [P + 2, P + 2])
        return
    rt.plan(["a", "b"], [0, 2, 4], [P + 2, P + 2])          # positions P, P + 1 of each
    for layer in range(2):
        rows = truth[:, layer, P:P + 2].reshape(4, LATENT_ROW)
        rt.write(layer, rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:])
        topk = torch.stack([torch.randperm(P + 1 + t % 2, generator=g)[:K] for t in range(4)])
        out, valid = rt.convert(layer, topk.int())
        assert valid.tolist() == [K] * 4
        for t in range(4):
            want = truth[t // 2, layer, topk[t].long()]
            assert torch.equal(rt.pool.rows[layer][out[t].long()], want), t
    assert rt.stats()["misses"] > 0
