"""Multi-turn chat benchmark (issue 47): N conversations of T turns, one shared system prompt, each
turn re-sending the conversation's whole history (system + every earlier user message and reply)
plus a new user message, as chat, agent and RAG clients do. This is the workload vLLM's prefix
cache carries: a turn whose history is cached prefills only its new user message.

    python -m vllm_hisparse.bench.chat --model DIR --backends stock,elastic \\
        --conversations 8 --turns 4 --system-len 2048 --user-len 6144 --output-len 256 \\
        --gpu-memory-utilization 0.3 --out DIR

Each backend gets one ``vllm serve`` with vLLM's default prefix caching (stock: on; hisparse: what
the plugin does with it). Conversations run at once (``--concurrency``, default all), each one's
turns in order; every reply is greedy with ``ignore_eos`` and its token ids come back in the stream
(``return_token_ids``), so the next turn re-sends exactly what the model wrote. Per backend and
turn: requests, mean prompt tokens, TTFT (mean, p50) and TPOT; per backend: output tok/s over the
run and vLLM's prefix-cache hit rate (``vllm:prefix_cache_hits`` / ``queries``, /metrics, the run's
delta). Writes DIR/chat.csv (one row per backend and turn, then one per backend with turn ``all``)
and DIR/chat.png (TTFT per turn).
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from vllm_hisparse.bench import prom
from vllm_hisparse.bench.prompts import load_text_ids
from vllm_hisparse.bench.serving import model_vocab, parse_backends, serve_cmd
from vllm_hisparse.server_health import stop, wait_healthy


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft: float
    latency: float
    output_tokens: int


def plan(args, rng: random.Random, vocab: int):
    """The system prompt and each conversation's user messages (token ids): real text at distinct
    offsets with --text-ids, else random ids. Returns (system, users[conversation][turn])."""
    n_user = args.conversations * args.turns
    need = args.system_len + n_user * args.user_len
    if args.text_ids:
        text = load_text_ids(args.text_ids)
        if len(text) < need:
            raise SystemExit(f"--text-ids: {len(text)} tokens; the trace needs {need} (system "
                             f"{args.system_len} + {n_user} user messages of {args.user_len})")
        pieces = [text[i:i + args.user_len]
                  for i in range(args.system_len, need, args.user_len)]
        system = text[:args.system_len]
    else:
        system = [rng.randrange(100, vocab - 100) for _ in range(args.system_len)]
        pieces = [[rng.randrange(100, vocab - 100) for _ in range(args.user_len)]
                  for _ in range(n_user)]
    users = [pieces[c * args.turns:(c + 1) * args.turns] for c in range(args.conversations)]
    return system, users


def max_context(args) -> int:
    """Tokens of the last turn's prompt + its reply: what --max-model-len must hold."""
    return args.system_len + args.turns * (args.user_len + args.output_len)


async def conversation(complete, c: int, system: list[int], users: list[list[int]],
                       out_len: int) -> list[Turn]:
    """One conversation's turns in order. complete(prompt, out_len) -> (ttft, latency, reply ids):
    the history grows by each user message and the reply the model wrote."""
    history, turns = list(system), []
    for t, user in enumerate(users):
        prompt = history + user
        t0 = time.perf_counter()
        ttft, _, reply = await complete(prompt, out_len)
        turns.append(Turn(c, t, len(prompt), ttft, time.perf_counter() - t0, len(reply)))
        history = prompt + list(reply)
    return turns


def openai_completer(port: int, model: str):
    """complete(prompt, out_len) through the server's streamed completions API."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=3600)

    async def complete(prompt: list[int], out_len: int):
        t0, ttft, ids = time.perf_counter(), None, []
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=out_len, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "min_tokens": out_len, "return_token_ids": True})
        async for chunk in stream:
            for ch in chunk.choices:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                ids += getattr(ch, "token_ids", None) or []
        if len(ids) != out_len:
            raise RuntimeError(f"got {len(ids)} reply token ids of {out_len}: the server did not "
                               f"return token ids (return_token_ids; vLLM >= 0.10)")
        return ttft, time.perf_counter() - t0, ids
    return complete, client


def prefix_hits(before: dict, after: dict) -> tuple[float, float]:
    """(hit tokens, queried tokens) of vLLM's prefix cache between two /metrics scrapes."""
    get = lambda d, k: d.get(f"vllm:{k}_total", d.get(f"vllm:{k}", 0.0))  # noqa: E731
    return (get(after, "prefix_cache_hits") - get(before, "prefix_cache_hits"),
            get(after, "prefix_cache_queries") - get(before, "prefix_cache_queries"))


def rows_of(backend: str, turns: list[Turn], wall: float, hits: tuple[float, float]) -> list[dict]:
    """One row per turn index, then the backend's whole run (turn 'all')."""
    def row(label, ts):
        return {"backend": backend, "turn": label, "requests": len(ts),
                "prompt_tokens_mean": round(statistics.fmean(x.prompt_tokens for x in ts), 1),
                "ttft_mean_s": round(statistics.fmean(x.ttft for x in ts), 4),
                "ttft_p50_s": round(statistics.median(x.ttft for x in ts), 4),
                "tpot_mean_ms": round(1e3 * statistics.fmean(
                    (x.latency - x.ttft) / max(x.output_tokens - 1, 1) for x in ts), 3)}
    out = [row(t, [x for x in turns if x.turn == t]) for t in sorted({x.turn for x in turns})]
    total = row("all", turns)
    total["output_tok_s"] = round(sum(x.output_tokens for x in turns) / wall, 2)
    total["prefix_hit_rate"] = round(hits[0] / hits[1], 4) if hits[1] else 0.0
    total["wall_s"] = round(wall, 2)
    return out + [total]


async def run_backend(complete, args, system, users) -> tuple[list[Turn], float]:
    sem = asyncio.Semaphore(args.concurrency or args.conversations)

    async def one(c):
        async with sem:
            return await conversation(complete, c, system, users[c], args.output_len)

    t0 = time.perf_counter()
    parts = await asyncio.gather(*(one(c) for c in range(args.conversations)))
    return [t for p in parts for t in p], time.perf_counter() - t0


def server_cmd(args, backend: str) -> list[str]:
    # prefix caching on: vLLM's default, what the multi-turn benchmark measures
    return serve_cmd(args, backend, args.port, max_context(args) + 16, prefix_caching=True)


def plot(rows: list[dict], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for b in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == b and r["turn"] != "all"]
        ax.plot([r["turn"] + 1 for r in rs], [r["ttft_mean_s"] for r in rs], "o-", label=b)
    ax.set(xlabel="turn", ylabel="mean TTFT (s)", title="TTFT per turn (history re-sent)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--backends", default="stock,elastic")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=2048, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=6144, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=256, help="tokens of each reply")
    p.add_argument("--concurrency", type=int, default=0,
                   help="conversations at once (default: all)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hisparse", default='{"top_k": 2048, "device_buffer_size": 4096}')
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--text-ids", metavar="FILE", help="real text (as bench.serving's)")
    p.add_argument("--port", type=int, default=18100)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/chat")
    p.add_argument("extra_server_args", nargs="*", help="after --: passed to vllm serve")
    args = p.parse_args(argv)
    backends = parse_backends(p, args.backends)
    os.makedirs(args.out, exist_ok=True)
    vocab = model_vocab(args.model)
    system, users = plan(args, random.Random(args.seed), vocab)
    print(f"chat: {args.conversations} conversations x {args.turns} turns, last prompt "
          f"{max_context(args) - args.output_len} tokens", flush=True)
    rows: list[dict] = []
    for b in backends:
        log = open(os.path.join(args.out, f"server-{b}.log"), "w")
        proc = subprocess.Popen(server_cmd(args, b), stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{args.port}"
        try:
            wait_healthy(proc, args.port, args.ready_timeout)

            async def go():
                complete, client = openai_completer(args.port, args.model)
                await complete(list(range(100, 164)), 4)    # warm-up (not measured, no shared prefix)
                before = prom.scrape(base)
                turns, wall = await run_backend(complete, args, system, users)
                await client.close()
                return turns, wall, prefix_hits(before, prom.scrape(base))
            turns, wall, hits = asyncio.run(go())
            rows += rows_of(b, turns, wall, hits)
            print(json.dumps(rows[-1]), flush=True)
        finally:
            stop(proc, timeout=120)
            log.close()
    with open(os.path.join(args.out, "chat.csv"), "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(args.out, "chat.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
