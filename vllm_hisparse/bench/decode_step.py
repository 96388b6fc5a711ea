"""Where a hisparse decode step's time goes, without vLLM: the serving runtime (plan + every layer's
write, Quest update/score/top-k, RESOLVE, sparse attention) on the GPU at a given context and batch,
against FlashAttention's paged decode over the full context (what stock vLLM runs per layer).

    python -m vllm_hisparse.bench.decode_step --context 32768 --rows 1,8,32 --out DIR

Llama-3-8B's attention shape (32 query / 8 KV heads, D=128, bf16). Only ``--layers`` layers are
built (the host pool holds rows x context x layers tokens of pinned memory); every figure is per
layer, so a 32-layer model's attention costs 32x. Requests start "after prefill": random host KV
and random Quest bounds, empty hot buffers. ``--q-noise`` sets how much each step's queries move
around a fixed per-layer query (0: the same pages every step -> ~0% misses once warm; 1: fresh
random queries -> close to the worst case). Wall = CPU + GPU per step, synchronised at the end of a
step (the runtime is eager: its CPU launch time is part of the cost); GPU = CUDA events.
Writes DIR/decode_step.csv and DIR/profile-R.txt (torch profiler, top CUDA and CPU ops).
"""
from __future__ import annotations

import argparse
import csv
import os
import time

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.sparse_runtime import SparseRuntime

HQ, HKV, D, P = 32, 8, 128, 16


def dense_fn_or_none():
    try:
        from vllm_hisparse.vllm.flash_dense import make_dense_fn
        return make_dense_fn(torch.bfloat16, D)
    except Exception as e:  # noqa: BLE001 - no vLLM here: report and run without the baseline
        print(f"no FlashAttention ({type(e).__name__}: {e}); stock baseline skipped")
        return None


class Setup:
    def __init__(self, args, rows: int):
        dev = torch.device("cuda")
        self.rows, self.ctx, self.L = rows, args.context, args.layers
        cfg = HiSparseConfig(top_k=args.top_k, device_buffer_size=args.buffer, page_size=P,
                             dense_layers=(), host_pool_gib=1, io_chunk_bytes=args.io_chunk_bytes,
                             decode_graphs=args.decode_graphs,
                             full_decode_graphs=getattr(args, "full", False),
                             split_dense_decode={"on": True, "off": False}.get(
                                 args.split_dense_decode))
        self.S = cfg.num_slots
        max_len = args.context + args.steps + 64
        self.U = -(-max_len // P)
        self.rt = SparseRuntime(cfg, self.L, HKV, D, torch.bfloat16, dev, rows, max_len,
                                host_pages=rows * self.U, num_heads=HQ)
        fa = dense_fn_or_none()
        if fa is not None:
            self.rt.dense_fn = fa
        self.fa = fa
        g = torch.Generator(device=dev).manual_seed(0)
        tile = torch.randn(4096, HKV, D, device=dev, generator=g).to(torch.bfloat16).cpu()
        flat = self.rt.pool.data.view(-1, HKV, D)
        for i in range(0, flat.shape[0], tile.shape[0]):         # random-looking host KV
            n = min(tile.shape[0], flat.shape[0] - i)
            flat[i:i + n] = tile[:n]
        for lay in range(self.L):
            self.rt.kmin[lay].normal_(generator=g)
            self.rt.kmax[lay].copy_(self.rt.kmin[lay] + torch.rand(self.rt.kmin[lay].shape, device=dev,
                                                                   generator=g).to(torch.bfloat16))
        self.ids = [f"r{i}" for i in range(rows)]
        for rid in self.ids:
            self.rt.add(rid, args.context)
        per = self.S + 2                      # hot slots + two blocks taking turns as newest page
        self.kv = [torch.randn(1 + rows * per, 2, P, HKV, D, device=dev, generator=g).to(torch.bfloat16)
                   for _ in range(self.L)]                 # block 0: vLLM's null block
        u = torch.arange(self.U, device=dev)
        col = torch.where(u < self.S, u, self.S + u % 2)
        self.bt = (1 + torch.arange(rows, device=dev)[:, None] * per + col[None]).to(torch.int32)
        self.q_base = [torch.randn(rows, HQ, D, device=dev, generator=g) for _ in range(self.L)]
        self.g, self.noise, self.n = g, args.q_noise, 0

    def step(self):
        seq = [self.ctx + self.n + 1] * self.rows
        qsl = list(range(self.rows + 1))
        pos = torch.tensor(seq, device="cuda") - 1
        slots = torch.gather(self.bt, 1, (pos // P)[:, None])[:, 0].long() * P + pos % P
        plan = self.rt.plan(self.ids, qsl, seq, self.bt, slots)
        for lay in range(self.L):
            q = (self.q_base[lay] + self.noise * torch.randn(self.q_base[lay].shape, device="cuda",
                                                             generator=self.g)).to(torch.bfloat16)
            k = torch.randn(self.rows, HKV, D, device="cuda", generator=self.g).to(torch.bfloat16)
            out = torch.empty_like(q)
            self.rt.forward_layer(lay, plan, q, k, k, self.kv[lay], D ** -0.5, out)
        self.n += 1


def time_steps(s: Setup, n: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        s.step()
    e1.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n, e0.elapsed_time(e1) / n


def stock_layer_ms(s: Setup, reps: int = 20) -> float | None:
    """FlashAttention paged decode of the same batch over the full context (one layer)."""
    if s.fa is None:
        return None
    pages = -(-s.ctx // P)
    kv = torch.zeros(s.rows * pages, 2, P, HKV, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(s.rows * pages, device="cuda", dtype=torch.int32).view(s.rows, pages)
    q = torch.randn(s.rows, HQ, D, device="cuda").to(torch.bfloat16)
    cu = torch.arange(s.rows + 1, device="cuda", dtype=torch.int32)
    seq = torch.full((s.rows,), s.ctx, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    call = lambda: s.fa(q, kv[:, 0], kv[:, 1], bt, cu, seq, 1, s.ctx, D ** -0.5, out)  # noqa: E731
    call()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        call()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


def breakdown(s: Setup, n: int) -> dict:
    """ms per step of each runtime piece, each one synchronised before and after (serialises the
    step: the sum is an upper bound of the free-running step, the split says where time goes)."""
    from vllm_hisparse.core import sparse_layer as sl
    from vllm_hisparse.core import sparse_runtime as srt

    acc: dict[str, float] = {}

    def wrap(mod, name, label):
        fn = getattr(mod, name)

        def timed(*a, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn(*a, **kw)
            torch.cuda.synchronize()
            acc[label] = acc.get(label, 0.0) + (time.perf_counter() - t0) * 1e3
            return r
        setattr(mod, name, timed)
        return fn

    pieces = [(sl, "write_kv", "write_kv"), (srt, "write_through", "write_through"),
              (sl, "quest_update_pages", "quest_update"), (sl, "quest_topk_locs", "quest_score_topk"),
              (sl, "resolve_hot_into", "resolve"), (sl, "sparse_decode", "sparse_attention"),
              (s.rt, "plan", "plan"), (s.rt, "forward_layer", "layer_total")]
    orig = [(m, name, wrap(m, name, label)) for m, name, label in pieces]
    try:
        for _ in range(n):
            s.step()
    finally:
        for m, name, fn in orig:
            if m is s.rt:
                delattr(m, name)
            else:
                setattr(m, name, fn)
    return {k: round(v / n, 3) for k, v in acc.items()}


def sync_points(s: Setup) -> list[str]:
    """Ops of one step that synchronise with the host (torch's sync debug mode)."""
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            s.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({str(x.message).splitlines()[0][:160] for x in w})


def profile(s: Setup, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(2):
            s.step()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        f.write("\n\n")
        f.write(p.key_averages().table(sort_by="cpu_time_total", row_limit=25))


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The model/runtime shape flags shared with bench/full_step."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--buffer", type=int, default=4096)
    ap.add_argument("--io-chunk-bytes", type=int, default=64)
    ap.add_argument("--q-noise", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--split-dense-decode", choices=("default", "on", "off"), default="default",
                    help="config split_dense_decode: one-token dense rows through the split-KV "
                         "decode kernel (default: the config's default, on for this shape)")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rows", default="1,8,32")
    add_shape_args(ap)
    ap.add_argument("--decode-graphs", action="store_true",
                    help="config decode_graphs: replay each layer from a CUDA graph")
    ap.add_argument("--quest-tile-elems", type=int, default=None,
                    help="tuning: override ops/triton_quest.TILE_ELEMS (pages x D per program)")
    ap.add_argument("--min-split-tokens", type=int, default=None,
                    help="tuning: override ops/triton_attention.MIN_SPLIT_TOKENS")
    ap.add_argument("--out", default="out/decode_step")
    args = ap.parse_args(argv)
    if args.quest_tile_elems is not None:
        from vllm_hisparse.ops import triton_quest
        triton_quest.TILE_ELEMS = args.quest_tile_elems
    if args.min_split_tokens is not None:
        from vllm_hisparse.ops import triton_attention
        triton_attention.MIN_SPLIT_TOKENS = args.min_split_tokens
    os.makedirs(args.out, exist_ok=True)
    rows_out = []
    for R in (int(x) for x in args.rows.split(",")):
        s = Setup(args, R)
        time_steps(s, 20)                                # warm-up: JIT, first misses
        before = s.rt.stats_dict()
        wall, gpu = time_steps(s, args.steps)
        after = s.rt.stats_dict()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        profile(s, os.path.join(args.out, f"profile-{R}.txt"))
        # the per-piece breakdown synchronises inside the pieces: not with graphs (capture)
        parts = {} if args.decode_graphs else breakdown(s, 5)
        syncs = sync_points(s)
        with open(os.path.join(args.out, f"breakdown-{R}.txt"), "w") as f:
            f.write(f"ms per step ({args.layers} layers), each piece synchronised:\n")
            for k, v in parts.items():
                f.write(f"  {k:18s} {v:9.3f}\n")
            f.write("host syncs in one free-running step:\n" + "\n".join(syncs) + "\n")
        print(parts, f"{len(syncs)} sync kinds", flush=True)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            s.rt.plan(s.ids, list(range(R + 1)), [s.ctx + s.n + 1] * R, s.bt,
                      torch.zeros(R, dtype=torch.int64, device="cuda"))
        torch.cuda.synchronize()
        plan_ms = (time.perf_counter() - t0) * 1e3 / args.steps
        stock = stock_layer_ms(s)
        row = {"context": args.context, "rows": R, "top_k": args.top_k, "buffer": args.buffer,
               "decode_graphs": args.decode_graphs, "split_dense_decode": s.rt.split_dense,
               "io_chunk_bytes": args.io_chunk_bytes,
               "quest_tile_elems": args.quest_tile_elems, "min_split_tokens": args.min_split_tokens,
               "q_noise": args.q_noise, "miss_rate": round(misses / max(hits + misses, 1), 4),
               "plan_ms": round(plan_ms, 3),
               "wall_ms_per_layer": round((wall - plan_ms) / args.layers, 3),
               "gpu_ms_per_layer": round(gpu / args.layers, 3),
               "stock_fa_ms_per_layer": None if stock is None else round(stock, 3)}
        rows_out.append(row)
        print(row, flush=True)
        del s
        torch.cuda.empty_cache()
    write_csv(os.path.join(args.out, "decode_step.csv"), rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
