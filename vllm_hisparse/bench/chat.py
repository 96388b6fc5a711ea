"""Multi-turn chat benchmark (issue 47): N conversations of T turns, one shared system prompt, each
turn re-sending the conversation's whole history (system + every earlier user message and reply)
plus a new user message, as chat, agent and RAG clients do. This is the workload vLLM's prefix
cache carries: a turn whose history is cached prefills only its new user message.

Issue 47's GPU run (stock saturated, aborts, leak check; model from bench.model_shapes llama3-8b)::

    python -m vllm_hisparse.bench.chat --model models/llama3-8b-bench --backends stock,elastic \\
        --conversations auto --turns 4 --system-len 2048 --user-len 6144 --output-len 256 \\
        --abort-every 5 --gpu-memory-utilization 0.9 --load-format scaled_dummy --out out/chat

Each backend gets one ``vllm serve`` with vLLM's default prefix caching (stock: on; hisparse: what
the plugin does with it). Conversations run at once (``--concurrency``, default all), each one's
turns in order; every reply is greedy with ``ignore_eos`` and its token ids come back in the stream
(``return_token_ids``), so the next turn re-sends exactly what the model wrote. Per backend and
turn: requests, mean prompt tokens, TTFT (mean, p50) and TPOT; per backend: output tok/s over the
run, vLLM's prefix-cache hit rate (``vllm:prefix_cache_hits`` / ``queries``, the run's delta) and
running_max / running_mean (the scheduler's counts, bench/steps.py). Writes DIR/chat.csv and
DIR/chat.json (one row per backend and turn, then one per backend with turn ``all``) and chat.png.

``--conversations auto``: ``--auto-factor`` (3) x the last turn's requests stock's KV holds (its
startup log's "Maximum concurrency"; stock first in --backends), so stock queues.
``--abort-every N``: every Nth turn (c * turns + t + 1 a multiple of N; N prime to --turns spreads
them) has its stream closed after half its reply (the server aborts it); the conversation goes on
with that half. Aborted turns are counted (``aborted``), not timed; their tokens count in tok/s.
Warm-up, not timed: a first-turn-long prompt, then a hit on its prefix (a short one never reached
hisparse's sparse path: turn 0 timed its kernels' first runs, 2.54 against 1.62 s, H100 12-07).
Leak check (hisparse backends): probes until nothing runs (an idle engine refreshes no gauge),
scrape the page figures (bench/chat_leaks.py ``PAGES``), ``POST /reset_prefix_cache?reset_external=true`` (served with
VLLM_SERVER_DEV_MODE=1, which the bench sets: the connector's index is emptied too), probe, scrape
again; the ``all`` row gets host_pages_*_after and *_after_reset, and the bench exits 1 with one
line of numbers if pages in use != pages the prefix cache holds after the run, or != 0 after it.
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
from vllm_hisparse.bench.chat_leaks import leak_check, leak_verdict
from vllm_hisparse.bench import steps as st
from vllm_hisparse.bench.prompts import load_text_ids
from vllm_hisparse.bench.serving import capacity, model_vocab, parse_backends, serve_cmd
from vllm_hisparse.server_health import stop, wait_healthy


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft: float
    latency: float
    output_tokens: int
    aborted: bool = False


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


def aborted_turns(args, c: int) -> set[int]:
    """Conversation c's turns that --abort-every N cancels: c * turns + t + 1 a multiple of N."""
    n = getattr(args, "abort_every", 0)
    return {t for t in range(args.turns) if n and (c * args.turns + t + 1) % n == 0}


async def conversation(complete, c: int, system: list[int], users: list[list[int]],
                       out_len: int, aborts: set[int] = frozenset()) -> list[Turn]:
    """One conversation's turns in order. complete(prompt, out_len[, abort_after=k]) -> (ttft,
    latency, reply ids): the history grows by each user message and the reply the model wrote (of
    a turn in ``aborts``, cancelled after half its reply, that half)."""
    history, turns = list(system), []
    for t, user in enumerate(users):
        prompt = history + user
        t0 = time.perf_counter()
        kw = {"abort_after": max(1, out_len // 2)} if t in aborts else {}
        ttft, _, reply = await complete(prompt, out_len, **kw)
        turns.append(Turn(c, t, len(prompt), ttft, time.perf_counter() - t0, len(reply),
                          t in aborts))
        history = prompt + list(reply)
    return turns


def openai_completer(port: int, model: str):
    """complete(prompt, out_len) through the server's streamed completions API."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=3600)

    async def complete(prompt: list[int], out_len: int, abort_after: int | None = None):
        """abort_after: close the stream (the server aborts the request) once that many reply
        tokens came; returns exactly those."""
        t0, ttft, ids = time.perf_counter(), None, []
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=out_len, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "min_tokens": out_len, "return_token_ids": True})
        async for chunk in stream:
            for ch in chunk.choices:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                ids += getattr(ch, "token_ids", None) or []
            if abort_after is not None and len(ids) >= abort_after:
                await stream.close()
                return ttft, time.perf_counter() - t0, ids[:abort_after]
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
    """One row per turn index, then the backend's whole run (turn 'all'). requests: the completed
    turns, which alone give the means; aborted: the cancelled ones."""
    def row(label, ts):
        done = [x for x in ts if not x.aborted]
        r = {"backend": backend, "turn": label, "requests": len(done),
             "aborted": len(ts) - len(done)}
        if not done:                    # every turn of this index aborted
            return dict(r, **dict.fromkeys(("prompt_tokens_mean", "ttft_mean_s", "ttft_p50_s",
                                            "tpot_mean_ms")))
        return dict(r, prompt_tokens_mean=round(statistics.fmean(x.prompt_tokens for x in done), 1),
                    ttft_mean_s=round(statistics.fmean(x.ttft for x in done), 4),
                    ttft_p50_s=round(statistics.median(x.ttft for x in done), 4),
                    tpot_mean_ms=round(1e3 * statistics.fmean(
                        (x.latency - x.ttft) / max(x.output_tokens - 1, 1) for x in done), 3))
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
            return await conversation(complete, c, system, users[c], args.output_len,
                                      aborted_turns(args, c))

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
        rs = [r for r in rows if r["backend"] == b and r["turn"] != "all" and r["ttft_mean_s"]]
        ax.plot([r["turn"] + 1 for r in rs], [r["ttft_mean_s"] for r in rs], "o-", label=b)
    ax.set(xlabel="turn", ylabel="mean TTFT (s)", title="TTFT per turn (history re-sent)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def conversations_at_capacity(args, log_path: str) -> int:
    """--auto-factor x the last turn's requests stock's KV holds (its log, as serving's cap)."""
    with open(log_path) as f:
        n = capacity(f.read(), "stock", max_context(args) + 16, 1 << 30)
    return max(1, round(args.auto_factor * n))


async def measure(args, backend: str, system, users, step_log: str):
    """One backend's run on its server (args.port): (rows, leak verdict or None)."""
    complete, client = openai_completer(args.port, args.model)
    base = f"http://127.0.0.1:{args.port}"
    try:
        warm = system[::-1] + users[0][0]      # warm-up (docstring), no block shared with the trace
        await complete(warm, 8)
        await complete(warm[:len(system)] + users[0][-1], 8)
        _, offset = st.read(step_log)
        before = prom.scrape(base)
        turns, wall = await run_backend(complete, args, system, users)
        rows = rows_of(backend, turns, wall, prefix_hits(before, prom.scrape(base)))
        most, mean = st.running(st.read(step_log, offset)[0])     # (-1, -1.0): no step records
        rows[-1].update(running_max=most if most >= 0 else None,
                        running_mean=round(mean, 2) if most >= 0 else None)
        if backend == "stock" or not args.leak_check:
            return rows, None
        try:
            rows[-1].update(await leak_check(complete, base, args.settle_timeout))
        except (RuntimeError, OSError) as e:        # the run's own figures stay
            return rows, f"{backend}: leak check failed: {e}"
        return rows, leak_verdict(backend, rows[-1])
    finally:
        await client.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--backends", default="stock,elastic")
    p.add_argument("--conversations", default="8",
                   help="N, or 'auto': --auto-factor x the last turn's requests stock's KV holds")
    p.add_argument("--auto-factor", type=float, default=3.0)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=2048, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=6144, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=256, help="tokens of each reply")
    p.add_argument("--concurrency", type=int, default=0,
                   help="conversations at once (default: all)")
    p.add_argument("--abort-every", type=int, default=0, metavar="N",
                   help="cancel every Nth turn after half its reply (0: none)")
    p.add_argument("--no-leak-check", dest="leak_check", action="store_false")
    p.add_argument("--settle-timeout", type=float, default=60,
                   help="seconds of probes for the pages to settle (after the run, the reset)")
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
    auto = args.conversations == "auto"
    if auto and backends[0] != "stock":
        p.error("--conversations auto sizes the run by stock's KV: put stock first in --backends")
    if not auto and not args.conversations.isdigit():
        p.error(f"--conversations {args.conversations}: a number or 'auto'")
    args.conversations = 0 if auto else int(args.conversations)
    os.makedirs(args.out, exist_ok=True)
    vocab = model_vocab(args.model)
    system = users = None
    rows: list[dict] = []
    verdicts: list[str] = []
    for b in backends:
        log_path = os.path.join(args.out, f"server-{b}.log")
        step_log = os.path.abspath(os.path.join(args.out, f"steps-{b}.jsonl"))
        # dev mode: /reset_prefix_cache (leak check); step records (read past an offset): running
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HISPARSE_STEP_LOG=step_log)
        log = open(log_path, "w")
        proc = subprocess.Popen(server_cmd(args, b), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(proc, args.port, args.ready_timeout)
            if system is None:                 # the trace, once (auto: sized on stock's server)
                if auto:
                    log.flush()
                    args.conversations = conversations_at_capacity(args, log_path)
                system, users = plan(args, random.Random(args.seed), vocab)
                print(f"chat: {args.conversations} conversations x {args.turns} turns, last "
                      f"prompt {max_context(args) - args.output_len} tokens", flush=True)
            part, verdict = asyncio.run(measure(args, b, system, users, step_log))
            rows += part
            verdicts += [verdict] if verdict else []
            print(json.dumps(rows[-1]), flush=True)
        finally:
            stop(proc, timeout=120)
            log.close()
    with open(os.path.join(args.out, "chat.csv"), "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "chat.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(args.out, "chat.png"))
    for v in verdicts:
        print(v, flush=True)
    return 1 if verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
