"""Turn replays into result rows (results.csv, per_step.csv) and a printed summary.

miss_rate: misses / selected units per step, averaged over steps (and layers for layer "all").
steady_miss_rate: the same over steps >= warmup only (the buffer has filled by then).
"""
from __future__ import annotations

import csv
import os

import numpy as np

from .engine import Replay

COLUMNS = ["trace", "layer", "k", "buffer", "buffer_x_k", "window", "policy", "write_allocate",
           "miss_rate", "steady_miss_rate", "misses", "selected", "steps"]


def _rate(m: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per-step miss rate (steps, rows), nan where nothing was selected."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, m / np.maximum(n, 1), np.nan)


def rows_of(rep: Replay, warmup: int) -> list[dict]:
    """One row per config for layer 'all' plus one per trace row (layer or layer x head)."""
    out = []
    for c, m, n in zip(rep.configs, rep.misses, rep.selected):
        rate = _rate(m, n)
        w = min(warmup, max(rate.shape[0] - 1, 0))
        base = dict(trace=rep.trace.name, k=c.k, buffer=c.slots, buffer_x_k=round(c.slots / c.k, 3),
                    window=c.window, policy=rep.policy, write_allocate="on" if c.write_allocate else "off",
                    steps=rate.shape[0])
        out.append(dict(base, layer="all", miss_rate=float(np.nanmean(rate)),
                        steady_miss_rate=float(np.nanmean(rate[w:])),
                        misses=int(m.sum()), selected=int(n.sum())))
        for layer in range(rate.shape[1]):
            out.append(dict(base, layer=layer, miss_rate=float(np.nanmean(rate[:, layer])),
                            steady_miss_rate=float(np.nanmean(rate[w:, layer])),
                            misses=int(m[:, layer].sum()), selected=int(n[:, layer].sum())))
    return out


def per_step_of(rep: Replay) -> list[dict]:
    """Miss rate per step averaged over the trace rows, for the replay plot."""
    out = []
    for c, m, n in zip(rep.configs, rep.misses, rep.selected):
        rate = np.nanmean(_rate(m, n), axis=1)
        for t, r in enumerate(rate):
            out.append(dict(trace=rep.trace.name, k=c.k, buffer=c.slots, window=c.window,
                            policy=rep.policy,
                            write_allocate="on" if c.write_allocate else "off", step=t,
                            miss_rate=float(r)))
    return out


def write_csv(path: str, rows: list[dict], columns: list[str] | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    columns = columns or (list(rows[0]) if rows else [])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in r.items()})
    return path


def summary(rows: list[dict]) -> str:
    """Steady miss rate (%) of layer 'all', averaged over traces: one line per (k, B, window,
    write-allocate), one column per policy."""
    agg: dict = {}
    for r in rows:
        if r["layer"] != "all":
            continue
        key = (r["k"], r["buffer"], r.get("window", 0), r["write_allocate"])
        agg.setdefault(key, {}).setdefault(r["policy"], []).append(r["steady_miss_rate"])
    policies = sorted({p for v in agg.values() for p in v})
    lines = ["steady miss rate % (mean over traces)",
             f"{'k':>5} {'B':>6} {'W':>6} {'wa':>3} " + " ".join(f"{p:>9}" for p in policies)]
    for (k, b, w, wa), v in sorted(agg.items()):
        cells = [f"{100 * np.mean(v[p]):9.2f}" if p in v else f"{'-':>9}" for p in policies]
        lines.append(f"{k:>5} {b:>6} {w:>6} {wa:>3} " + " ".join(cells))
    return "\n".join(lines)
