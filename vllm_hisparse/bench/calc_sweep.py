"""``hisparse calc`` over a grid of contexts and ``gpu_memory_utilization`` (issue 45): the requests
of each context a GPU holds at once, stock vLLM against hisparse with every pool sized as a server
with no hisparse config sizes it (core/auto_size.py), host-backed requests and the host-less ones
beside them: with the default ``hostless`` "sparse" (each takes a Quest row, and the auto rows
count them: rule 1's L) and with "dense" (no row; calc counts those the KV blocks hold whole
beside the host-backed ones' rows). "wait" admits the host-backed ones only. CSV + plot of
hisparse / stock for the three.

    python -m vllm_hisparse.bench.calc_sweep --model DIR --gpu-gib 80 --weights-gib 15 \\
        --host-ram-gib 120 --out DIR [--contexts 4096,...] [--utils 0.3,...]

The GPU KV of a point is util x --gpu-gib - --weights-gib - --overhead-gib (vLLM's activations and
graphs), the figure a stock server logs as "Available KV cache memory"; every figure is calc's
(bench/calc.py), so the sweep and ``hisparse calc`` cannot disagree.
"""
from __future__ import annotations

import argparse
import csv
import os

from vllm_hisparse.config import HiSparseConfigError

from . import calc, calc_args

FIELDS = ("context", "util", "gpu_kv_gib", "stock", "hisparse", "bound_by", "hostless",
          "hostless_sparse", "ratio_wait", "ratio_sparse", "ratio_dense")


def _calc(argv: list[str]) -> dict:
    """``hisparse calc --json``'s figures for its arguments ``argv``."""
    p = argparse.ArgumentParser()
    calc_args.add_arguments(p)
    return calc.compute(p.parse_args(argv))


def point(model: str, context: int, kv_gib: float, ram_gib: float, seqs: int | None,
          kv_cache_dtype: str = "auto") -> dict:
    """calc's figures for one context at one GPU KV size: stock, host-backed, host-less."""
    argv = ["--model", model, "--context", str(context), "--gpu-kv-gib", f"{kv_gib:.3f}",
            "--host-ram-gib", f"{ram_gib:.3f}", "--kv-cache-dtype", kv_cache_dtype]
    if seqs:
        argv += ["--max-num-seqs", str(seqs)]
    argv += ["--hostless", "dense"]                 # last: point() drops it for "sparse"
    try:
        r = _calc(argv)
    except HiSparseConfigError:     # the server would refuse to start: no request of this context
        return {"context": context, "gpu_kv_gib": round(kv_gib, 3), "stock": stock_only(
            model, context, kv_gib, kv_cache_dtype), "hisparse": 0, "bound_by": "refused",
            "hostless": 0, "hostless_sparse": 0, "ratio_wait": None, "ratio_sparse": None,
            "ratio_dense": None}
    b, h = r["baseline"]["max_requests"], r["hisparse"]
    n, extra = h["max_requests"], h["hostless_requests"]
    hs = _calc(argv[:-2])["hisparse"]               # the default "sparse": rows for host-less too
    sparse = hs["max_requests"] + hs["hostless_requests"]
    return {"context": context, "gpu_kv_gib": round(kv_gib, 3), "stock": b, "hisparse": n,
            "bound_by": h["bound_by"], "hostless": extra,
            "hostless_sparse": sparse - n,
            "ratio_wait": round(n / b, 3) if b else None,
            "ratio_sparse": round(sparse / b, 3) if b else None,
            "ratio_dense": round((n + extra) / b, 3) if b else None}


def stock_only(model: str, context: int, kv_gib: float, kv_cache_dtype: str = "auto") -> int:
    """Stock's requests where hisparse would not start (calc's stock figure, its pools given)."""
    return _calc(["--model", model, "--context", str(context), "--gpu-kv-gib", f"{kv_gib:.3f}",
                  "--host-gib", "1", "--quest-rows", "1", "--dense-pool-gib", "0",
                  "--kv-cache-dtype", kv_cache_dtype]
                 )["baseline"]["max_requests"]


def sweep(a) -> list[dict]:
    rows = []
    for util in a.utils:
        kv = util * a.gpu_gib - a.weights_gib - a.overhead_gib
        for context in a.contexts:
            if kv <= 0:
                continue
            rows.append({"util": util, **point(a.model, context, kv, a.host_ram_gib, a.max_num_seqs,
                                               a.kv_cache_dtype)})
            r = rows[-1]
            print(f"util {util:.2f} context {context:6d}: stock {r['stock']:4d}, hisparse "
                  f"{r['hisparse']:4d} ({r['bound_by']}) + host-less {r['hostless_sparse']:4d} "
                  f"(sparse) / {r['hostless']:4d} (dense)", flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for ax, key, title in ((axes[0], "ratio_wait", 'hostless "wait"'),
                           (axes[1], "ratio_sparse", 'hostless "sparse" (default)'),
                           (axes[2], "ratio_dense", 'hostless "dense"')):
        for util in sorted({r["util"] for r in rows}):
            pts = [(r["context"], r[key]) for r in rows if r["util"] == util and r[key] is not None]
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=f"util {util:g}")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
    axes[0].set_ylabel("requests at once, hisparse / stock")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory or config.json")
    p.add_argument("--gpu-gib", type=float, required=True, help="the GPU's memory, GiB")
    p.add_argument("--weights-gib", type=float, required=True, help="the model's weights, GiB")
    p.add_argument("--overhead-gib", type=float, default=3.0,
                   help="vLLM's activations and graphs (default 3)")
    p.add_argument("--host-ram-gib", type=float, required=True,
                   help="host RAM available at startup (the auto host pool's source)")
    p.add_argument("--contexts", default="4096,8192,16384,32768,65536,131072")
    p.add_argument("--utils", default="0.3,0.5,0.7,0.9")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--kv-cache-dtype", choices=calc_args.KV_CACHE_DTYPES, default="auto",
                   help="vLLM --kv-cache-dtype (fp8: KV at 1 byte, Quest bounds at the model's)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.utils = [float(x) for x in a.utils.split(",")]
    rows = sweep(a)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "calc_sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(a.out, "calc_sweep.png"))
    print(f"wrote {a.out}/calc_sweep.csv and calc_sweep.png ({len(rows)} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
