"""A steady decode step's plan is the last plan advanced on the device (core/latent_runtime.py
``_steady``, core/latent_graph.py ``advance``, ops/latent_plan.py ``materialize``), not planned on
the host: over random served episodes (chunked prefills, decodes, admissions, lent regions taken,
releases, vLLM's padding rows), a runtime that advances and one that plans every step in full
hold the same buffers after every step, write the same bytes to the latent and host pools and
convert the same selections to the same pool rows; most decode steps advance; a doctored advance
is caught. ``materialize``'s Triton kernel against its reference under the interpreter."""
from __future__ import annotations

import random

import pytest
import torch

from triton_interpreter import run_cases
from vllm_hisparse.core.latent_ledger import LatentLedger
from vllm_hisparse.core.latent_runtime import LatentRuntime
from vllm_hisparse.ops import latent_plan
from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK, LATENT_ROW

MML, B, K, LAYERS, MAX_TOKENS, MAX_SEQS = 64, 16, 8, 2, 32, 4


def runtimes(resident: bool, lend: bool):
    sets, regions, pages = 3, (3 if resident else 2), (0 if resident else 400)
    made = [LatentRuntime(LAYERS, MML, B, sets, regions, pages, MAX_TOKENS, MAX_SEQS, K,
                          LATENT_ROW, torch.bfloat16, "cpu", pin=False, lend=lend)
            for _ in range(2)]
    made[1]._steady = lambda *a: False                 # the reference: a full plan every step
    for r in made:
        if r.host is not None:
            r.host.data.zero_()                        # unwritten pages compare equal
    led = LatentLedger(sets, regions, pages, MML, resident, lend=lend)
    return made, led


def buffers(rt):
    g = rt.graph
    return [g._meta, g.host_row, g.dec_slots, torch.tensor([g.planned])]


def episode(resident: bool, lend: bool, seed: int, doctor=None) -> int:
    """Drive both runtimes through one random episode; return the steps planned by advancing."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    (rt, ref), led = runtimes(resident, lend)
    if doctor is not None:
        doctor(rt)
    reqs: dict = {}                  # key -> [prompt, max_tokens, computed]
    order: list = []                 # the batch's rows, in order
    n = 0
    for step in range(160):
        if rng.random() < 0.08 or not reqs:                      # an admission
            key = f"r{n}"
            n += 1
            p, m = rng.randrange(2, 30), rng.randrange(1, 30)
            if led.refusal(key, p, m) is None:
                led.admit(key, p, m)
                reqs[key] = [p, m, 0]
                order.append(key)
        events = led.take_events()
        for r in (rt, ref):
            r.apply(events)
        keys, qsl, seq = [], [0], []
        for key in order:
            p, m, done = reqs[key]
            todo = min(rng.choice([3, 7, 16]), p - done) if done < p else 1
            keys.append(key)
            qsl.append(qsl[-1] + todo)
            seq.append(done + todo)
        if qsl[-1] > MAX_TOKENS or sum(1 for k in keys if reqs[k][2] >= reqs[k][0]) > MAX_SEQS:
            keys, qsl, seq = keys[:1], qsl[:2], seq[:1]           # what fits this step
        if rng.random() < 0.5:                                   # padding rows (FULL graphs)
            keys, qsl, seq = keys + [None], qsl + [qsl[-1]], seq + [0]
        for r in (rt, ref):
            r.plan(keys, qsl, seq)
        for a, b in zip(buffers(rt), buffers(ref)):
            assert torch.equal(a, b), (seed, step)
        T = qsl[-1] + rng.choice([0, 2])                         # vLLM's padding tokens
        kv_c = torch.randn(T, KV_LORA_RANK, generator=gen).to(torch.bfloat16)
        k_pe = torch.randn(T, LATENT_ROW - KV_LORA_RANK, generator=gen).to(torch.bfloat16)
        topk = torch.stack([torch.randperm(MML + 4, generator=gen)[:K] for _ in range(T)]).int()
        for layer in range(LAYERS):
            outs = []
            for r in (rt, ref):
                r.write(layer, kv_c, k_pe)
                out, valid = r.convert(layer, topk)
                outs.append((out.clone(), valid.clone()))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
            assert torch.equal(rt.pool.rows[layer], ref.pool.rows[layer]), (seed, step, layer)
            if not resident:
                assert torch.equal(rt.host.data[layer], ref.host.data[layer]), (seed, step)
        for key, s in zip(keys, seq):                            # the step's tokens computed
            if key is None:
                continue
            r = reqs[key]
            was_prefill = r[2] < r[0]
            r[2] = s
            if was_prefill and r[2] >= r[0]:
                led.prompt_done(key)
            if r[2] >= r[0] + r[1] - 1 or rng.random() < 0.01:  # finished (or aborted)
                led.release(key)
                del reqs[key]
                order.remove(key)
        if rng.random() < 0.05:
            rt.clear()                                           # a dummy run between steps
            ref.clear()
    assert torch.equal(rt.pool.counts, ref.pool.counts)
    return rt.steady_plans


@pytest.mark.parametrize("resident,lend", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_advanced_plans_equal_full_plans(resident, lend, seed):
    steady = episode(resident, lend, seed)
    assert steady >= 20, f"only {steady} steps advanced: the test must exercise advance"


def test_a_doctored_advance_is_caught():
    """An advance that forgets the decode entries' context lengths must fail the compare."""
    def doctor(rt):
        g = rt.graph
        real = g._materialize

        def wrong():
            real()
            if g.delta and g.D:
                g.dec_seq.sub_((g.dec_seq > 0).long())
        g._materialize = wrong
    with pytest.raises(AssertionError):
        episode(False, False, 0, doctor)


def test_a_step_after_an_event_is_planned_in_full():
    (rt, _), led = runtimes(False, False)
    led.admit("a", 4, 8)
    rt.apply(led.take_events())
    rt.plan(["a"], [0, 4], [4])
    led.prompt_done("a")
    rt.apply(led.take_events())
    rt.plan(["a"], [0, 1], [5])              # the first decode: an event came, a full plan
    rt.apply([])
    rt.plan(["a"], [0, 1], [6])              # steady
    rt.plan(["a"], [0, 1], [8])              # a skipped position: not steady
    assert rt.steady_plans == 1


def materialize_cases(fn, dev="cpu") -> None:
    g = torch.Generator().manual_seed(3)
    for T, D, extra, with_table in ((8, 3, 5, True), (33, 0, 0, True), (1030, 4, 9, False)):
        N = 3 * T + 4 * D + extra
        base = torch.randint(-1, 50, (N,), generator=g)
        base[3 * T + 3 * D:3 * T + 4 * D] = torch.randint(0, 3, (D,), generator=g)   # seq 0s
        table = torch.randint(-1, 999, (6, 60), generator=g, dtype=torch.int32)
        for delta in (0, 1, 7):
            outs = []
            for f, d in ((latent_plan.materialize, "cpu"), (fn, dev)):
                meta = torch.full((N,), 5, dtype=torch.int64, device=d)
                host_row = torch.full((T,), 5, dtype=torch.int64, device=d)
                f(base.to(d), meta, host_row, table.to(d) if with_table else None, delta, T, D)
                outs.append((meta.cpu(), host_row.cpu()))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
            assert (outs[0][1] >= 0).any() == with_table


def run_interpreter_cases():
    from vllm_hisparse.ops import triton_latent_plan as tlp
    materialize_cases(tlp.materialize)
    print("interpreter ok")


def test_materialize_kernel_in_the_interpreter():
    run_cases("test_dsa_steady_plan")


def test_materialize_reference_against_a_loop():
    T, D = 5, 2
    base = torch.tensor([3, -1, 0, 7, -1] + [4, -1, 2, 2, -1] + [9, -1, -2, 0, 0]
                        + [0, 1, 2, 3, 0, 1, 5, 0] + [42])
    table = torch.arange(200, dtype=torch.int32).view(4, 50)
    meta, host_row = torch.empty_like(base), torch.empty(T, dtype=torch.int64)
    latent_plan.materialize(base, meta, host_row, table, 2, T, D)
    for i, x in enumerate(base.tolist()):
        adv = (i < 2 * T and x >= 0) or (3 * T + 3 * D <= i < 3 * T + 4 * D and x > 0)
        assert int(meta[i]) == x + 2 * adv, i
    for t in range(T):
        s = int(meta[t])
        assert int(host_row[t]) == (int(table.view(-1)[s]) if s >= 0 else -1)


@pytest.mark.cuda
def test_materialize_kernel_on_the_gpu():
    from vllm_hisparse.ops import triton_latent_plan as tlp
    materialize_cases(tlp.materialize, "cuda")


def test_only_a_shipped_plan_advances():
    """load() (the tests' per-tensor reference) fills the buffers but no base plan with host
    sources: advancing it is refused; a plan whose -2 marks are not its decode tokens too."""
    from vllm_hisparse.core.latent_graph import batch_tokens
    from vllm_hisparse.core.latent_step import LatentStep, plan_arrays
    (rt, _), led = runtimes(False, False)
    led.admit("a", 4, 8)
    led.prompt_done("a")
    rt.apply(led.take_events())
    req, pos = batch_tokens([0, 1], [5])
    rt.graph.load(LatentStep.plan(rt.adm, ["a"], req, pos))
    with pytest.raises(RuntimeError, match="load_arrays"):
        rt.graph.advance()
    a = plan_arrays(rt.adm, ["a"], req, pos)
    rt.graph.load_arrays(a)
    rt.graph.advance()
    a.rbase[0] = -1                                  # the decode token unmarked
    with pytest.raises(ValueError, match="region_base -2"):
        rt.graph.load_arrays(a)


def test_the_steady_plan_knob_turns_advance_off(monkeypatch):
    """HISPARSE_STEADY_PLAN=0 (the GQA steady plan's A/B knob) plans every DSA step in full."""
    monkeypatch.setenv("HISPARSE_STEADY_PLAN", "0")
    (rt, _), led = runtimes(False, False)
    led.admit("a", 4, 8)
    led.prompt_done("a")
    rt.apply(led.take_events())
    for s in (5, 6, 7):
        rt.plan(["a"], [0, 1], [s])
    assert not rt.advance_on and rt.steady_plans == 0
