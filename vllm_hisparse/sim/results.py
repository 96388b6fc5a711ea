"""Turn replays into result rows (results.csv, per_step.csv) and a printed summary.

miss_rate: misses / selected units per step, averaged over steps (and layers for layer "all").
steady_miss_rate: the same over steps >= warmup only (the buffer has filled by then).
prefetched: units the lookahead fetched off the critical path (engine.Config.lookahead), over all
steps; steady_prefetch_rate: those per selected unit over steps >= warmup (the bytes the link
carries beside the misses, as a share of the selection).
"""
from __future__ import annotations

import csv
import os

import numpy as np

from .engine import Replay

COLUMNS = ["trace", "layer", "k", "buffer", "buffer_x_k", "window", "lookahead", "policy",
           "write_allocate", "miss_rate", "steady_miss_rate", "misses", "selected", "prefetched",
           "steady_prefetch_rate", "steps"]


def _rate(m: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per-step miss rate (steps, rows), nan where nothing was selected."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, m / np.maximum(n, 1), np.nan)


def _per_selected(f: np.ndarray, n: np.ndarray) -> float:
    """Prefetched units per selected unit, over every step and row given."""
    return float(f.sum() / max(int(n.sum()), 1))


def rows_of(rep: Replay, warmup: int) -> list[dict]:
    """One row per config for layer 'all' plus one per trace row (layer or layer x head)."""
    out = []
    for c, m, n, f in zip(rep.configs, rep.misses, rep.selected, rep.prefetched):
        rate = _rate(m, n)
        w = min(warmup, max(rate.shape[0] - 1, 0))
        base = dict(trace=rep.trace.name, k=c.k, buffer=c.slots, buffer_x_k=round(c.slots / c.k, 3),
                    window=c.window, lookahead=c.lookahead, policy=rep.policy,
                    write_allocate="on" if c.write_allocate else "off", steps=rate.shape[0])
        # layer "all" takes every trace row's column, a layer row its own
        for layer, col in [("all", slice(None))] + [(i, i) for i in range(rate.shape[1])]:
            out.append(dict(base, layer=layer, miss_rate=float(np.nanmean(rate[:, col])),
                            steady_miss_rate=float(np.nanmean(rate[w:, col])),
                            misses=int(m[:, col].sum()), selected=int(n[:, col].sum()),
                            prefetched=int(f[:, col].sum()),
                            steady_prefetch_rate=_per_selected(f[w:, col], n[w:, col])))
    return out


def per_step_of(rep: Replay) -> list[dict]:
    """Miss rate per step averaged over the trace rows, for the replay plot."""
    out = []
    for c, m, n in zip(rep.configs, rep.misses, rep.selected):
        rate = np.nanmean(_rate(m, n), axis=1)
        for t, r in enumerate(rate):
            out.append(dict(trace=rep.trace.name, k=c.k, buffer=c.slots, window=c.window,
                            lookahead=c.lookahead, policy=rep.policy,
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
    lookahead, write-allocate), one column per policy; with a lookahead, a second table of the
    units it prefetched (% of the selected ones)."""
    agg: dict = {}
    pre: dict = {}
    for r in rows:
        if r["layer"] != "all":
            continue
        key = (r["k"], r["buffer"], r.get("window", 0), r.get("lookahead", 0), r["write_allocate"])
        agg.setdefault(key, {}).setdefault(r["policy"], []).append(r["steady_miss_rate"])
        pre.setdefault(key, {}).setdefault(r["policy"], []).append(r.get("steady_prefetch_rate", 0.0))
    policies = sorted({p for v in agg.values() for p in v})
    head = f"{'k':>5} {'B':>6} {'W':>6} {'L':>6} {'wa':>3} " + " ".join(f"{p:>9}" for p in policies)

    def table(title, vals, keys):
        lines = [title, head]
        for key in keys:
            k, b, w, la, wa = key
            cells = [f"{100 * np.mean(vals[key][p]):9.2f}" if p in vals[key] else f"{'-':>9}"
                     for p in policies]
            lines.append(f"{k:>5} {b:>6} {w:>6} {la:>6} {wa:>3} " + " ".join(cells))
        return lines

    lines = table("steady miss rate % (mean over traces)", agg, sorted(agg))
    ahead = sorted(k for k in pre if k[3])
    if ahead:
        lines += table("prefetched by the lookahead, % of the selected units (off the critical "
                       "path; mean over traces)", pre, ahead)
    return "\n".join(lines)
