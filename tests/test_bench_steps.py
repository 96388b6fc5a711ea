"""The serving benchmark's decode-only figure (bench/steps.py) from the server's step records
(vllm/step_log.py): scripted runs with known rates, and a run recorded from a real `vllm serve`."""
from __future__ import annotations

import gzip
import json
import os
import random

import pytest

from vllm_hisparse.bench import steps as st

DATA = os.path.join(os.path.dirname(__file__), "data")


def rec(t, gen, running, itl, first=0, prompt=0, finished=0, waiting=0, preempted=0):
    return {"t": t, "gen": gen, "first": first, "prompt": prompt, "finished": finished,
            "preempted": preempted, "itl": itl, "running": running, "waiting": waiting}


def scripted(rng):
    """4 requests, one per 0.5 s arriving, prompts prefilled in 3 chunks each (steps without their
    token), decode steps of a random duration, two finishing early and a fifth request prefilled in
    between (its steps are not decode-only): returns the records and the true decode-only tokens
    and seconds."""
    recs, t, tokens, seconds = [], 0.0, 0, 0.0
    running = 0

    def step(dur, gen, decode_only, **kw):
        nonlocal t, tokens, seconds
        t += dur
        recs.append(rec(t, gen, running, kw.pop("itl", dur), **kw))
        if decode_only:
            tokens, seconds = tokens + gen, seconds + dur

    for _ in range(4):                              # each arrival: 3 prefill chunks, then decode
        running += 1
        step(0.3, running - 1, False, itl=0.3 if running > 1 else None)   # chunk 1: others decode
        step(0.3, running - 1, False, itl=0.3 if running > 1 else None)
        step(0.3, running, False, first=1, prompt=1000)                 # last chunk: first token
    for _ in range(50):
        step(rng.uniform(0.02, 0.05), running, True)
    running -= 2                                    # two finish in this step
    step(0.04, running + 2, True, finished=2)
    for _ in range(20):
        step(rng.uniform(0.02, 0.05), running, True)
    step(0.03, running, False, waiting=1)           # a request waits for room: not decode-only
    running += 1
    step(0.4, running - 1, False)                   # its prefill
    step(0.4, running, False, first=1, prompt=900)
    for _ in range(30):
        step(rng.uniform(0.02, 0.05), running, True)
    return recs, tokens, seconds


def test_decode_rate_counts_only_steps_without_prefill():
    rng = random.Random()
    recs, tokens, seconds = scripted(rng)
    d = st.decode_rate(recs)
    assert d["tokens"] == tokens and d["seconds"] == pytest.approx(seconds)
    assert d["tok_s"] == pytest.approx(tokens / seconds)
    assert d["steps"] == 50 + 1 + 20 + 30
    # with the prefill steps it would read lower: the end-to-end rate is not the decode rate
    e2e = sum(r["gen"] for r in recs) / recs[-1]["t"]
    assert e2e < 0.9 * d["tok_s"]
    assert st.running(recs) == (4, pytest.approx(sum(r["running"] for r in recs) / len(recs)))
    assert st.decode_rate(recs[:12])["tok_s"] is None            # only prefill: no figure


def test_decode_runs_are_the_windows_without_prefill():
    recs, _, _ = scripted(random.Random(3))
    runs = st.decode_runs(recs)
    assert [b - a + 1 for a, b in runs] == [71, 30]
    for a, b in runs:
        assert all(st.decode_only(r) for r in recs[a:b + 1])
        assert not st.decode_only(recs[a - 1])


def test_read_leaves_a_partial_line(tmp_path):
    p = tmp_path / "steps.jsonl"
    p.write_text(json.dumps(rec(1.0, 2, 2, 0.01)) + "\n" + '{"t": 2.0, "ge')
    recs, off = st.read(str(p))
    assert len(recs) == 1 and off == len(json.dumps(rec(1.0, 2, 2, 0.01))) + 1
    with open(p, "a") as f:
        f.write('n": 1, "first": 0, "prompt": 0, "finished": 0, "preempted": 0, "itl": 0.5, '
                '"running": 1, "waiting": 0}\n')
    more, off2 = st.read(str(p), off)
    assert [r["t"] for r in more] == [2.0] and off2 == p.stat().st_size
    assert st.read(str(tmp_path / "none.jsonl")) == ([], 0)


@pytest.mark.parametrize("backend", ["hisparse", "stock"])
def test_recorded_decode_rate_agrees_with_tokens_over_time(backend):
    """Runs recorded from `vllm serve` (the benchmark on the CPU tiny model: tests/data/README.md):
    in every window of at least 20 consecutive steps where no request is in prefill, the decode-only
    figure (tokens / engine step durations) agrees with tokens / time on the front end's clock
    (what a counter read at the window's ends gives) within 5%; and the run's decode-only figure
    with the same over all its decode windows."""
    with gzip.open(os.path.join(DATA, f"steps-cpu-tiny-{backend}.jsonl.gz"), "rt") as f:
        recs = [json.loads(line) for line in f]
    runs = [(a, b) for a, b in st.decode_runs(recs) if b - a + 1 >= 20]
    assert runs, "the recording has no decode-only window"
    tok = sec = 0.0
    for a, b in runs:
        engine = st.decode_rate(recs[a:b + 1])["tok_s"]
        front = st.window_rate(recs, a - 1, b)        # record a-1 opens the window
        assert engine == pytest.approx(front, rel=0.05), (a, b)
        tok += sum(r["gen"] for r in recs[a:b + 1])
        sec += recs[b]["t"] - recs[a - 1]["t"]
    whole = st.decode_rate(recs)
    assert whole["steps"] >= sum(b - a + 1 for a, b in runs)
    assert whole["tok_s"] == pytest.approx(tok / sec, rel=0.05)


@pytest.mark.vllm
def test_step_logger_writes_one_line_per_step(tmp_path, monkeypatch):
    """vllm/step_log.py: with HISPARSE_STEP_LOG set, a record per step from vLLM's own stats
    objects; without it, nothing."""
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    from vllm_hisparse.vllm.step_log import STEP_LOG_ENV, StepLogger

    it = IterationStats()
    it.num_generation_tokens = 3
    it.inter_token_latencies_iter = [0.02, 0.021, 0.5]
    it.time_to_first_tokens_iter = [1.5]
    sc = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1)
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    StepLogger(None).record(sc, it)                           # inert
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(path))
    logger = StepLogger(None)
    logger.record(sc, it)
    logger.record(sc, None)                                   # a step without outputs
    logger.record(None, None)                                 # nothing to say
    recs, _ = st.read(str(path))
    assert len(recs) == 2
    assert {k: recs[0][k] for k in ("gen", "first", "running", "waiting", "itl")} == \
        {"gen": 3, "first": 1, "running": 3, "waiting": 1, "itl": 0.021}
    assert recs[1]["gen"] == 0 and recs[1]["itl"] is None and recs[1]["running"] == 3
    assert not st.decode_only(recs[0]) and not st.decode_only(recs[1])
