"""PNG plots of a simulation (matplotlib, Agg backend, imported only when plotting).

miss_per_step.png  miss rate per decode step, one line per policy, one panel per (k, B) of the
                   first trace (like the paper's replay figure), write-allocate as simulated first.
miss_vs_buffer.png steady miss rate vs B/k per policy, one panel per k, mean over traces.
"""
from __future__ import annotations

import os

import numpy as np


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_per_step(per_step: list[dict], path: str, smooth: int = 8) -> str:
    plt = _plt()
    if not per_step:
        return ""
    trace = per_step[0]["trace"]
    wa = per_step[0]["write_allocate"]
    rows = [r for r in per_step if r["trace"] == trace and r["write_allocate"] == wa]
    panels = sorted({(r["k"], r["buffer"]) for r in rows})
    policies = sorted({r["policy"] for r in rows})
    n = len(panels)
    cols = min(n, 3)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(5 * cols, 3.4 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, (k, b) in zip(axes.ravel(), panels):
        for p in policies:
            ys = np.array([r["miss_rate"] for r in rows if (r["k"], r["buffer"], r["policy"]) == (k, b, p)])
            if smooth > 1 and len(ys) > smooth:
                ys = np.convolve(ys, np.ones(smooth) / smooth, mode="valid")
            ax.plot(100 * ys, label=p, lw=1.2)
        ax.set_title(f"k={k}, B={b} ({b // k}k)", fontsize=9)
        ax.set_xlabel("decode step")
        ax.set_ylabel("miss rate %")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{trace}: miss rate per step (write-allocate {wa}, {smooth}-step mean)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path


def plot_vs_buffer(rows: list[dict], path: str) -> str:
    plt = _plt()
    rows = [r for r in rows if r["layer"] == "all"]
    if not rows:
        return ""
    wa = rows[0]["write_allocate"]
    rows = [r for r in rows if r["write_allocate"] == wa]
    ks = sorted({r["k"] for r in rows})
    policies = sorted({r["policy"] for r in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(max(6.5, 4.5 * len(ks)), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for p in policies:
            pts = {}
            for r in rows:
                if r["k"] == k and r["policy"] == p:
                    pts.setdefault(r["buffer_x_k"], []).append(r["steady_miss_rate"])
            xs = sorted(pts)
            ax.plot(xs, [100 * np.mean(pts[x]) for x in xs], marker="o", label=p)
        ax.set_title(f"k={k}", fontsize=9)
        ax.set_xlabel("B / k")
        ax.set_ylabel("steady miss rate %")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"miss rate vs buffer size (write-allocate {wa}, mean over traces)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path


def plot_all(out_dir: str, rows: list[dict], per_step: list[dict]) -> list[str]:
    """The plots are of buffer sizes: only the runs without a window or lookahead (or the
    smallest ones)."""
    w = min((r.get("window", 0) for r in rows), default=0)
    la = min((r.get("lookahead", 0) for r in rows), default=0)
    rows = [r for r in rows if r.get("window", 0) == w and r.get("lookahead", 0) == la]
    per_step = [r for r in per_step if r.get("window", 0) == w and r.get("lookahead", 0) == la]
    return [p for p in (plot_per_step(per_step, os.path.join(out_dir, "miss_per_step.png")),
                        plot_vs_buffer(rows, os.path.join(out_dir, "miss_vs_buffer.png"))) if p]
