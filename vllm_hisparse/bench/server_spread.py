"""Backends compared over several servers each: one row a (backend, concurrency) of the serving
benchmark's CSVs (``bench.serving`` run with a backend repeated, ``--backends
resident,elastic,resident,elastic``), with the number of servers, the mean of a figure, its range
across them, and the mean against a baseline backend's at the same concurrency.

Two servers of one backend can differ by as much as two backends do (docs/gpu-results.md,
the served 32K / 1 rows), so a one-server-each gap is no evidence; this puts the spread beside
the gap.

    python -m vllm_hisparse.bench.server_spread OUT/serving.csv [MORE.csv ...] \\
        [--figure tpot_mean_ms] [--baseline resident]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys

FIGURES = ("tpot_mean_ms", "decode_step_ms", "ttft_mean_s", "output_tok_s", "decode_tok_s")


def read_rows(paths: list[str]) -> list[dict]:
    """The rows of the CSVs, in file order."""
    rows = []
    for p in paths:
        with open(p, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def spread(rows: list[dict], figure: str, baseline: str | None = None) -> list[dict]:
    """One dict a (backend, concurrency), in order of first appearance: servers, mean, lo, hi, and
    ``vs_base`` (mean / the baseline backend's mean at that concurrency - 1; None for the baseline
    itself and where it has no row). baseline: a backend of the CSVs, default the first one."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if figure not in r:
            raise ValueError(f"--figure {figure}: not a column of the CSV (columns: "
                             f"{', '.join(r)})")
        if r[figure] not in ("", None):
            groups.setdefault((r["backend"], r["concurrency"]), []).append(float(r[figure]))
    backends = list(dict.fromkeys(b for b, _ in groups))
    baseline = baseline or (backends[0] if backends else None)
    if backends and baseline not in backends:
        raise ValueError(f"--baseline {baseline}: no such backend in the CSVs "
                         f"({', '.join(backends)})")
    base = {c: statistics.fmean(v) for (b, c), v in groups.items() if b == baseline}
    out = []
    for (backend, conc), vals in groups.items():
        mean = statistics.fmean(vals)
        vs = mean / base[conc] - 1.0 if backend != baseline and conc in base else None
        out.append({"backend": backend, "concurrency": conc, "servers": len(vals), "mean": mean,
                    "lo": min(vals), "hi": max(vals), "vs_base": vs})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_hisparse.bench.server_spread",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+", help="serving.csv files of bench.serving")
    p.add_argument("--figure", default="tpot_mean_ms",
                   help=f"the column compared (e.g. {', '.join(FIGURES)})")
    p.add_argument("--baseline", help="the backend the others are set against (default: the "
                                      "first in the CSVs)")
    a = p.parse_args(argv)
    try:
        table = spread(read_rows(a.csv), a.figure, a.baseline)
    except (OSError, ValueError) as e:
        print(f"server_spread: {e}", file=sys.stderr)
        return 2
    print(f"{'backend':<12} {'conc':>5} {'servers':>7} {'mean':>10} {'range':>21} {'vs base':>9}")
    for t in table:
        vs = "" if t["vs_base"] is None else f"{100 * t['vs_base']:+.2f}%"
        print(f"{t['backend']:<12} {t['concurrency']:>5} {t['servers']:>7} {t['mean']:>10.4f} "
              f"{t['lo']:>10.4f}-{t['hi']:<10.4f} {vs:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
