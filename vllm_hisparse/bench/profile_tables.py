"""Profile tables shared by ``bench.step_profile`` (an engine in one process) and
``bench.served_profile`` (a served engine's trace): GPU busy time as the union of kernel intervals,
kernels by name per step, and two tables lined up name by name."""
from __future__ import annotations

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")      # a torch trace's GPU events


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (overlapping kernels count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def kernel_table(events: list[tuple[str, float, float]], steps: int) -> list[dict]:
    """events: (name, start µs, duration µs) of every kernel in the window; steps: decode steps in
    it. Rows by total time, largest first: name, calls and µs a step."""
    agg: dict[str, list] = {}
    for name, _, dur in events:
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += dur
    rows = [{"name": n, "calls_per_step": c / steps, "us_per_step": t / steps}
            for n, (c, t) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def diff(a: list[dict], b: list[dict]) -> list[dict]:
    """Two kernel (or host-op) tables joined by name: µs and calls a step in each, b - a; largest
    |difference| first."""
    ka, kb = {r["name"]: r for r in a}, {r["name"]: r for r in b}
    out = []
    for n in set(ka) | set(kb):
        ra, rb = ka.get(n, {}), kb.get(n, {})
        ua, ub = ra.get("us_per_step", 0.0), rb.get("us_per_step", 0.0)
        out.append({"name": n, "a_us": ua, "b_us": ub, "delta_us": ub - ua,
                    "a_calls": ra.get("calls_per_step", 0.0), "b_calls": rb.get("calls_per_step", 0.0)})
    return sorted(out, key=lambda r: (-abs(r["delta_us"]), r["name"]))


def print_diff(what: str, rows: list[dict], top: int) -> None:
    """The first ``top`` rows of a ``diff`` under a heading naming the table."""
    print(f"-- {what}: us a step (calls a step), a -> b, largest difference first")
    for r in rows[:top]:
        print(f"{r['delta_us']:+9.2f}  {r['a_us']:9.2f} ({r['a_calls']:5.1f}) -> {r['b_us']:9.2f} "
              f"({r['b_calls']:5.1f})  {r['name'][:110]}")
