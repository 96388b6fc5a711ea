"""Kernel benchmarks on the GPU box: RESOLVE latency and miss IO, sparse attention, host baseline.

    python -m vllm_hisparse.bench.kernels [--quick] --out DIR

Every resolve figure is one step of a steady-state episode (each step keeps (1 - miss) of the
previous selection, so hits, and brings miss * k never-seen units, so misses), several steps
captured in one CUDA graph, state restored before each timed replay, median of the replays.
Miss IO GB/s = missed bytes / whole resolve time (plan + IO), against the contiguous pinned H2D
copy measured in the same run. The host-side baseline gathers the same rows on the CPU into a pinned
staging tensor, copies it and scatters it on the GPU. Attention = the Triton sparse decode attention
of the same layer (GQA 32/8 heads, D=128, bf16, 1-token units: 4 KB rows) over the same selection.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import time

import torch

from vllm_hisparse.ops import kernels

HQ, HKV, D = 32, 8, 128            # the GQA layer whose rows are 4 KB (K and V, bf16, one token)
STEPS = 6
HOST_POOL_BYTES = 512 << 20        # one pinned pool reused by every case (pinning is slow)
_pool: torch.Tensor | None = None


def host_pool() -> torch.Tensor:
    global _pool
    if _pool is None:
        _pool = torch.empty(HOST_POOL_BYTES, dtype=torch.uint8).pin_memory()
        _pool.view(torch.int64).copy_(torch.arange(HOST_POOL_BYTES // 8) * 0x9E3779B97F4A7C15)
    return _pool


def _median_ms(fn, reps=7, setup=None):
    ts = []
    for _ in range(reps):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def h2d_ceiling_gbps(nbytes=256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    ms = _median_ms(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / ms / 1e6


class ResolveCase:
    """A steady-state episode for (batch, k, S, miss, row_bytes), captured as one CUDA graph."""

    def __init__(self, batch, k, S, miss, row_bytes, io_chunk=64):
        dev = "cuda"
        self.batch, self.k, self.S, self.miss, self.row_bytes = batch, k, S, miss, row_bytes
        self.nm = int(round(miss * k))
        U = k + STEPS * self.nm + 1
        P = min(U * batch, HOST_POOL_BYTES // row_bytes)
        self.host = host_pool()[: P * row_bytes].view(P, row_bytes)
        self.hpt = torch.randint(0, P, (batch, U), dtype=torch.int32, device=dev)
        self.buf = torch.randint(0, 255, (batch * S, row_bytes), dtype=torch.uint8, device=dev)
        self.su = torch.full((batch, S), -1, dtype=torch.int32, device=dev)
        self.us = torch.full((batch, U), -1, dtype=torch.int32, device=dev)
        self.lo = torch.arange(S, dtype=torch.int32, device=dev).repeat(batch, 1)
        self.sm = torch.arange(batch * S, dtype=torch.int32, device=dev).view(batch, S)
        self.dl = torch.empty(batch, k, dtype=torch.int32, device=dev)
        sels = [torch.arange(k, device=dev).repeat(batch, 1)]
        fresh = k
        for _ in range(STEPS):
            keep_idx = torch.rand(batch, k, device=dev).argsort(1)[:, : k - self.nm]
            kept = torch.gather(sels[-1], 1, keep_idx)
            new = torch.arange(fresh, fresh + self.nm, device=dev).repeat(batch, 1)
            fresh += self.nm
            s = torch.cat([kept, new], 1)
            sels.append(torch.gather(s, 1, torch.rand(batch, k, device=dev).argsort(1)))
        self.sels = [s.int().contiguous() for s in sels]
        self.io_chunk = io_chunk
        self._run(self.sels[0])                               # warm: fill the buffer
        self.snap = [t.clone() for t in (self.su, self.us, self.lo)]
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for s in self.sels[1:]:
                self._run(s)
        self.graph = g

    def _run(self, sel):
        kernels.resolve_lru(sel, self.su, self.us, self.lo, self.sm, self.buf, self.host, self.hpt,
                            self.dl, self.io_chunk)

    def restore(self):
        for t, s in zip((self.su, self.us, self.lo), self.snap):
            t.copy_(s)

    def time_us(self) -> float:
        return _median_ms(self.graph.replay, reps=5, setup=self.restore) * 1e3 / STEPS

    def miss_bytes(self) -> int:
        return self.batch * self.nm * self.row_bytes

    def host_baseline_gbps(self) -> float:
        """CPU gather of the same number of rows into pinned staging, H2D, GPU scatter."""
        n = self.batch * self.nm
        if n == 0:
            return float("nan")
        src = torch.randint(0, self.host.shape[0], (n,))
        dst = torch.randperm(self.buf.shape[0], device="cuda")[:n]
        stage = torch.empty(n, self.row_bytes, dtype=torch.uint8).pin_memory()
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.index_select(self.host, 0, src, out=stage)
            self.buf.index_copy_(0, dst, stage.to("cuda", non_blocking=True))
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return n * self.row_bytes / statistics.median(ts) / 1e9

    def free(self):
        del self.graph, self.host, self.buf


def attention_us(case: ResolveCase) -> float:
    """Sparse attention of the layer over the case's last selection (4 KB rows = K,V of 8x128 bf16)."""
    assert case.row_bytes == 2 * HKV * D * 2
    kv = case.buf.view(torch.bfloat16).view(-1, 2, 1, HKV, D)
    q = torch.randn(case.batch, HQ, D, device="cuda").to(torch.bfloat16)
    units = case.sels[-1]
    seq = torch.full((case.batch,), 1 << 30, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    locs = case.dl.clone()
    run = lambda: kernels.sparse_decode_attention(q, kv, locs, units, seq, D ** -0.5, out=out)  # noqa: E731
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(STEPS):
            run()
    return _median_ms(g.replay, reps=5) * 1e3 / STEPS


def sweeps(quick: bool):
    """(sweep, batch, k, S, miss, row_bytes, io_chunk, with_attention)"""
    rows = []
    for b in ([1, 8, 32, 64, 128, 256]):
        for miss in (0.0, 0.05):
            rows.append(("batch", b, 2048, 4096, miss, 4096, 64, True))
    for k in ([512, 1024, 2048, 4096]):
        rows.append(("k", 32, k, 2 * k, 0.0, 4096, 64, True))
    for S in ([2048, 4096, 8192]):
        rows.append(("B", 32, 2048, S, 0.1, 4096, 64, True))
    for miss in ([0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0] if not quick else [0.0, 0.01, 0.1, 0.5, 1.0]):
        rows.append(("miss", 32, 2048, 4096, miss, 4096, 64, True))
    for rb in (256, 512, 1152, 4096, 16384, 65536):
        batch = max(1, min(64, (256 << 20) // (2048 * rb)))
        chunks = [16, 64, 128, 256] if rb <= 4096 else [64]
        if not quick:
            chunks = [16, 32, 64, 128, 256]
        for c in chunks:
            rows.append(("row", batch, 2048, 2048, 1.0, rb, c, False))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer points (one device call)")
    ap.add_argument("--out", default="bench-out", help="folder for kernels.csv / kernels.png")
    ap.add_argument("--only", default="", help="comma-separated sweeps to run (batch,k,B,miss,row)")
    ap.add_argument("--tag", default="kernels", help="file name stem of the CSV / PNG")
    a = ap.parse_args(argv)
    assert torch.cuda.is_available() and kernels.available(), kernels.import_error()
    os.makedirs(a.out, exist_ok=True)
    ceil = h2d_ceiling_gbps()
    print(f"contiguous pinned H2D ceiling: {ceil:.1f} GB/s  ({torch.cuda.get_device_name()})", flush=True)
    fields = ["sweep", "batch", "k", "S", "miss", "row_bytes", "io_chunk", "resolve_us", "miss_MB",
              "io_GBps", "pct_ceiling", "host_GBps", "attn_us", "resolve_pct_attn"]
    results = []
    only = set(filter(None, a.only.split(",")))
    for sw, b, k, S, miss, rb, chunk, att in sweeps(a.quick):
        if only and sw not in only:
            continue
        c = ResolveCase(b, k, S, miss, rb, chunk)
        t = c.time_us()
        mb = c.miss_bytes()
        gbps = mb / t / 1e3 if mb else float("nan")
        host = c.host_baseline_gbps() if sw in ("row", "miss") else float("nan")
        at = attention_us(c) if att else float("nan")
        r = dict(sweep=sw, batch=b, k=k, S=S, miss=miss, row_bytes=rb, io_chunk=chunk, resolve_us=t,
                 miss_MB=mb / 1e6, io_GBps=gbps, pct_ceiling=100 * gbps / ceil, host_GBps=host,
                 attn_us=at, resolve_pct_attn=100 * t / at if att else float("nan"))
        results.append(r)
        print(" ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()),
              flush=True)
        c.free()
        del c
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, f"{a.tag}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(results)
    _plot(results, ceil, os.path.join(a.out, f"{a.tag}.png"))
    _table(results, ceil)


def _plot(results, ceil, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in results if r["sweep"] == "row"]
    if rows:
        for chunk in sorted({r["io_chunk"] for r in rows}):
            pts = [r for r in rows if r["io_chunk"] == chunk]
            ax[0].plot([r["row_bytes"] for r in pts], [r["io_GBps"] for r in pts], "o-",
                       label=f"resolve, {chunk} B/thread")
        best = {r["row_bytes"]: r["host_GBps"] for r in rows if not math.isnan(r["host_GBps"])}
        ax[0].plot(list(best), list(best.values()), "s--", label="host gather + copy")
        ax[0].axhline(ceil, color="k", lw=0.8, label="contiguous H2D")
        ax[0].set(xscale="log", xlabel="row bytes", ylabel="GB/s", title="miss IO at 100% miss")
        ax[0].legend(fontsize=7)
    batch = [r for r in results if r["sweep"] == "batch"]
    if batch:
        for miss in sorted({r["miss"] for r in batch}):
            pts = [r for r in batch if r["miss"] == miss]
            ax[1].plot([r["batch"] for r in pts], [r["resolve_pct_attn"] for r in pts], "o-",
                       label=f"miss {miss:.0%}")
        ax[1].axhline(5, color="k", lw=0.8, label="5% bar")
        ax[1].set(xscale="log", yscale="log", xlabel="batch", ylabel="resolve / attention (%)",
                  title="k=2048, B=4096, 4 KB rows")
        ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(results, ceil):
    print(f"\n== summary (H2D ceiling {ceil:.1f} GB/s) ==")
    print("sweep  batch     k     S  miss  row_B chunk  resolve_us   io_GB/s  %ceil  host_GB/s  attn_us  res%attn")
    for r in results:
        print(f"{r['sweep']:<6}{r['batch']:>6}{r['k']:>6}{r['S']:>6}{r['miss']:>6.2f}{r['row_bytes']:>7}"
              f"{r['io_chunk']:>6}{r['resolve_us']:>12.1f}{r['io_GBps']:>10.1f}{r['pct_ceiling']:>7.1f}"
              f"{r['host_GBps']:>11.1f}{r['attn_us']:>9.1f}{r['resolve_pct_attn']:>10.1f}")


if __name__ == "__main__":
    main()
