"""Soak test of a `vllm serve` running hisparse: bounded in time and requests, then checks that
nothing leaked and nothing changed.

    python -m vllm_hisparse.bench.soak --out DIR [--duration-s 600 --max-requests N ...] \\
        -- MODEL --attention-backend hisparse --hisparse-config F [more vllm serve flags]
    python -m vllm_hisparse.bench.soak --out DIR --url http://127.0.0.1:8000 [...]   # a running server

With arguments after ``--`` it starts ``vllm serve`` with them (log: DIR/serve.log) and stops it at
the end; with ``--url`` it drives a server already running. Phases:

1. a fixed greedy prompt (``--ref-len`` random token ids, seed 0, ``--ref-tokens`` tokens, alone on
   the server) -> the reference tokens;
2. ``--concurrency`` client threads send requests until ``--duration-s``, ``--max-requests`` or
   (``--until-seen``) every event below has happened:
   prompt lengths drawn around ``--min-context`` (``[min_context/2, 2 min_context]``, capped by
   ``--max-len``), random outputs; a share ``--abort-frac`` streams and closes the connection after
   a few chunks (vLLM aborts the request); a sampler reads /health and /metrics every
   ``--sample-s`` and keeps the peaks (host pool pages reserved, requests waiting for the host
   pool, running/waiting requests, KV cache usage) and vLLM's preemption counter;
3. once every client is done: waits for the server to be idle and checks that the host pool
   (pages in use, pages reserved) and the GPU KV blocks (``vllm:kv_cache_usage_perc``) are empty;
4. the fixed prompt again: the same tokens; the server never failed a health check nor exited.

What fills the host pool and causes preemption is the server's sizing (a small ``host_pool_gib``,
``--num-gpu-blocks-override``); the summary says whether each happened (``pool_full_seen``:
requests waited for host pages; ``preemptions``). DIR/soak.json holds every figure; the exit
status is 0 only when every check passed (``ok``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request

from vllm_hisparse.bench import prom
from vllm_hisparse.server_health import stop, wait_healthy

HS = "vllm:hisparse_"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for soak.json (and serve.log)")
    p.add_argument("--url", default=None, help="a running server (else: start vllm serve)")
    p.add_argument("--port", type=int, default=8765, help="port for the started server")
    p.add_argument("--duration-s", type=float, default=120, help="stop sending after this")
    p.add_argument("--max-requests", type=int, default=10**9, help="... or after this many")
    p.add_argument("--until-seen", action="store_true",
                   help="... or as soon as every event the soak exists for has happened: requests "
                        "completed and aborted, requests waiting for host pages, a preemption "
                        "(the CPU test's short soak)")
    p.add_argument("--concurrency", type=int, default=8, help="client threads")
    p.add_argument("--min-context", type=int, required=True,
                   help="the server's hisparse min_context: prompt lengths are drawn around it")
    p.add_argument("--max-len", type=int, required=True, help="the server's --max-model-len")
    p.add_argument("--max-tokens", type=int, default=64, help="largest output of a request")
    p.add_argument("--abort-frac", type=float, default=0.3,
                   help="share of requests streamed and abandoned mid-stream")
    p.add_argument("--vocab", type=int, default=500, help="token ids are drawn from [3, vocab)")
    p.add_argument("--ref-len", type=int, default=None,
                   help="fixed prompt length (default: 2 x --min-context, capped)")
    p.add_argument("--ref-tokens", type=int, default=32, help="fixed prompt's greedy tokens")
    p.add_argument("--sample-s", type=float, default=0.5, help="/metrics sampling period")
    p.add_argument("--idle-timeout-s", type=float, default=120,
                   help="how long to wait for the server to drain at the end")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve", nargs=argparse.REMAINDER,
                   help="after --: MODEL and the vllm serve flags (starts the server)")


class Client:
    """Requests through the OpenAI client (token-id prompts, greedy or sampled)."""

    def __init__(self, base_url: str):
        from openai import OpenAI

        self.c = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
        self.model = self.c.models.list().data[0].id

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        r = self.c.completions.create(model=self.model, prompt=prompt, max_tokens=n,
                                      temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return list(r.choices[0].token_ids)

    def complete(self, prompt: list[int], n: int, seed: int) -> int:
        r = self.c.completions.create(model=self.model, prompt=prompt, max_tokens=n,
                                      temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    def stream_and_abort(self, prompt: list[int], n: int, seed: int, after: int) -> int:
        """Stream, read ``after`` chunks, close the connection (the server aborts the request)."""
        s = self.c.completions.create(model=self.model, prompt=prompt, max_tokens=n,
                                      temperature=1.0, seed=seed, stream=True,
                                      extra_body={"ignore_eos": True})
        got = 0
        try:
            for _ in s:
                got += 1
                if got >= after:
                    break
        finally:
            s.close()
        return got


class Sampler(threading.Thread):
    """/health and /metrics every period: health failures, peaks of the gauges that matter."""

    PEAKS = {"reserved": f"{HS}host_pool_pages_reserved", "used": f"{HS}host_pool_pages_used",
             "waiting_pool": f'{HS}requests_waiting{{reason="host_pool"}}',
             "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "kv_usage": "vllm:kv_cache_usage_perc"}

    def __init__(self, url: str, period: float, proc: subprocess.Popen | None):
        super().__init__(daemon=True)
        self.url, self.period, self.proc = url, period, proc
        self.peak = dict.fromkeys(self.PEAKS, 0.0)
        self.samples = 0
        self.last: dict[str, float] = {}
        self.health_failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.period):
            self.last = self.sample() or self.last

    def sample(self) -> dict[str, float] | None:
        if self.proc is not None and self.proc.poll() is not None:
            self.health_failures.append(f"server exited with {self.proc.returncode}")
            self.halt.set()
            return None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                if r.status != 200:
                    self.health_failures.append(f"/health {r.status}")
            m = prom.scrape(self.url)
        except OSError as e:
            self.health_failures.append(f"{type(e).__name__}: {e}")
            return None
        self.samples += 1
        for k, name in self.PEAKS.items():
            self.peak[k] = max(self.peak[k], m.get(name, 0.0))
        return m


def prompt_len(rng: random.Random, a) -> int:
    hi = min(2 * a.min_context, a.max_len - a.max_tokens)
    return max(1, min(rng.randint(max(1, a.min_context // 2), max(hi, 1)), hi))


def drive(cl: Client, a, deadline: float, counts: dict, lock: threading.Lock, wid: int,
          enough: threading.Event) -> None:
    rng = random.Random(a.seed * 1000 + wid)
    while time.time() < deadline and not enough.is_set():
        with lock:
            if counts["sent"] >= a.max_requests:
                return
            counts["sent"] += 1
            seq = counts["sent"]
        prompt = [rng.randrange(3, a.vocab) for _ in range(prompt_len(rng, a))]
        n = rng.randint(1, a.max_tokens)
        try:
            if rng.random() < a.abort_frac and n > 2:
                got = cl.stream_and_abort(prompt, n, seq, rng.randint(1, n - 1))
                key = "aborted"
            else:
                got = cl.complete(prompt, n, seq)
                key = "completed"
                if got != n:
                    raise RuntimeError(f"{got} tokens instead of {n}")
            with lock:
                counts[key] += 1
                counts["tokens"] += got
        except Exception as e:           # a failed request is a finding, not the end of the soak
            with lock:
                counts["errors"] += 1
                counts["error_samples"] = (counts["error_samples"] + [repr(e)[:300]])[:10]


def all_seen(counts: dict, sampler: Sampler, start: dict[str, float]) -> bool:
    """--until-seen: completed and aborted requests, a wait for host pages, a preemption."""
    pre = "vllm:num_preemptions_total"
    return (counts["completed"] > 0 and counts["aborted"] > 0 and sampler.peak["waiting_pool"] > 0
            and sampler.last.get(pre, 0.0) > start.get(pre, 0.0))


def wait_drained(sampler: Sampler, timeout: float) -> dict[str, float]:
    """The metrics once nothing runs, waits, holds host pages or GPU blocks (or the timeout's)."""
    end = time.time() + timeout
    m: dict[str, float] = {}
    while time.time() < end:
        m = sampler.sample() or m
        if m and all(m.get(k, 1) == 0 for k in (
                "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                f"{HS}host_pool_pages_used", f"{HS}host_pool_pages_reserved")):
            break
        time.sleep(0.5)
    return m


def soak(a) -> dict:
    os.makedirs(a.out, exist_ok=True)
    proc, log = None, None
    url = a.url
    if url is None:
        if not a.serve:
            raise SystemExit("give --url of a running server, or -- MODEL [vllm serve flags]")
        serve = a.serve[1:] if a.serve[0] == "--" else a.serve
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *serve,   # no `vllm`
               "--host", "127.0.0.1", "--port", str(a.port)]            # script on the GPU box
        log = open(os.path.join(a.out, "serve.log"), "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{a.port}"
    res: dict = {"url": url}
    try:
        if proc is not None:
            res["server_start_s"] = round(wait_healthy(proc, a.port, a.start_timeout_s), 1)
        cl = Client(url)
        rng = random.Random(a.seed)
        ref_len = a.ref_len or min(2 * a.min_context, a.max_len - a.ref_tokens)
        ref = [rng.randrange(3, a.vocab) for _ in range(ref_len)]
        sampler = Sampler(url, a.sample_s, proc)
        start = sampler.sample() or {}
        before = cl.greedy(ref, a.ref_tokens)
        counts = {"sent": 0, "completed": 0, "aborted": 0, "errors": 0, "tokens": 0,
                  "error_samples": []}
        lock = threading.Lock()
        sampler.start()
        t0 = time.time()
        enough = threading.Event()
        workers = [threading.Thread(target=drive, daemon=True,
                                    args=(cl, a, t0 + a.duration_s, counts, lock, i, enough))
                   for i in range(a.concurrency)]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            if a.until_seen and not enough.is_set() and all_seen(counts, sampler, start):
                enough.set()                  # each client finishes the request it has in flight
            time.sleep(0.5)
        for w in workers:
            w.join()
        res["stopped_early"] = enough.is_set()
        res["soak_s"] = round(time.time() - t0, 1)
        sampler.halt.set()
        sampler.join()
        end = wait_drained(sampler, a.idle_timeout_s)
        after = cl.greedy(ref, a.ref_tokens)
        final = wait_drained(sampler, a.idle_timeout_s)
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            with open(os.path.join(a.out, "metrics.txt"), "wb") as f:
                f.write(r.read())

        def delta(name: str) -> float:
            return final.get(name, 0.0) - start.get(name, 0.0)

        lookups = delta(f"{HS}hot_buffer_lookups_total")
        res.update({
            "requests": counts, "peaks": sampler.peak, "samples": sampler.samples,
            "host_pool_pages_capacity": final.get(f"{HS}host_pool_pages_capacity"),
            "preemptions": delta("vllm:num_preemptions_total"),
            "hit_rate": delta(f"{HS}hot_buffer_hits_total") / lookups if lookups else None,
            "lookups": lookups, "miss_bytes": delta(f"{HS}miss_bytes_total"),
            "decode_rows": {k: delta(f'{HS}decode_rows_total{{kind="{k}"}}')
                            for k in ("sparse", "dense")},
            "after_drain": {k: end.get(n) for k, n in (
                ("host_pages_used", f"{HS}host_pool_pages_used"),
                ("host_pages_reserved", f"{HS}host_pool_pages_reserved"),
                ("kv_cache_usage", "vllm:kv_cache_usage_perc"),
                ("running", "vllm:num_requests_running"), ("waiting", "vllm:num_requests_waiting"))},
            "ref_tokens_before": before, "ref_tokens_after": after,
            "health_failures": sampler.health_failures,
        })
        cap = res["host_pool_pages_capacity"] or 0
        res["peak_pool_fill"] = sampler.peak["reserved"] / cap if cap else None
        res["pool_full_seen"] = sampler.peak["waiting_pool"] > 0
        res["checks"] = {
            "server_alive": not sampler.health_failures and (proc is None or proc.poll() is None),
            "no_leaks": bool(end) and all(v == 0 for v in res["after_drain"].values()),
            "same_tokens": before == after,
            "no_request_errors": counts["errors"] == 0,
        }
        res["ok"] = all(res["checks"].values())
    finally:
        if proc is not None:
            stop(proc)
            log.close()
        with open(os.path.join(a.out, "soak.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    a = p.parse_args(argv)
    res = soak(a)
    short = {k: res.get(k) for k in ("ok", "checks", "soak_s", "requests", "peak_pool_fill",
                                     "pool_full_seen", "preemptions", "hit_rate", "after_drain")}
    print(json.dumps(short, indent=1, default=str))
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
