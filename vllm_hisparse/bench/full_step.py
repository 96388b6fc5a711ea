"""What a FULL-graph decode step (config full_decode_graphs) costs, without vLLM: the fixed body of
every layer (core/full_decode.py) captured into one CUDA graph per batch size, as vLLM captures a
whole step, then replayed after each step's plan_full.

    python -m vllm_hisparse.bench.full_step --context 4096,32768 --rows 1,8 --out DIR

Same model shape and setup as bench/decode_step (Llama-3-8B attention, bf16, random host KV and
Quest bounds, ``--layers`` layers). A context below the config's min_context (2 x B = 8192 by
default) makes every row a dense (resident) request, as 4K requests are when serving; longer ones
are sparse. Per (context, rows): plan_full host ms per step (what the host does before the replay),
GPU ms per layer of the replayed graph (CUDA events, plan excluded), the same batch's FlashAttention
decode alone (what stock vLLM's layer runs), the host syncs plan_full makes (torch's sync debug
mode: none is the goal, a sync stalls asynchronous scheduling), and a per-kernel profile of the
replays (DIR/full-profile-CONTEXT-ROWS.txt). Writes DIR/full_step.csv.
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

from vllm_hisparse.bench.decode_step import (D, HKV, HQ, Setup, add_shape_args, stock_layer_ms,
                                              write_csv)


class FullSetup(Setup):
    """decode_step.Setup with full_decode_graphs: one graph over all layers per batch size."""

    def __init__(self, args, rows: int):
        super().__init__(args, rows)
        if getattr(args, "dense_only", False):       # the vLLM adapter's body (dense rows only)
            if any(self.rt.reqs[i].sparse for i in self.ids):
                raise SystemExit(f"--dense-only needs dense rows: context {args.context} is sparse "
                                 f"(min_context {self.rt.cfg.min_context_tokens}); use a shorter one")
            self.rt.full.dense_only = True
        N, dev = rows, "cuda"
        self.io = [torch.zeros(N, h, D, dtype=torch.bfloat16, device=dev) for h in (HQ, HKV, HKV, HQ)]
        self.rt.full.padding(N)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                              # warm-up: JIT, allocator
            self._layers()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._layers()

    def _layers(self):
        for lay in range(self.L):
            self.rt.full_layer(lay, self.rows, *self.io[:3], self.kv[lay], D ** -0.5, self.io[3])

    def plan(self):
        seq = [self.ctx + self.n + 1] * self.rows
        self.rt.plan_full(self.ids, seq, self.bt, self.rows)
        self.n += 1

    def step(self):
        self.plan()
        self.io[0].normal_(generator=self.g)
        self.io[1].normal_(generator=self.g)
        self.io[2].normal_(generator=self.g)
        self.graph.replay()


def measure(s: FullSetup, steps: int) -> dict:
    for _ in range(10):                                         # warm-up: first misses
        s.step()
    torch.cuda.synchronize()
    plan_s = replay_ms = 0.0
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.plan()
        plan_s += time.perf_counter() - t0
        e0.record()
        s.graph.replay()
        e1.record()
        torch.cuda.synchronize()
        replay_ms += e0.elapsed_time(e1)
    with warnings.catch_warnings(record=True) as w:             # host syncs of one plan_full
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            s.plan()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sorted({str(x.message).splitlines()[0][:120] for x in w})
    return {"plan_ms": round(plan_s * 1e3 / steps, 3),
            "gpu_ms_per_layer": round(replay_ms / steps / s.L, 4), "plan_syncs": len(syncs),
            "sync_kinds": " | ".join(syncs)}


def profile(s: FullSetup, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(4):
            s.step()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(f"4 steps x {s.L} layers, {s.rows} rows, context {s.ctx}\n")
        f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", default="4096,32768")
    ap.add_argument("--rows", default="1,8")
    add_shape_args(ap)
    ap.add_argument("--dense-only", action="store_true",
                    help="the dense-only body the vLLM adapter replays (contexts below min_context)")
    ap.add_argument("--out", default="out/full_step")
    args = ap.parse_args(argv)
    args.full, args.decode_graphs = True, False
    os.makedirs(args.out, exist_ok=True)
    rows_out = []
    for ctx in (int(x) for x in args.context.split(",")):
        for R in (int(x) for x in args.rows.split(",")):
            args.context = ctx
            s = FullSetup(args, R)
            row = {"context": ctx, "rows": R, "split_dense_decode": s.rt.split_dense,
                   "dense_only": s.rt.full.dense_only,
                   "sparse_rows": sum(s.rt.reqs[i].sparse for i in s.ids),
                   **measure(s, args.steps)}
            stock = stock_layer_ms(s)
            row["stock_fa_ms_per_layer"] = None if stock is None else round(stock, 4)
            profile(s, os.path.join(args.out, f"full-profile-{ctx}-{R}.txt"))
            rows_out.append(row)
            print(row, flush=True)
            del s
            torch.cuda.empty_cache()
    write_csv(os.path.join(args.out, "full_step.csv"), rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
