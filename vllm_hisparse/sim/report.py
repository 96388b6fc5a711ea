"""Markdown tables from one or more results.csv files (the tables of docs/cache-policies.md).

    python -m vllm_hisparse.sim.report out/sim-topk/results.csv [--new crf] [--traces T.npz ...]

Per (k, B): steady miss rate % per trace and policy (layer "all"), the mean over traces, the policy
ordering, and the new policy's gain over LRU in points and in % of the LRU -> Bélády gap.
With --traces, also the share of first-touch selections that are tokens produced while decoding.
"""
from __future__ import annotations

import argparse
import csv
import sys

import numpy as np

from . import trace as tracefmt


def _key(r: dict) -> tuple[int, int, int, int]:
    """(k, B, window, lookahead) of a results row (older files have no window / lookahead)."""
    return (int(r["k"]), int(r["buffer"]), int(r.get("window") or 0), int(r.get("lookahead") or 0))


def _extras(w: int, la: int, sep: str = " +") -> str:
    return (f"{sep} window {w}" if w else "") + (f"{sep} lookahead {la}" if la else "")


def load_rows(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [r for r in csv.DictReader(f) if r["layer"] == "all"]
    return rows


def tables(rows: list[dict], new: str = "crf") -> str:
    out = []
    for wa in sorted({r["write_allocate"] for r in rows}, reverse=True):
        sub = [r for r in rows if r["write_allocate"] == wa]
        for k, b, w, la in sorted({_key(r) for r in sub}):
            cell = {(r["trace"], r["policy"]): 100 * float(r["steady_miss_rate"])
                    for r in sub if _key(r) == (k, b, w, la)}
            traces = sorted({t for t, _ in cell})
            pols = sorted({p for _, p in cell},
                          key=lambda p: -np.mean([cell.get((t, p), np.nan) for t in traces]))
            mean = {p: float(np.mean([cell[(t, p)] for t in traces if (t, p) in cell])) for p in pols}
            win = _extras(w, la, ",")
            out.append(f"\n**k={k}, B={b} ({b / k:g}k){win}, write-allocate {wa}** — steady miss "
                       f"rate %\n")
            out.append("| trace | " + " | ".join(pols) + " |")
            out.append("|---" * (len(pols) + 1) + "|")
            for t in traces:
                out.append(f"| {t} | " + " | ".join(f"{cell[(t, p)]:.2f}" if (t, p) in cell else "-"
                                                   for p in pols) + " |")
            out.append("| **mean** | " + " | ".join(f"**{mean[p]:.2f}**" for p in pols) + " |")
            order = " < ".join(sorted(mean, key=mean.get))
            line = f"\nordering (best first): {order}"
            if {new, "lru", "belady"} <= set(mean) and mean["lru"] > mean["belady"]:
                gap = mean["lru"] - mean["belady"]
                gain = mean["lru"] - mean[new]
                line += (f"; {new} vs lru: {gain:+.2f} points, {100 * gain / gap:.1f}% of the "
                         f"LRU->Bélády gap ({gap:.2f} points)")
            out.append(line)
    return "\n".join(out)


def compact(rows: list[dict], new: str = "crf") -> str:
    """One table: a line per (k, B, window, lookahead, write-allocate) with the mean over traces of
    every policy, the new policy's gain over LRU (points) and its share of the LRU -> Bélády gap."""
    agg: dict = {}
    for r in rows:
        key = (*_key(r), r["write_allocate"])
        agg.setdefault(key, {}).setdefault(r["policy"], []).append(100 * float(r["steady_miss_rate"]))
    pols = sorted({p for v in agg.values() for p in v},
                  key=lambda p: -np.mean([np.mean(v[p]) for v in agg.values() if p in v]))
    head = ["k", "B", "write-alloc"] + pols + [f"{new} gain (pts)", "% of LRU->Bélády gap"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for (k, b, w, la, wa), v in sorted(agg.items(), key=lambda kv: (kv[0][4] != "on", kv[0][:4])):
        mean = {p: float(np.mean(v[p])) for p in v}
        buf = f"{b} ({b / k:g}k)" + _extras(w, la)
        cells = [str(k), buf, wa] + [f"{mean[p]:.2f}" if p in mean else "-" for p in pols]
        if {new, "lru", "belady"} <= set(mean) and mean["lru"] > mean["belady"]:
            gain = mean["lru"] - mean[new]
            cells += [f"{gain:+.2f}", f"{100 * gain / (mean['lru'] - mean['belady']):.1f}%"]
        else:
            cells += ["-", "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def first_touch_decode_share(tr: tracefmt.Trace, k: int) -> float:
    """Of all first selections of a unit (per row), the share that are units produced by decoding
    (unit >= the unit of the first decode step's token): misses no buffer can avoid without
    write-allocate."""
    pos = tr.first_k(min(k, tr.k_max))
    first_decode_unit = (int(tr.context_len[0]) - 1) // tr.unit
    total = new = 0
    for row in range(tr.layers):
        units, idx = np.unique(pos[:, row][pos[:, row] >= 0], return_index=True)
        total += len(units)
        new += int((units >= first_decode_unit).sum())
    return new / max(total, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_hisparse.sim.report", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="results.csv files of `hisparse sim`")
    p.add_argument("--new", default="crf", help="the policy whose gain over LRU is reported")
    p.add_argument("--traces", nargs="*", default=[], help="trace files for the first-touch table")
    p.add_argument("--k", default="64,128,256")
    p.add_argument("--compact", action="store_true", help="one table of means over traces")
    a = p.parse_args(argv)
    rows = load_rows(a.results)
    print(compact(rows, a.new) if a.compact else tables(rows, a.new))
    if a.traces:
        ks = [int(x) for x in a.k.split(",")]
        print("\n| trace | " + " | ".join(f"k={k}" for k in ks) + " |")
        print("|---" * (len(ks) + 1) + "|")
        for path in a.traces:
            tr = tracefmt.load(path)
            print(f"| {tr.name} | " + " | ".join(
                f"{100 * first_touch_decode_share(tr, k):.1f}%" if k <= tr.k_max else "-" for k in ks) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
