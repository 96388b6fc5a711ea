"""The load of the serving benchmark (bench/serving.py): one concurrency point's streamed
requests, their results (``RequestResult``, ``Point``: one CSV row), the step records and worker
counters around them, the warm-up before a sweep and a profiled point."""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from vllm_hisparse.bench import served_profile
from vllm_hisparse.bench import steps as st
from vllm_hisparse.bench.prompts import load_text_ids, repeated, text_prompts
from vllm_hisparse.bench.worker_stats import cache_per_point, host_per_step, read_stats


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
    decode: dict = field(default_factory=dict)    # steps.decode_rate of the point's step records
    engine_steps: int = 0                         # step records of the point
    host: dict = field(default_factory=dict)      # host_per_step (hisparse worker), {} for stock
    cache: dict = field(default_factory=dict)     # cache_per_point (hisparse worker), {} for stock

    def row(self) -> dict:
        r = self.results
        out_tok = sum(x.output_tokens for x in r)
        d, h = self.decode, self.host
        rnd = lambda x, n=1: None if x is None else round(x, n)  # noqa: E731
        return {
            "backend": self.backend, "concurrency": self.concurrency, "requests": len(r),
            "output_tok_s": out_tok / self.wall if self.wall else 0.0,
            "ttft_mean_s": statistics.fmean(x.ttft for x in r) if r else float("nan"),
            "ttft_p50_s": statistics.median(x.ttft for x in r) if r else float("nan"),
            "tpot_mean_ms": 1e3 * statistics.fmean(x.tpot for x in r) if r else float("nan"),
            "decode_tok_s": rnd(d.get("tok_s")), "decode_s": rnd(d.get("seconds"), 2),
            "decode_step_ms": rnd(d.get("step_ms"), 3),
            "running_max": self.running_max, "running_mean": round(self.running_mean, 2),
            "engine_steps": self.engine_steps,
            "host_ms_plan_per_step": rnd(h.get("plan"), 3),
            "host_ms_layers_per_step": rnd(h.get("layers"), 3),
            "policy": self.cache.get("policy"), "hit_rate": rnd(self.cache.get("hit_rate"), 4),
            "misses": self.cache.get("misses"), "miss_rate": rnd(self.cache.get("miss_rate"), 4),
            "resident_units": self.cache.get("resident_units"), "spills": self.cache.get("spills"),
            "shrinks": self.cache.get("shrinks"),
            "wall_s": round(self.wall, 2),
        }


def _settle(step_log: str, offset: int, stats_path: str | None, timeout: float = 30.0):
    """After a point's last answer: its step records up to the step that left nothing running, and
    the worker's counters once it has dropped every request (written a step or two later)."""
    t_end = time.monotonic() + timeout
    recs, off = st.read(step_log, offset)
    while time.monotonic() < t_end:
        stats = read_stats(stats_path)
        done = any(r["running"] == 0 for r in recs[-3:])
        if done and (stats_path is None or stats is None or stats.get("live_requests") == 0):
            return recs, stats
        time.sleep(0.2)
        more, off = st.read(step_log, off)
        recs += more
    return recs, read_stats(stats_path)


async def one_request(client, model: str, prompt: list[int], out_len: int) -> RequestResult:
    """One streamed completion. Tokens are counted from the final usage chunk, not from the text
    chunks: under load vLLM's API server merges several tokens into one chunk (counting chunks
    undercounts the tokens)."""
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=out_len,
                                             temperature=0.0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "min_tokens": out_len})
    async for chunk in stream:
        if chunk.choices:                  # a token event, even with no text yet: dummy weights
            if ttft is None:               # make tokens that decode to "" (partial UTF-8), and a
                ttft = time.perf_counter() - t0    # whole reply can (timed on text, TTFT read 0)
            chunks += 1
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage.completion_tokens
    if usage is None:
        raise RuntimeError("the server sent no usage chunk (stream_options include_usage): "
                           f"cannot count the output tokens ({chunks} text chunks)")
    return RequestResult(float("nan") if ttft is None else ttft, time.perf_counter() - t0, usage)


async def run_point(args, backend: str, c: int, port: int, model: str, vocab: int,
                    step_log: str, stats_path: str | None = None) -> Point:
    """One concurrency point; its step records (from ``step_log``, appended by the server) and the
    worker's counters before and after give the decode-only rate, running requests and host time
    per step."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=3600)
    rng = random.Random(1000 + c)
    n_req = max(c * args.rounds, c)
    n = getattr(args, "repeat_block", 0) or args.input_len    # --repeat-block: a block repeated
    if args.text_ids:
        prompts = text_prompts(load_text_ids(args.text_ids), n, n_req, rng)
    else:
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(n)] for _ in range(n_req)]
    prompts = [repeated(p, args.input_len) for p in prompts]
    sem = asyncio.Semaphore(c)
    pt = Point(backend, c)

    async def limited(p):
        async with sem:
            return await one_request(client, model, p, args.output_len)

    _, offset = st.read(step_log)
    before = read_stats(stats_path)
    t0 = time.perf_counter()
    pt.results = await asyncio.gather(*(limited(p) for p in prompts))
    pt.wall = time.perf_counter() - t0
    await client.close()
    recs, after = await asyncio.to_thread(_settle, step_log, offset, stats_path)
    pt.engine_steps = len(recs)
    pt.running_max, pt.running_mean = st.running(recs)
    pt.decode = st.decode_rate(recs)
    pt.host = host_per_step(before, after)
    pt.cache = cache_per_point(before, after)
    return pt


def profiled_point(args, backend: str, tag: str, c: int, vocab: int, step_log: str,
                   trace: str) -> None:
    """One more point at concurrency c (one round, not recorded) whose engine steps run under
    vLLM's torch profiler (--profile-decode), so that the measured points carry none of its
    overhead: its summary in OUT/profile-TAG.json (bench/served_profile.py)."""
    a = argparse.Namespace(**{**vars(args), "rounds": 1})
    served_profile.post(args.port, "/start_profile")
    asyncio.run(run_point(a, backend, c, args.port, args.model, vocab, step_log))
    r = served_profile.collect(args.port, trace, os.path.join(args.out, f"profile-{tag}.json"))
    print(served_profile.summary_line(tag, r), flush=True)


def warm_up(args, backend: str, port: int, model: str, vocab: int, step_log: str) -> None:
    """Two requests before the sweep, not measured: the first run of each kernel compiles it (Triton
    JIT, ~1 s each) and the first decode batch of each size captures its graphs; without this the
    concurrency-1 point's TTFT would carry the compilation."""
    a = argparse.Namespace(**{**vars(args), "rounds": 1, "output_len": min(args.output_len, 32)})
    t0 = time.perf_counter()
    for c in (1, 2):
        asyncio.run(run_point(a, backend, c, port, model, vocab, step_log))
    print(f"{backend}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
