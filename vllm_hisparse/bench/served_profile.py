"""A served engine's decode steps under vLLM's own torch profiler: what ``bench.step_profile`` shows
for an engine in one process, read from a ``vllm serve`` (the engine core in its own process beside
the API server, as users run it).

``bench.serving --profile-decode N`` starts each server with ``profiler_args`` (vLLM 0.26's
``--profiler-config``: the worker's torch profiler, started ``delay`` engine steps after
``/start_profile`` and stopped after N); after its sweep each server runs one more point, not
recorded, between ``/start_profile`` and ``/stop_profile``, and ``summarize`` reads the worker's
trace: vLLM annotates
every worker step (``execute_context_C(T)_generation_G(T)``, a ``user_annotation`` over the
step's ``execute_model`` host work), CUPTI records the kernels (those a CUDA graph replays
included). Per decode step (context 0): the interval between steps' starts, the host time of
``execute_model``, the GPU busy time (union of kernel intervals), the GPU's idle time in the
window, kernels by name, and where the idle time comes from (``bench.idle_gaps``: the host call
that ended each idle gap, the host work during the gaps). ``diff`` lines two summaries up kernel by
kernel, then their idle gaps.

    python -m vllm_hisparse.bench.served_profile summarize TRACE_DIR --out OUT.json
    python -m vllm_hisparse.bench.served_profile diff A.json B.json
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys
import time
import urllib.request

from vllm_hisparse.bench.idle_gaps import attribute
from vllm_hisparse.bench.profile_tables import GPU_CATS, diff, kernel_table, print_diff, union_us

STEP = re.compile(r"^execute_context_(\d+)\(\d+\)_generation_(\d+)\(\d+\)$")


def profiler_args(trace_dir: str, delay: int, steps: int) -> list[str]:
    """``vllm serve`` arguments: the worker's torch profiler into trace_dir, from ``delay`` engine
    steps after /start_profile for ``steps`` steps; no Python stacks (their cost would be the
    profile), the API server's own profiler off."""
    cfg = {"profiler": "torch", "torch_profiler_dir": os.path.abspath(trace_dir),
           "torch_profiler_with_stack": False, "ignore_frontend": True,
           "torch_profiler_dump_cuda_time_total": False,
           "delay_iterations": delay, "max_iterations": steps}
    return ["--profiler-config", json.dumps(cfg)]


def load_trace(path: str) -> list[dict]:
    """The trace events of a Chrome trace file (.json or .json.gz) as torch writes it."""
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def find_trace(trace_dir: str) -> str | None:
    """The newest worker trace under trace_dir (torch's tensorboard handler names it
    ``WORKER.TIME.pt.trace.json[.gz]``)."""
    found = glob.glob(os.path.join(trace_dir, "**", "*.pt.trace.json*"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def _step_annotation(e: dict) -> bool:
    return e.get("cat") == "user_annotation" and STEP.match(e.get("name", "")) is not None


def summarize(events: list[dict], idle_min_us: float = 20.0) -> dict:
    """Decode steps (worker steps with no context request and at least one generated token) of
    a trace's events: their count; per step the interval between consecutive steps' starts,
    ``execute_model``'s host time (the annotation's length), GPU busy and idle time within the
    window from the first decode step's start to the last one's next start (or its last kernel's
    end), kernels a step and the kernel table (µs and calls a step); ``idle``: the window's idle
    gaps of at least idle_min_us attributed (bench.idle_gaps)."""
    every = sorted((e["ts"], e["dur"], m[1] == "0" and int(m[2]) > 0) for e in events
                   if e.get("cat") == "user_annotation" and (m := STEP.match(e.get("name", ""))))
    steps = [(ts, dur) for ts, dur, decode in every if decode]
    if not steps:
        return {"decode_steps": 0}
    gpu = [(e["name"], float(e["ts"]), float(e.get("dur", 0))) for e in events
           if e.get("cat") in GPU_CATS]
    starts = [s for s, _ in steps]
    after = [ts for ts, _, _ in every if ts > starts[-1]]
    # the window: each step's work runs from its start to the next step's start (async
    # scheduling queues it ahead, so its kernels may end later: the last step keeps its kernels)
    lo = starts[0]
    hi = min(after) if after else max([s + d for _, s, d in gpu if s >= starts[-1]]
                                      + [starts[-1] + steps[-1][1]])
    n = len(steps)
    inside = [(name, max(s, lo), min(s + d, hi) - max(s, lo)) for name, s, d in gpu
              if s < hi and s + d > lo]
    busy = union_us([(s, s + d) for _, s, d in inside])
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    host = [d for _, d in steps]
    return {"decode_steps": n, "window_us": hi - lo,
            "step_interval_us": {"median": statistics.median(gaps) if gaps else None,
                                 "mean": statistics.fmean(gaps) if gaps else None},
            "execute_host_us": {"median": statistics.median(host), "mean": statistics.fmean(host)},
            "gpu_busy_us_per_step": busy / n, "gpu_idle_us_per_step": (hi - lo - busy) / n,
            "kernels_per_step": len(inside) / n, "kernels": kernel_table(inside, n),
            "idle": attribute(events, lo, hi, n, _step_annotation, idle_min_us)}


def post(port: int, path: str, timeout: float = 600.0) -> None:
    """POST to the server's ``path`` (``/start_profile``, ``/stop_profile``)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def collect(port: int, trace_dir: str, out_json: str, wait_s: float = 180.0) -> dict:
    """/stop_profile (the profiler may have stopped itself after its steps), wait for the worker's
    trace to be written whole (its size unchanged for 2 s), summarize it into out_json."""
    post(port, "/stop_profile")
    t0, path, size = time.time(), None, -1
    while time.time() - t0 < wait_s:
        path = find_trace(trace_dir)
        if path is not None and os.path.getsize(path) == size:
            break
        size = os.path.getsize(path) if path is not None else -1
        time.sleep(2)
    else:
        raise RuntimeError(f"no whole worker trace in {trace_dir} {wait_s:.0f} s after "
                           f"/stop_profile (see the server log)")
    return summarize_file(path, out_json)


def summarize_file(path: str, out_json: str | None = None) -> dict:
    """``summarize`` of the trace file at path, with the path; written to out_json if given."""
    r = {"trace": path, **summarize(load_trace(path))}
    if out_json:
        with open(out_json, "w") as f:
            json.dump(r, f, indent=1)
    return r


def summary_line(name: str, r: dict) -> str:
    if not r.get("decode_steps"):
        return f"{name}: no decode step in the trace"
    iv, h = r["step_interval_us"], r["execute_host_us"]
    return (f"{name}: {r['decode_steps']} decode steps; interval median "
            f"{iv['median'] or 0:.1f} us (mean {iv['mean'] or 0:.1f}); execute_model host "
            f"{h['median']:.1f} us; GPU busy {r['gpu_busy_us_per_step']:.1f} us, idle "
            f"{r['gpu_idle_us_per_step']:.1f} us, {r['kernels_per_step']:.1f} kernels a step"
            + (f"; {r['idle']['gaps_per_step']:.1f} idle gaps of >= {r['idle']['min_us']:g} us a "
               f"step ({r['idle']['us_per_step']:.1f} us)" if r.get("idle") else ""))


def show_diff(pa: str, pb: str, top: int = 20) -> list[dict]:
    ra, rb = json.load(open(pa)), json.load(open(pb))
    print(f"a = {summary_line(pa, ra)}\nb = {summary_line(pb, rb)}")
    rows = diff(ra.get("kernels", []), rb.get("kernels", []))
    print_diff("kernels", rows, top)
    ia, ib = ra.get("idle"), rb.get("idle")
    if ia and ib:
        print(f"-- idle gaps of >= {ia['min_us']:g} us: {ia['gaps_per_step']:.1f} a step, "
              f"{ia['us_per_step']:.1f} us -> {ib['gaps_per_step']:.1f} a step, "
              f"{ib['us_per_step']:.1f} us")
        print_diff("idle gaps by what ended them (host op / launch / first GPU event)",
                   diff(ia["ended_by"], ib["ended_by"]), top)
        print_diff("host events during the idle gaps (inclusive overlap)",
                   diff(ia["host_during"], ib["host_during"]), top)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="a served worker's trace: its decode steps")
    s.add_argument("trace", help="a trace file, or a folder holding one (the newest is read)")
    s.add_argument("--out", default=None, help="write the summary (JSON) here")
    d = sub.add_parser("diff", help="two summaries side by side")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    if a.cmd == "diff":
        show_diff(a.a, a.b, a.top)
        return 0
    path = find_trace(a.trace) if os.path.isdir(a.trace) else a.trace
    if path is None:
        p.error(f"no *.pt.trace.json[.gz] under {a.trace}: did the server run with "
                f"--profiler-config and get /stop_profile?")
    print(summary_line(path, summarize_file(path, a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
