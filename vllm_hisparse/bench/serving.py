"""Serving benchmark: throughput, TTFT, TPOT and running requests vs concurrency, per backend.

Starts `vllm serve` once per backend, then for each concurrency sends random-token prompts through the
OpenAI-compatible completions API (streaming, outputs forced with ignore_eos) and samples the
server's running-request gauge and generation-token counter (decode_peak_tok_s: the best 5 s
window of generation, the decode phase's rate apart from prefill); each server is warmed up first
(not measured). Writes
DIR/serving.csv, PNG plots (throughput vs concurrency, TTFT vs throughput: one line per backend),
the server logs and each hisparse worker's counters (DIR/stats-BACKEND.json).

    python -m vllm_hisparse.bench.serving --model DIR --input-len 32768 --output-len 512 \
        --concurrency 1,2,4,8,16,32,64,128,256 --backends stock,resident,hisparse \
        --gpu-memory-utilization 0.3 --hisparse '{"top_k":2048,"device_buffer_size":4096}' --out DIR
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from vllm_hisparse.server_health import stop, wait_healthy

BACKENDS = ("stock", "resident", "hisparse")


@dataclass
class RequestResult:
    ttft: float            # seconds to the first token
    latency: float         # seconds to the last token
    output_tokens: int

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / max(self.output_tokens - 1, 1)


@dataclass
class Point:
    backend: str
    concurrency: int
    results: list = field(default_factory=list)
    wall: float = 0.0
    running_max: int = 0
    running_mean: float = 0.0
    decode_peak: float = 0.0      # generation tok/s, best 5 s window (the server's counter)

    def row(self) -> dict:
        r = self.results
        out_tok = sum(x.output_tokens for x in r)
        return {
            "backend": self.backend, "concurrency": self.concurrency, "requests": len(r),
            "output_tok_s": out_tok / self.wall if self.wall else 0.0,
            "ttft_mean_s": statistics.fmean(x.ttft for x in r) if r else float("nan"),
            "ttft_p50_s": statistics.median(x.ttft for x in r) if r else float("nan"),
            "tpot_mean_ms": 1e3 * statistics.fmean(x.tpot for x in r) if r else float("nan"),
            "decode_peak_tok_s": round(self.decode_peak, 1),
            "running_max": self.running_max, "running_mean": round(self.running_mean, 2),
            "wall_s": round(self.wall, 2),
        }


def server_cmd(args, backend: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--port", str(port),
           "--max-model-len", str(args.input_len + args.output_len + 16), "--no-enable-prefix-caching",
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-num-seqs", str(max(args.concurrency))]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    if backend != "stock":
        cfg = json.loads(args.hisparse)
        if backend == "resident":
            cfg["host_tier"] = False
        cmd += ["--attention-backend", "hisparse", "--additional-config", json.dumps({"hisparse": cfg})]
    return cmd + args.extra_server_args


def parse_metrics(text: str) -> tuple[int, float]:
    """(running requests, generation tokens so far) from vLLM's Prometheus text; -1 / nan if
    absent."""
    m = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.e+]+)", text, re.M)
    g = re.search(r"^vllm:generation_tokens_total(?:\{[^}]*\})?\s+([0-9.e+]+)", text, re.M)
    return (int(float(m.group(1))) if m else -1), (float(g.group(1)) if g else float("nan"))


def scrape(port: int) -> tuple[int, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return parse_metrics(text)


def peak_rate(samples: list[tuple[float, float]], window: float = 5.0) -> float:
    """Largest increase per second of a counter over any span of at least `window` seconds between
    two samples (t, value): the peak generation throughput of a point, the decode phase's rate
    once prefill is done, whatever the prompt length. 0 when the samples span less than window."""
    best, i = 0.0, 0
    pts = [(t, v) for t, v in samples if v == v]               # drop nan
    for j in range(len(pts)):
        while i + 1 < j and pts[j][0] - pts[i + 1][0] >= window:
            i += 1
        dt = pts[j][0] - pts[i][0]
        if dt >= window:
            best = max(best, (pts[j][1] - pts[i][1]) / dt)
    return best


async def one_request(client, model: str, prompt: list[int], out_len: int) -> RequestResult:
    """One streamed completion. Tokens are counted from the final usage chunk, not from the text
    chunks: under load vLLM's API server merges several tokens into one chunk (counting chunks
    read 59 tokens for 512 on the H200, 2026-11-30)."""
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=out_len,
                                             temperature=0.0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "min_tokens": out_len})
    async for chunk in stream:
        if chunk.choices:                  # a token event, even with no text yet: dummy weights
            if ttft is None:               # make tokens that decode to "" (partial UTF-8), and a
                ttft = time.perf_counter() - t0    # whole 4K reply did so on the H200 (TTFT read 0)
            chunks += 1
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage.completion_tokens
    if usage is None:
        raise RuntimeError("the server sent no usage chunk (stream_options include_usage): "
                           f"cannot count the output tokens ({chunks} text chunks)")
    return RequestResult(float("nan") if ttft is None else ttft, time.perf_counter() - t0, usage)


async def run_point(args, backend: str, c: int, port: int, model: str, vocab: int) -> Point:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=3600)
    rng = random.Random(1000 + c)
    n_req = max(c * args.rounds, c)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(n_req)]
    sem = asyncio.Semaphore(c)
    pt = Point(backend, c)
    samples: list[tuple[float, int, float]] = []              # (time, running, generated)

    async def limited(p):
        async with sem:
            return await one_request(client, model, p, args.output_len)

    async def sampler():
        while True:
            await asyncio.sleep(0.5)
            running, gen = await asyncio.to_thread(scrape, port)
            samples.append((time.perf_counter(), running, gen))

    s = asyncio.create_task(sampler())
    t0 = time.perf_counter()
    pt.results = await asyncio.gather(*(limited(p) for p in prompts))
    pt.wall = time.perf_counter() - t0
    s.cancel()
    await client.close()
    good = [x[1] for x in samples if x[1] >= 0]
    pt.running_max = max(good, default=-1)
    pt.running_mean = statistics.fmean(good) if good else -1.0
    pt.decode_peak = peak_rate([(t, g) for t, _, g in samples])
    return pt


def warm_up(args, backend: str, port: int, model: str, vocab: int) -> None:
    """Two requests before the sweep, not measured: the first run of each kernel compiles it (Triton
    JIT, ~1 s each) and the first decode batch of each size captures its graphs; without this the
    concurrency-1 point's TTFT carried ~4 s of compilation (H200, 2026-11-30)."""
    a = argparse.Namespace(**{**vars(args), "rounds": 1, "output_len": min(args.output_len, 32)})
    t0 = time.perf_counter()
    for c in (1, 2):
        asyncio.run(run_point(a, backend, c, port, model, vocab))
    print(f"{backend}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for b in dict.fromkeys(r["backend"] for r in rows):
        rs = sorted((r for r in rows if r["backend"] == b), key=lambda r: r["concurrency"])
        line = ax[0].plot([r["concurrency"] for r in rs], [r["output_tok_s"] for r in rs], "o-", label=b)
        peak = [(r["concurrency"], r["decode_peak_tok_s"]) for r in rs if r.get("decode_peak_tok_s")]
        if peak:                                   # dashed: the decode phase's peak rate
            ax[0].plot(*zip(*peak), "x--", color=line[0].get_color(), alpha=0.6,
                       label=f"{b} decode peak")
        ax[1].plot([r["output_tok_s"] for r in rs], [r["ttft_mean_s"] for r in rs], "o-", label=b)
    ax[0].set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax[1].set(xlabel="output tokens/s", ylabel="mean TTFT (s)", yscale="log", title="TTFT vs throughput")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--rounds", type=int, default=2, help="requests per point = concurrency x rounds")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hisparse", default='{"top_k": 2048, "device_buffer_size": 4096, '
                   '"dense_pool_gib": 6, "host_pool_gib": 84, "quest_rows": 22}',
                   help="hisparse config (JSON); the default is sized with `hisparse calc` for the "
                        "128 GiB GPU box at 32K and gpu_memory_utilization 0.3: 84 GiB pinned host "
                        "= 22 requests' sparse layers, 22 Quest rows, their two dense layers in a "
                        "6 GiB GPU dense pool")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--out", default="out/serving")
    p.add_argument("extra_server_args", nargs="*", help="after --: passed to vllm serve")
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    backends = args.backends.split(",")
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        p.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    os.makedirs(args.out, exist_ok=True)
    vocab = json.load(open(os.path.join(args.model, "config.json"))).get("vocab_size", 32000)
    rows: list[dict] = []
    for b in backends:
        log = open(os.path.join(args.out, f"server-{b}.log"), "w")
        # the worker's counters (hit rate, host pages, decode-graph captures) land beside the CSV
        env = dict(os.environ, HISPARSE_STATS_FILE=os.path.abspath(
            os.path.join(args.out, f"stats-{b}.json")))
        proc = subprocess.Popen(server_cmd(args, b, args.port), stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        try:
            wait_healthy(proc, args.port, args.ready_timeout)
            warm_up(args, b, args.port, args.model, vocab)
            for c in args.concurrency:
                pt = asyncio.run(run_point(args, b, c, args.port, args.model, vocab))
                rows.append(pt.row())
                print(json.dumps(rows[-1]), flush=True)
        finally:
            stop(proc, timeout=120)
            log.close()
    with open(os.path.join(args.out, "serving.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(args.out, "serving.png"),
         f"input {args.input_len} / output {args.output_len}, gpu_mem_util {args.gpu_memory_utilization}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
