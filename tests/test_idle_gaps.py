"""bench.idle_gaps against a microsecond grid: a synthetic decode window whose GPU events leave
gaps, with the host launches (by correlation), the ops around them and other host work on two
threads; the gaps, what ended each one and the host time during them are recomputed here
µs by µs and must agree; a doctored attribution must not."""
from __future__ import annotations

import random

import pytest

from vllm_hisparse.bench import idle_gaps as ig
from vllm_hisparse.bench import served_profile as spf

STEP = "execute_context_0(0)_generation_1(1)"


def trace(seed: int, steps: int = 6):
    rng = random.Random(seed)
    ev, t, corr = [], 1000, 1
    starts = []
    for _ in range(steps):
        starts.append(t)
        ev.append({"ph": "X", "cat": "user_annotation", "name": STEP, "ts": t, "dur": 400,
                   "pid": 1, "tid": 7})
        k = t + rng.randint(0, 60)
        host_t = t + 1
        for j in range(rng.randint(3, 7)):
            op_len = rng.randint(3, 40)
            op = rng.choice(["aten::copy_", "hisparse.plan", "aten::index", "cudagraph"])
            ev.append({"ph": "X", "cat": rng.choice(["cpu_op", "user_annotation"]), "name": op,
                       "ts": host_t, "dur": op_len, "pid": 1, "tid": 7})
            if rng.random() < 0.5:        # an outer op around it, longer
                ev.append({"ph": "X", "cat": "cpu_op", "name": "outer", "ts": host_t - 1,
                           "dur": op_len + 5, "pid": 1, "tid": 7})
            launch = host_t + rng.randint(0, op_len - 2)
            name = rng.choice(["cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync"])
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": name, "ts": launch, "dur": 2,
                       "pid": 1, "tid": 7, "args": {"correlation": corr}})
            k = max(k, launch + rng.randint(1, 30)) + rng.choice([0, 0, rng.randint(20, 120)])
            d = rng.randint(10, 300)
            ev.append({"ph": "X", "cat": rng.choice(["kernel", "gpu_memcpy"]), "name": f"k{j}",
                       "ts": k, "dur": d, "pid": 0, "tid": 3, "args": {"correlation": corr}})
            corr += 1
            k += d - rng.randint(0, 15)
            host_t += op_len + rng.randint(6, 25)      # after the outer op: ops nest
        if rng.random() < 0.7:              # a sync on the host, and work on another thread
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize",
                       "ts": k - 50, "dur": rng.randint(60, 200), "pid": 1, "tid": 7,
                       "args": {"correlation": corr}})
            corr += 1
        ev.append({"ph": "X", "cat": "python_function", "name": "sched", "ts": t + 200,
                   "dur": rng.randint(50, 900), "pid": 1, "tid": 9})
        ev.append({"ph": "X", "cat": "kernel", "name": "orphan", "ts": k + rng.randint(30, 90),
                   "dur": 20, "pid": 0, "tid": 3})
        t = max(k, host_t) + rng.randint(100, 400)
    hi = t
    ev.append({"ph": "X", "cat": "user_annotation", "name": "execute_context_1(9)_generation_0(0)",
               "ts": hi, "dur": 10, "pid": 1, "tid": 7})
    rng.shuffle(ev)
    return ev, starts[0], hi, steps


def brute(ev, lo, hi, steps, min_us):
    gpu = [e for e in ev if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy = bytearray(hi - lo)
    for e in gpu:
        for us in range(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)):
            busy[us - lo] = 1
    gaps, us = [], lo
    while us < hi:
        if busy[us - lo]:
            us += 1
            continue
        a = us
        while us < hi and not busy[us - lo]:
            us += 1
        if us - a >= min_us:
            gaps.append((a, us))
    idle = bytearray(hi - lo)
    for a, b in gaps:
        for u in range(a, b):
            idle[u - lo] = 1
    launch = {e["args"]["correlation"]: e for e in ev if e["cat"] == "cuda_runtime"}
    ended = {}
    for a, b in gaps:
        later = [e for e in gpu if e["ts"] >= b]
        if b >= hi or not later:
            key = "(the window's end)"
        else:
            k = min(later, key=lambda e: e["ts"])
            ln = launch.get((k.get("args") or {}).get("correlation"))
            if ln is None:
                key = f"- / (no launch) / {k['name']}"
            else:
                around = [e for e in ev if e["cat"] in ("cpu_op", "user_annotation")
                          and e["name"] != STEP and e["tid"] == ln["tid"]
                          and e["ts"] <= ln["ts"] <= e["ts"] + e["dur"]]
                op = min(around, key=lambda e: (-e["ts"], e["dur"]))["name"] if around else "-"
                when = "in the gap" if ln["ts"] + ln["dur"] > a else "before it"
                key = f"{op} / {ln['name']} ({when}) / {k['name']}"
        c = ended.setdefault(key, [0, 0])
        c[0] += 1
        c[1] += b - a
    during = {}
    for e in ev:
        if e["cat"] in ig.HOST_CATS and e["name"] != STEP:
            o = sum(idle[u - lo] for u in range(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)))
            if o:
                c = during.setdefault(f"{e['cat']}: {e['name']}", [0, 0])
                c[0] += 1
                c[1] += o
    return gaps, ended, during


def as_dict(rows, steps):
    return {r["name"]: (round(r["calls_per_step"] * steps), round(r["us_per_step"] * steps, 6))
            for r in rows}


@pytest.mark.parametrize("seed", range(6))
def test_attribution_against_a_microsecond_grid(seed):
    ev, lo, hi, steps = trace(seed)
    min_us = 15
    r = ig.attribute(ev, lo, hi, steps, lambda e: e["name"] == STEP, min_us)
    gaps, ended, during = brute(ev, lo, hi, steps, min_us)
    assert gaps and r["gaps_per_step"] * steps == pytest.approx(len(gaps))
    assert r["us_per_step"] * steps == pytest.approx(sum(b - a for a, b in gaps))
    assert as_dict(r["ended_by"], steps) == {k: (c, float(u)) for k, (c, u) in ended.items()}
    assert as_dict(r["host_during"], steps) == {k: (c, float(u)) for k, (c, u) in during.items()}


def test_every_seed_of_a_wider_sweep():
    """The same comparison over 60 more traces (ops nesting, ties in start)."""
    for seed in range(100, 160):
        ev, lo, hi, steps = trace(seed, steps=3)
        r = ig.attribute(ev, lo, hi, steps, lambda e: e["name"] == STEP, 15)
        _, ended, during = brute(ev, lo, hi, steps, 15)
        assert as_dict(r["ended_by"], steps) == {k: (c, float(u)) for k, (c, u) in ended.items()}
        assert as_dict(r["host_during"], steps) == {k: (c, float(u))
                                                    for k, (c, u) in during.items()}


def _x(cat, name, ts, dur=None, tid=7, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "pid": 1, "tid": tid}
    if dur is not None:
        e["dur"] = dur
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_hand_built_rules():
    """The rules at their edges, each gap built by hand (one step, window [0, 1000), gaps >= 10):
    a launch still running when its gap begins is "in the gap", one that returned exactly at the
    gap's start "before it"; an op ending exactly at the launch contains it, the one started last
    of two containing ones is named, past ops started after it that do not; a cuda_driver launch counts; an event without dur or args
    and float times are read; a zero-length kernel splits no gap; a gap running to the window's
    end is named so though a kernel starts after it."""
    ev = [_x("kernel", "a", 0.0, 100.0, tid=3, corr=1),
          _x("cpu_op", "outer", 90.0, 50.0), _x("cpu_op", "inner", 95.0, 20.0),
          _x("user_annotation", "same_start", 95.0, 30.0),       # a tie: the shorter is named
          _x("cuda_runtime", "cudaLaunchKernel", 95.0, 20.0, corr=2),    # runs into [100, 130)
          _x("kernel", "b", 130.0, 70.0, tid=3, corr=2),
          _x("cuda_runtime", "cudaGraphLaunch", 150.0, 50.0, corr=3),    # returns at 200
          _x("kernel", "zero", 210.0, 0.0, tid=3),                       # no split
          _x("kernel", "c", 240.0, 60.0, tid=3, corr=3),                 # gap [200, 240): before
          _x("cpu_op", "drv_op", 300.5, 19.5),
          *[_x("cpu_op", "tiny", 302.0 + 2 * i, 1.0) for i in range(5)],  # inside it, earlier
          _x("cuda_driver", "cuLaunchKernel", 315.0, 30.0, corr=4),      # starts at the op's end
          _x("kernel", "d", 340.0, 600.0, tid=3, corr=4),                # gap [300, 340): in it
          _x("cpu_op", "no_dur", 320.0),                                 # zero length: no overlap
          {"ph": "X", "cat": "cpu_op", "name": "no_args", "ts": 305.5, "dur": 2.5, "pid": 1,
           "tid": 7, "args": None},
          _x("kernel", "late", 1200.0, 10.0, tid=3)]                     # gap [940, 1000): end
    r = ig.attribute(ev, 0.0, 1000.0, 1, lambda e: False, 10)
    assert r["gaps_per_step"] == 4 and r["us_per_step"] == 30 + 40 + 40 + 60
    ended = {x["name"]: x["us_per_step"] for x in r["ended_by"]}
    assert ended == {"inner / cudaLaunchKernel (in the gap) / b": 30.0,
                     "- / cudaGraphLaunch (before it) / c": 40.0,
                     "drv_op / cuLaunchKernel (in the gap) / d": 40.0,
                     "(the window's end)": 60.0}
    during = {x["name"]: x["us_per_step"] for x in r["host_during"]}
    assert during == {"cpu_op: outer": 30.0, "cpu_op: inner": 15.0, "cpu_op: tiny": 5.0,
                      "user_annotation: same_start": 25.0,
                      "cuda_runtime: cudaLaunchKernel": 15.0, "cpu_op: drv_op": 19.5,
                      "cuda_driver: cuLaunchKernel": 25.0, "cpu_op: no_args": 2.5}


def test_a_doctored_attribution_is_caught():
    """The comparison above can fail: the launch of the kernel that ends a gap moved out of its
    op changes the recomputed key, and the tool's table no longer matches the old one."""
    ev, lo, hi, steps = trace(1)
    r = ig.attribute(ev, lo, hi, steps, lambda e: e["name"] == STEP, 15)
    for e in ev:                                 # every launch to another thread
        if e["cat"] == "cuda_runtime":
            e["tid"] = 99
    _, ended, _ = brute(ev, lo, hi, steps, 15)
    assert as_dict(r["ended_by"], steps) != {k: (c, float(u)) for k, (c, u) in ended.items()}


def test_gaps_of():
    assert ig.gaps_of([(10, 20), (15, 30), (50, 60)], 0, 100, 5) == [(0, 10), (30, 50), (60, 100)]
    assert ig.gaps_of([(10, 20), (22, 30)], 12, 28, 1) == [(20, 22)]
    assert ig.gaps_of([], 0, 4, 5) == []


def test_summary_carries_the_idle_tables_and_diff_prints_them(tmp_path, capsys):
    ev, lo, hi, steps = trace(2)
    r = spf.summarize(ev, idle_min_us=15)
    assert r["decode_steps"] == steps
    idle = r["idle"]
    assert idle["min_us"] == 15 and idle["ended_by"] and idle["host_during"]
    assert not any(STEP in row["name"] for row in idle["host_during"])
    import json
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    json.dump(r, open(a, "w"))
    json.dump(spf.summarize(trace(3)[0], idle_min_us=15), open(b, "w"))
    spf.show_diff(str(a), str(b), top=5)
    out = capsys.readouterr().out
    assert "idle gaps by what ended them" in out and "host events during the idle gaps" in out
