"""Where a served decode step's GPU idle time comes from, read from the worker's trace (what
``bench.served_profile`` summarizes): the GPU's idle gaps of at least ``min_us`` inside the decode
window, each attributed two ways.

- **What ended it**: the first GPU event at the gap's end, the host call that launched it (the
  CUDA runtime event of the same ``correlation``: ``cudaGraphLaunch``, ``cudaLaunchKernel``,
  ``cudaMemcpyAsync`` ...) and the innermost host op around that call on its thread (a
  ``cpu_op`` or ``user_annotation``). A launch call still running when the gap began (or issued
  in it) means the GPU waited for the host ("in the gap"); one that had returned before it, for
  something else ("before it": a stream wait, a copy from pageable memory, a graph's own
  dependencies). A gap that runs to the window's end is labelled so, whatever starts later.
- **What the host did meanwhile**: every host event (``cpu_op``, ``user_annotation``,
  ``cuda_runtime``, ``cuda_driver``, ``python_function``) overlapping a gap, its overlap summed
  by category and name (inclusive: nested ops each count their own overlap), so a synchronizing
  call (``cudaStreamSynchronize``, ``cudaEventSynchronize``) or a host op that runs while the GPU
  waits shows by name. vLLM's step annotations (``execute_context_...``) cover every gap and are
  left out.

Both tables are rows of name, calls (gaps ended, or events overlapping) and µs a step, as
``profile_tables.diff`` lines up.
"""
from __future__ import annotations

import bisect

from vllm_hisparse.bench.profile_tables import GPU_CATS

HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
AROUND_CATS = ("cpu_op", "user_annotation")


def gaps_of(busy: list[tuple[float, float]], lo: float, hi: float,
            min_us: float) -> list[tuple[float, float]]:
    """The idle intervals of [lo, hi) outside the union of busy [start, end) intervals, those of at
    least min_us, in order."""
    out, cur = [], lo
    for s, e in sorted(busy):
        if e <= s:                   # a zero-length event keeps the GPU busy for no time
            continue
        if s > cur:
            out.append((cur, min(s, hi)))
        cur = max(cur, e)
        if cur >= hi:
            break
    if cur < hi:
        out.append((cur, hi))
    return [(a, b) for a, b in out if b - a >= min_us]


def _corr(e: dict):
    return (e.get("args") or {}).get("correlation")


def _around(ops_by_tid: dict, launch: dict) -> str:
    """The innermost op (AROUND_CATS) on the launch's thread containing its start: of those that
    start at or before it and end at or after it, the one that started last (host ops nest on a
    thread), the shortest of a tie; '-' if none among the 4,000 ops started just before it."""
    evs, starts = ops_by_tid.get((launch.get("pid"), launch.get("tid")), ([], []))
    t = float(launch["ts"])
    best, top = None, bisect.bisect_right(starts, t)
    for i in range(top - 1, max(-1, top - 4000), -1):     # latest start first
        e = evs[i]
        if best is not None and starts[i] < starts[best]:
            break
        if starts[i] + float(e.get("dur", 0)) >= t and (
                best is None or float(e.get("dur", 0)) < float(evs[best].get("dur", 0))):
            best = i
    return evs[best]["name"] if best is not None else "-"


def attribute(events: list[dict], lo: float, hi: float, steps: int, skip,
              min_us: float = 20.0) -> dict:
    """events: the trace's events; [lo, hi): the decode window of ``steps`` steps; skip(event):
    host events to leave out (the step annotations). Returns the ``idle`` summary: min_us, gaps
    and their µs a step, ``ended_by`` and ``host_during`` tables (module docstring)."""
    gpu_ev = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: float(e["ts"]))
    gpu_starts = [float(e["ts"]) for e in gpu_ev]
    busy = [(s, s + float(e.get("dur", 0))) for s, e in zip(gpu_starts, gpu_ev)]
    gaps = gaps_of([(s, t) for s, t in busy if s < hi and t > lo], lo, hi, min_us)
    launches = {_corr(e): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and _corr(e) is not None}
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and not skip(e)),
                  key=lambda e: float(e["ts"]))
    ops_by_tid: dict = {}
    for e in host:
        if e["cat"] in AROUND_CATS:
            evs, starts = ops_by_tid.setdefault((e.get("pid"), e.get("tid")), ([], []))
            evs.append(e)
            starts.append(float(e["ts"]))
    ended: dict[str, list] = {}
    for g0, g1 in gaps:
        i = bisect.bisect_left(gpu_starts, g1)
        if g1 >= hi or i == len(gpu_ev):
            key = "(the window's end)"
        else:
            k = gpu_ev[i]
            launch = launches.get(_corr(k))
            if launch is None:
                key = f"- / (no launch) / {k['name']}"
            else:
                when = "in the gap" if float(launch["ts"]) + float(launch.get("dur", 0)) > g0 \
                    else "before it"
                key = f"{_around(ops_by_tid, launch)} / {launch['name']} ({when}) / {k['name']}"
        a = ended.setdefault(key, [0, 0.0])
        a[0] += 1
        a[1] += g1 - g0
    during: dict[str, list] = {}
    g_starts = [a for a, _ in gaps]
    for e in host:
        s = float(e["ts"])
        t = s + float(e.get("dur", 0))
        j = bisect.bisect_left(g_starts, t) - 1
        hit = 0.0
        while j >= 0 and gaps[j][1] > s:
            hit += max(0.0, min(t, gaps[j][1]) - max(s, gaps[j][0]))
            j -= 1
        if hit > 0:
            a = during.setdefault(f"{e['cat']}: {e['name']}", [0, 0.0])
            a[0] += 1
            a[1] += hit

    def table(agg):
        rows = [{"name": n, "calls_per_step": c / steps, "us_per_step": us / steps}
                for n, (c, us) in agg.items()]
        return sorted(rows, key=lambda r: (-r["us_per_step"], r["name"]))

    return {"min_us": min_us, "gaps_per_step": len(gaps) / steps,
            "us_per_step": sum(b - a for a, b in gaps) / steps,
            "ended_by": table(ended), "host_during": table(during)}
