"""Tables and the plot of the quality benchmark (rows as bench/quality.py's score_text makes them).

aggregate(rows)  one dict per (context, top_k): means over texts (perplexity from the mean NLL)
recommend(agg)   per context, the smallest top_k whose perplexity is within a bound of dense
markdown(rows)   the table of docs/quality.md
plot(rows, path) quality vs top_k: perplexity increase, attention recall, top-1 agreement
"""
from __future__ import annotations

import math
from collections import defaultdict

MAX_PPL_PCT = 1.0    # the recommendation's bar: perplexity at most 1% above dense (a judgement call)
LOOSE_PPL_PCT = 5.0  # a looser bar, for deployments trading quality for memory


def _mean(xs):
    xs = [x for x in xs if x is not None and x != ""]
    return sum(xs) / len(xs) if xs else None


def aggregate(rows) -> list[dict]:
    groups = defaultdict(list)
    for r in rows:
        groups[(int(r["context"]), int(r["top_k"]))].append(r)
    dense = {c: _mean([r["nll"] for r in g]) for (c, k), g in groups.items() if k == 0}
    out = []
    for (c, k), g in sorted(groups.items()):
        if k == 0:
            continue
        d_nll = _mean([r.get("d_nll") for r in g])
        out.append({
            "context": c, "top_k": k, "texts": len(g),
            "ppl_dense": math.exp(dense[c]) if c in dense else None,
            "ppl": math.exp(_mean([r["nll"] for r in g])),
            "ppl_pct": None if d_nll is None else 100.0 * (math.exp(d_nll) - 1.0),
            "ppl_pct_worst": max((100.0 * (math.exp(r["d_nll"]) - 1.0) for r in g
                                  if r.get("d_nll") is not None), default=None),
            "kl": _mean([r.get("kl") for r in g]), "top1": _mean([r.get("top1") for r in g]),
            "recall": _mean([r.get("recall") for r in g]),
            "recall_min_layer": _mean([r.get("recall_min_layer") for r in g]),
            "overlap": _mean([r.get("overlap") for r in g]), "oracle": _mean([r.get("oracle") for r in g]),
        })
    return out


def recommend(agg, max_ppl_pct: float = MAX_PPL_PCT) -> dict[int, int | None]:
    """context -> smallest top_k with perplexity <= max_ppl_pct above dense (None: none tested)."""
    best: dict[int, int | None] = {}
    for a in agg:
        best.setdefault(a["context"], None)
        ok = a["ppl_pct"] is not None and a["ppl_pct"] <= max_ppl_pct
        if ok and (best[a["context"]] is None or a["top_k"] < best[a["context"]]):
            best[a["context"]] = a["top_k"]
    return best


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def markdown(rows, command: str = "", seconds: float | None = None, model: str = "SmolLM2-135M") -> str:
    agg = aggregate(rows)
    texts = sorted({r["text"] for r in rows})
    steps = sorted({int(r["steps"]) for r in rows})
    lines = []
    if command:
        lines += ["```", command, "```", ""]
    lines += [f"Model: {model}. Texts: {', '.join(texts)}; {'/'.join(map(str, steps))} scored decode "
              f"steps per text and context; means over texts"
              + (f"; {seconds / 60:.1f} min" if seconds is not None else "") + ".", "",
              "| context | top_k | share of context | ppl dense | ppl Quest | ppl increase | "
              "worst text | KL (nats) | top-1 = dense | attention recall | worst layer | "
              "top-k overlap | exact top-k mass |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in agg:
        lines.append(
            f"| {a['context']} | {a['top_k']} | {100 * a['top_k'] / a['context']:.0f}% | "
            f"{_f(a['ppl_dense'], '.3f')} | {_f(a['ppl'], '.3f')} | {_f(a['ppl_pct'], '+.2f')}% | "
            f"{_f(a['ppl_pct_worst'], '+.1f')}% | "
            f"{_f(a['kl'], '.4f')} | {_f(None if a['top1'] is None else 100 * a['top1'], '.1f')}% | "
            f"{_f(a['recall'], '.3f')} | {_f(a['recall_min_layer'], '.3f')} | "
            f"{_f(a['overlap'], '.3f')} | {_f(a['oracle'], '.3f')} |")
    lines.append("")
    for bar in (MAX_PPL_PCT, LOOSE_PPL_PCT):
        rec = recommend(agg, bar)
        lines.append(f"Smallest top_k within {bar:g}% of dense perplexity: " + ", ".join(
            f"context {c}: {k if k is not None else 'none tested'}" for c, k in sorted(rec.items())) + ".")
    return "\n".join(lines) + "\n"


def plot(rows, path: str, model: str = "SmolLM2-135M") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(rows)
    contexts = sorted({a["context"] for a in agg})
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for c in contexts:
        pts = [a for a in agg if a["context"] == c]
        ks = [a["top_k"] for a in pts]
        line, = axes[0].plot(ks, [a["ppl_pct"] for a in pts], "o-", label=f"context {c}")
        axes[1].plot(ks, [a["recall"] for a in pts], "o-", color=line.get_color(), label=f"Quest, {c}")
        axes[1].plot(ks, [a["oracle"] for a in pts], "x--", color=line.get_color(), alpha=0.6,
                     label=f"exact top-k, {c}")
        axes[2].plot(ks, [100 * a["top1"] for a in pts], "o-", color=line.get_color(), label=f"context {c}")
    titles = ("perplexity increase over dense (%)", "attention mass kept (sparse layers)",
              "greedy token = dense (%)")
    ks = sorted({a["top_k"] for a in agg})
    for ax, t in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("top_k (tokens)")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("symlog", linthresh=1.0)      # linear below 1%, log above
    ticks = [0, 1, 2, 5, 10, 20, 50, 100, 200]
    axes[0].set_yticks(ticks, [str(t) for t in ticks])
    axes[0].set_ylim(-0.5, None)
    axes[0].axhline(MAX_PPL_PCT, color="grey", lw=0.8, ls=":")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7)
    page = next((r["page_size"] for r in rows if r.get("page_size")), "?")
    fig.suptitle(f"{model}, teacher-forced on real text: Quest (page {page}) vs dense attention",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def load_csv(path: str) -> list[dict]:
    """bench/quality.py's quality.csv back as rows (numbers as numbers, empty cells None)."""
    import csv

    def num(v):
        if v == "":
            return None
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v
    return [{k: num(v) for k, v in r.items()} for r in csv.DictReader(open(path))]


def main(argv=None) -> int:
    """python -m vllm_hisparse.bench.quality_report OUT [MODEL]: OUT/quality.png and the table
    from OUT/quality.csv (where the run had no matplotlib)."""
    import os
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        raise SystemExit("usage: python -m vllm_hisparse.bench.quality_report OUT [MODEL]")
    rows = load_csv(os.path.join(argv[0], "quality.csv"))
    model = argv[1] if len(argv) > 1 else "model"
    print(markdown(rows, model=model))
    print("wrote", plot(rows, os.path.join(argv[0], "quality.png"), model=model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
