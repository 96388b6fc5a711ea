"""What a decode step costs per layer, without vLLM: the decode batch's body (core/decode_body.py) of
``--layers`` layers recorded into one CUDA graph per batch size, as vLLM's FULL graphs record a
whole step, and replayed after each step's ``plan_full``; against stock vLLM's layer
(FlashAttention's paged decode over the whole context, split-KV chosen by FlashAttention).

    python -m vllm_hisparse.bench.decode_step --context 4096,32768 --rows 1,8,32 --out DIR

Llama-3-8B's attention shape (32 query / 8 KV heads, D=128, bf16); the sparse layers of a 32-layer
model cost 30x the per-layer figure. Requests start "after prefill": random host KV and Quest
bounds, hot slots seeded with pages [0, S) (core/hot_rows.py; their blocks hold random KV). A
context below min_context (2 x B = 8192 by default) makes every row a dense (resident) request,
as 4K requests are when serving; longer contexts are sparse rows.
``--q-noise`` sets how far each step's queries move around a fixed per-layer query (0: the same
pages every step, ~0% misses once warm; 1: fresh random queries). Per (context, rows): plan_full's
host ms per step, GPU us per layer of the replay (CUDA events, plan excluded; ``--eager``: the
body run eagerly instead, wall time per layer), miss rate, the host syncs of one plan (torch's sync
debug mode: a sync stalls vLLM's asynchronous scheduling), stock FlashAttention us per layer, and
a per-kernel profile of the replays (DIR/profile-CONTEXT-ROWS.txt). Writes DIR/decode_step.csv.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
import warnings

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.sparse_runtime import SparseRuntime

HQ, HKV, D, P = 32, 8, 128, 16


class Setup:
    def __init__(self, args, rows: int, ctx: int):
        dev = torch.device("cuda")
        self.rows, self.ctx, self.L = rows, ctx, args.layers
        max_len = ctx + args.steps * 3 + 64
        # --dense-layers N: layers 0..N-1 attend every page, as a model's dense_layers (with the
        # host tier, from a GPU dense pool sized for these rows, as serving runs them)
        nd = args.dense_layers
        pool_gib = (rows * -(-max_len // P) * nd * 2 * P * HKV * D * 2 / 2**30 * 1.05
                    if nd and not args.resident else 0.0)
        cfg = HiSparseConfig(top_k=args.top_k, device_buffer_size=args.buffer, page_size=P,
                             dense_layers=tuple(range(nd)), dense_pool_gib=pool_gib,
                             host_pool_gib=1, host_tier=not args.resident,
                             resident_first=args.resident_first)
        self.S = cfg.num_slots
        self.U = -(-max_len // P)
        self.rt = SparseRuntime(cfg, self.L, HKV, D, torch.bfloat16, dev, rows, max_len,
                                host_pages=rows * self.U if not args.resident else None)
        g = torch.Generator(device=dev).manual_seed(0)
        if self.rt.pool is not None:
            tile = torch.randn(4096, HKV, D, device=dev, generator=g).to(torch.bfloat16).cpu()
            flat = self.rt.pool.data.view(-1, HKV, D)
            for i in range(0, flat.shape[0], tile.shape[0]):     # random-looking host KV
                n = min(tile.shape[0], flat.shape[0] - i)
                flat[i:i + n] = tile[:n]
        for lay in range(self.L):
            if self.rt.ix.kmin[lay] is None:             # a dense layer keeps no page bounds
                continue
            self.rt.ix.kmin[lay].normal_(generator=g)
            self.rt.ix.kmax[lay].copy_(self.rt.ix.kmin[lay] + torch.rand(
                self.rt.ix.kmin[lay].shape, device=dev, generator=g).to(torch.bfloat16))
        self.ids = [f"r{i}" for i in range(rows)]
        for rid in self.ids:
            self.rt.add(rid, ctx)
        sparse = self.rt.reqs[self.ids[0]].sparse
        # hisparse rows keep S hot slots + two blocks taking turns as the newest page; resident
        # and dense rows keep every page
        per = self.S + 2 if sparse and not args.resident else self.U
        self.kv = [torch.randn(1 + rows * per, 2, P, HKV, D, device=dev, generator=g)
                   .to(torch.bfloat16) for _ in range(self.L)]    # block 0: vLLM's null block
        self.rt.bind_kv_caches(self.kv)      # a dense row reaching min_context copies from them
        u = torch.arange(self.U, device=dev)
        col = torch.where(u < self.S, u, self.S + u % 2) if per != self.U else u
        self.bt = (1 + torch.arange(rows, device=dev)[:, None] * per + col[None]).to(torch.int32)
        self.q_base = torch.randn(rows, HQ, D, device=dev, generator=g)
        self.io = [torch.zeros(rows, h, D, dtype=torch.bfloat16, device=dev)
                   for h in (HQ, HKV, HKV, HQ)]
        self.g, self.noise, self.n = g, args.q_noise, 0
        self.no_write_through = args.no_write_through
        self.graph = None

    def layers(self):
        q, k, v, out = self.io
        for lay in range(self.L):
            self.rt.full_layer(lay, self.rows, q, k, v, self.kv[lay], self.bt, D ** -0.5, out)

    def capture(self):
        """One graph over every layer, recorded on an all-padding batch as vLLM records its own."""
        self.rt.plan_full([], [], self.rows)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                      # warm-up: Triton JIT, allocator
            self.layers()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.layers()

    def plan(self):
        self.rt.plan_full(self.ids, [self.ctx + self.n + 1] * self.rows, self.rows, self.bt)
        if self.no_write_through:        # A/B: the write kernels skip the host store (page -1)
            self.rt._batch(self.rows).field("host_page").fill_(-1)
        self.n += 1

    def inputs(self):
        """This step's query (the same base every step, moved by --q-noise) and new K/V."""
        q = self.q_base + self.noise * torch.randn(self.q_base.shape, device="cuda",
                                                   generator=self.g)
        self.io[0].copy_(q)
        self.io[1].normal_(generator=self.g)
        self.io[2].normal_(generator=self.g)

    def run(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.layers()

    def step(self):
        self.plan()
        self.inputs()
        self.run()


def measure(s: Setup, steps: int) -> dict:
    for _ in range(10):                                  # warm-up: first misses
        s.step()
    torch.cuda.synchronize()
    before = s.rt.stats_dict()
    plan_s, run_ms = 0.0, []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.plan()
        plan_s += time.perf_counter() - t0
        s.inputs()
        e0.record()
        s.run()
        e1.record()
        torch.cuda.synchronize()
        run_ms.append(e0.elapsed_time(e1))
    after = s.rt.stats_dict()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    with warnings.catch_warnings(record=True) as w:     # host syncs of one plan_full
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            s.plan()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sorted({str(x.message).splitlines()[0][:120] for x in w if "prototype" not in
                    str(x.message)})
    return {"plan_ms": round(plan_s * 1e3 / steps, 3),
            "us_per_layer": round(sum(run_ms) * 1e3 / steps / s.L, 2),
            # the replays' spread (one call's runs scatter by a few us a layer at one row)
            "us_per_layer_median": round(statistics.median(run_ms) * 1e3 / s.L, 2),
            "us_per_layer_min": round(min(run_ms) * 1e3 / s.L, 2),
            "miss_rate": round(misses / max(hits + misses, 1), 4),
            "plan_syncs": len(syncs), "sync_kinds": " | ".join(syncs)}


def stock_us(s: Setup, reps: int = 20) -> float | None:
    """Stock vLLM's layer: FlashAttention paged decode of the same batch over the whole context,
    split-KV chosen by FlashAttention (num_splits=0), in a CUDA graph (us)."""
    try:
        from vllm.v1.attention.backends.fa_utils import (flash_attn_varlen_func,
                                                          get_flash_attn_version)
    except Exception as e:  # noqa: BLE001 - no vLLM here: report and run without the baseline
        print(f"no FlashAttention ({type(e).__name__}: {e}); stock baseline skipped")
        return None
    pages = -(-s.ctx // P)
    kv = torch.zeros(s.rows * pages, 2, P, HKV, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(s.rows * pages, device="cuda", dtype=torch.int32).view(s.rows, pages)
    q = torch.randn(s.rows, HQ, D, device="cuda").to(torch.bfloat16)
    cu = torch.arange(s.rows + 1, device="cuda", dtype=torch.int32)
    seq = torch.full((s.rows,), s.ctx, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    ver = get_flash_attn_version()

    def call():
        flash_attn_varlen_func(q=q, k=kv[:, 0], v=kv[:, 1], out=out, cu_seqlens_q=cu,
                               max_seqlen_q=1, seqused_k=seq, max_seqlen_k=s.ctx,
                               softmax_scale=D ** -0.5, causal=True, block_table=bt,
                               fa_version=ver, num_splits=0)

    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            call()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps


def profile(s: Setup, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(4):
            s.step()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(f"4 steps x {s.L} layers, {s.rows} rows, context {s.ctx}; GPU time per kernel\n")
        f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=30))


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", default="4096,32768")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--buffer", type=int, default=4096)
    ap.add_argument("--q-noise", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dense-layers", type=int, default=0,
                    help="the first N of --layers dense (every page; from a GPU dense pool with "
                         "the host tier), as a model's dense_layers")
    ap.add_argument("--eager", action="store_true", help="run the body eagerly, no graph")
    ap.add_argument("--resident", action="store_true", help="host_tier false (every page on GPU)")
    ap.add_argument("--resident-first", action="store_true",
                    help="resident_first true (the serving default: with the bench's free HBM "
                         "every page stays resident, no miss); default the fixed hot buffer")
    ap.add_argument("--no-write-through", action="store_true",
                    help="A/B of the write-through's cost only: the new tokens are not stored into "
                         "the host pool (stale host pages: use with --resident-first or --q-noise "
                         "0, where nothing is read back)")
    ap.add_argument("--select-warps", type=int, default=None,
                    help="tuning: override ops/triton_select.SELECT_WARPS")
    ap.add_argument("--radix-bits", type=int, default=None,
                    help="tuning: override ops/triton_select.RADIX_BITS (top-k bits per pass)")
    ap.add_argument("--quest-tile-elems", type=int, default=None,
                    help="tuning: override ops/triton_quest.TILE_ELEMS (pages x Hkv x D)")
    ap.add_argument("--select-impl", choices=("cuda", "triton"), default=None,
                    help="A/B: override ops/decode_ops.SELECT_IMPL (the select kernel)")
    ap.add_argument("--select-threads", type=int, default=None,
                    help="tuning: override ops/decode_ops.SELECT_THREADS (CUDA select's CTA)")
    ap.add_argument("--fetch-in-attention", type=int, choices=(0, 1), default=None,
                    help="A/B: override ops/decode_ops.FETCH_IN_ATTENTION (1: the attention's "
                         "split launch copies the misses in; 0: a miss-copy launch before it)")
    ap.add_argument("--out", default="out/decode_step")
    args = ap.parse_args(argv)
    from vllm_hisparse.ops import decode_ops, triton_quest, triton_select
    if args.select_impl is not None:
        decode_ops.SELECT_IMPL = args.select_impl
    if args.select_threads is not None:
        decode_ops.SELECT_THREADS = args.select_threads
    if args.fetch_in_attention is not None:
        decode_ops.FETCH_IN_ATTENTION = bool(args.fetch_in_attention)
    if args.select_warps is not None:
        triton_select.SELECT_WARPS = args.select_warps
    if args.radix_bits is not None:
        triton_select.RADIX_BITS = args.radix_bits
    if args.quest_tile_elems is not None:
        triton_quest.TILE_ELEMS = args.quest_tile_elems
    os.makedirs(args.out, exist_ok=True)
    rows_out = []
    for ctx in (int(x) for x in args.context.split(",")):
        for R in (int(x) for x in args.rows.split(",")):
            s = Setup(args, R, ctx)
            if not args.eager:
                s.capture()
            row = {"context": ctx, "rows": R, "mode": "eager" if args.eager else "graph",
                   "resident": args.resident, "resident_first": args.resident_first,
                   "dense_layers": args.dense_layers,
                   "no_write_through": args.no_write_through, "q_noise": args.q_noise,
                   "select_impl": decode_ops.SELECT_IMPL,
                   "select_threads": decode_ops.SELECT_THREADS,
                   "fetch_in_attention": decode_ops.FETCH_IN_ATTENTION,
                   "select_warps": args.select_warps, "radix_bits": args.radix_bits,
                   "quest_tile_elems": args.quest_tile_elems,
                   "sparse_rows": sum(s.rt.reqs[i].sparse for i in s.ids), **measure(s, args.steps)}
            stock = stock_us(s)
            row["stock_fa_us_per_layer"] = None if stock is None else round(stock, 2)
            profile(s, os.path.join(args.out, f"profile-{ctx}-{R}.txt"))
            rows_out.append(row)
            print(row, flush=True)
            del s
            torch.cuda.empty_cache()
    write_csv(os.path.join(args.out, "decode_step.csv"), rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
