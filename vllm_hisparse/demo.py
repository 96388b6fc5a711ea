"""`hisparse demo`: serve a tiny model with hisparse through `vllm serve` on this machine (CPU or
GPU), send one long request with the OpenAI client, print the answer and what hisparse did.
`hisparse demo --core`: the core alone on a built-in example, no vLLM needed.

The vLLM demo builds a tiny random Llama offline (vllm_hisparse.tiny_model), so its answer is
gibberish; what it shows is the path (`--attention-backend hisparse`, Quest selection) and what
hisparse did (``report``): the tier each sparse decode step ran in, spills, the hot buffer's hits
and misses, the host pool empty at the end. With the default config (resident_first on) the one
request keeps all its GPU blocks, so no page goes through a hot buffer; with
`--config '{..., "resident_first": false}'` it keeps only its hot buffer after the prompt and its
misses are fetched from the host pool.
`--model smollm2` serves the real SmolLM2-135M instead (vllm_hisparse.smollm2, built on first use);
`--model DIR` any HF model folder. The pools are sized from the model for MAX_MODEL_LEN tokens.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.server_health import ServerExited, stop, wait_healthy
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.slots.engine import HotBufferState, fetch_misses, resolve, write_resident
from vllm_hisparse.ops import reference as ref

SERVE_CONFIG = {"top_k": 64, "device_buffer_size": 128, "page_size": 16, "dense_layers": [0],
                "host_pool_gib": 0.1, "dense_pool_gib": 0.05}
MAX_MODEL_LEN = 4096
POOL_REQUESTS = 2        # the pools hold this many max_model_len requests (the demo sends one)


def add_arguments(p):
    p.add_argument("--core", action="store_true", help="run the core-only example (no vLLM)")
    p.add_argument("--requests", type=int, default=4, help="--core: requests")
    p.add_argument("--context", type=int, default=2048, help="--core: prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="--core: decode steps")
    p.add_argument("--config", default=None,
                   help="hisparse config (JSON string or file); default: a small one per mode")
    p.add_argument("--model", default=None,
                   help="'smollm2' (the real SmolLM2-135M) or an HF model folder; default: a tiny "
                        "random Llama")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--port", type=int, default=0, help="0 = any free port")


def run(args) -> int:
    if args.core:
        if args.config is None:
            args.config = '{"top_k": 256, "device_buffer_size": 512, "page_size": 16}'
        return run_core(args)
    return run_serve(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt_text() -> str:
    for path in ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"):
        if os.path.exists(path):
            with open(path, errors="ignore") as f:
                return f.read()[:6000] + "\n\nIn one sentence, what is this text about?"
    return "The quick brown fox jumps over the lazy dog. " * 150 + "\nWhat did the fox do?"


def run_serve(args) -> int:
    from vllm_hisparse import tiny_model

    model = _model_dir(args.model) if args.model else tiny_model.build(tiny_model.DEFAULT_OUT)
    cfg = HiSparseConfig.load(args.config or sized_config(model))
    port = args.port or _free_port()
    work = tempfile.mkdtemp(prefix="hisparse-demo-")
    stats_path = os.path.join(work, "stats.json")
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    cmd = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--attention-backend", "hisparse", "--additional-config",
           json.dumps({"hisparse": cfg.to_dict()}), "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", "8", "--enforce-eager"]
    if not torch.cuda.is_available():
        cmd += ["--dtype", "float32"]
    env = dict(os.environ, HISPARSE_STATS_FILE=stats_path)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    log_path = os.path.join(work, "serve.log")
    print(f"demo: {' '.join(cmd[:3])} ... --attention-backend hisparse  (log: {log_path})")
    print(f"demo: hisparse config {json.dumps(cfg.to_dict())}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            return _talk(proc, port, model, args.max_tokens, stats_path, log_path, cfg)
        finally:
            stop(proc)


def _model_dir(name: str) -> str:
    from vllm_hisparse import smollm2

    if name.lower() == smollm2.NAME:
        print(f"demo: building SmolLM2-135M into {smollm2.DEFAULT_OUT} (once)")
        return smollm2.build(smollm2.DEFAULT_OUT)
    if not os.path.exists(os.path.join(name, "config.json")):
        raise SystemExit(f"demo: --model {name!r} is not an HF model folder (no config.json); "
                         f"use '{smollm2.NAME}' or a folder")
    return name


def sized_config(model_dir: str, max_model_len: int = MAX_MODEL_LEN) -> dict:
    """SERVE_CONFIG with the host and dense pools holding POOL_REQUESTS requests of max_model_len
    tokens of this model (fp32 bytes: the CPU's dtype, an upper bound on a GPU), at least its
    defaults (sized for the tiny model)."""
    from vllm_hisparse.config import gib_at_least
    from vllm_hisparse.core import capacity as cap

    m = cap.ModelShape.from_hf_config(model_dir, dtype="float32")
    base = HiSparseConfig.load(SERVE_CONFIG)
    tokens = cap.cdiv(max_model_len, base.page_size) * base.page_size * POOL_REQUESTS
    host = tokens * m.token_bytes_per_layer * len(base.host_pool_layers(m.num_layers))
    dense = tokens * m.token_bytes_per_layer * len(base.dense_layers)
    return dict(SERVE_CONFIG, host_pool_gib=max(SERVE_CONFIG["host_pool_gib"], gib_at_least(host)),
                dense_pool_gib=max(SERVE_CONFIG["dense_pool_gib"], gib_at_least(dense)))


def _talk(proc, port, model, max_tokens, stats_path, log_path, cfg) -> int:
    try:
        waited = wait_healthy(proc, port, timeout=600)
    except ServerExited:
        print(f"demo: vllm serve exited ({proc.returncode}); last lines of {log_path}:")
        with open(log_path) as f:
            print("".join(f.readlines()[-30:]))
        return 1
    except TimeoutError:
        print("demo: vllm serve did not start within 10 minutes")
        return 1
    print(f"demo: server up after {waited:.0f} s")
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    t1 = time.time()
    r = client.completions.create(model=model, prompt=_prompt_text(), max_tokens=max_tokens,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    u = r.usage
    print(f"demo: {u.prompt_tokens} prompt tokens -> {u.completion_tokens} generated in "
          f"{time.time() - t1:.1f} s")
    noise = "  (random-weight tiny model: the text is noise)" if "tiny-llama" in model else ""
    print(f"demo: answer: {r.choices[0].text!r}{noise}")
    st = {}
    for _ in range(40):                  # the worker writes its stats once the request is dropped
        if os.path.exists(stats_path):
            with open(stats_path) as f:
                st = json.load(f)
            if st.get("live_requests") == 0:
                break
        time.sleep(0.5)
    if not st:
        print("demo: no stats from the worker")
        return 1
    for line in report(st, cfg):
        print(f"demo: {line}")
    return 0


def report(st: dict, cfg: HiSparseConfig) -> list[str]:
    """What hisparse did, from the worker's stats (core/runtime_stats.py) once the requests are
    done: the tier each sparse decode step ran in (resident: every page in the request's own GPU
    blocks; partial: its newest pages there, older ones through its hot buffer; host-backed: the
    hot buffer alone, misses fetched from the host pool), spills, and the hot buffer's hits and
    misses. The hot buffer is named only where a request used one: with resident_first (the
    default) a request stays resident until the KV pool needs its blocks."""
    rows, res, part = st["decode_rows"], st["resident_rows"], st["partial_rows"]
    host = rows - res - part
    out = [f"sparse decode steps {rows}: {res} resident (every page in the request's own GPU "
           f"blocks), {part} partial (newest pages there, older ones through its hot buffer), "
           f"{host} host-backed (hot buffer + host pool); dense decode steps "
           f"{st['dense_decode_rows']}"]
    if not cfg.resident_first:
        out.append(f"requests finished {st['finished']} (resident_first off: a sparse request "
                   f"gives its GPU blocks back after its prompt, keeping its hot buffer)")
    elif rows and res == rows and not st["spills"]:
        out.append(f"requests finished {st['finished']}, spills 0: no GPU block was given back, "
                   f"every sparse step ran resident (resident_first)")
    else:
        out.append(f"requests finished {st['finished']}, spills {st['spills']} (requests that left "
                   f"resident, giving GPU blocks back to the KV pool), shrinks {st['shrinks']}")
    direct = f"selected pages read from the request's own GPU blocks {st['resident_units']}"
    if st["resolved_units"]:
        out.append(f"hot buffer: pages resolved {st['resolved_units']}, hits {st['hits']}, misses "
                   f"fetched from host {st['misses']}, hit rate {st['hit_rate']:.1%}; {direct}")
        out.append(f"GPU keeps {cfg.num_slots} hot pages + the newest page per layer for each "
                   f"request not resident (top_k={cfg.top_k} tokens, B={cfg.device_buffer_size})")
    else:
        out.append(f"no page went through a hot buffer (no hit, no miss, nothing fetched from the "
                   f"host pool); {direct}")
    out.append(f"host pool pages still used after the requests: {st['host_pages_used']}")
    return out


def run_core(args) -> int:
    cfg = HiSparseConfig.load(args.config)
    g = torch.Generator().manual_seed(0)
    R, unit, H, G, D = args.requests, cfg.page_size, 2, 4, 64
    U = -(-(args.context + args.steps) // unit)
    S, k = cfg.num_slots, cfg.top_k_units
    pool = HostKVPool(1, R * U, unit, H, D, dtype=torch.float32, pin=False)
    full = torch.zeros(R * U, 2, unit, H, D)
    state = HotBufferState.create(R, S, U, cfg.policy)
    buf = torch.zeros(R * S, 2, unit, H, D)
    slot_map = torch.arange(R * S, dtype=torch.int32).view(R, S)
    kmin, kmax = torch.zeros(R, U, H, D), torch.zeros(R, U, H, D)
    # Keys drift slowly along the sequence so that neighbouring steps pick similar pages.
    drift = torch.randn(U, H, D, generator=g).cumsum(0) * 0.02

    def write(r, pos):
        n = len(pos)
        kk = torch.randn(n, H, D, generator=g) + drift[pos // unit]
        vv = torch.randn(n, H, D, generator=g)
        pool.ensure(r, int(pos.max()) + 1)
        pool.write(r, 0, pos, kk, vv)
        full[r * U + pos // unit, 0, pos % unit] = kk
        full[r * U + pos // unit, 1, pos % unit] = vv
        write_resident(state, buf, slot_map, torch.full((n,), r), pos, kk, vv)
        ref.quest_update(kmin, kmax, torch.full((n,), r), pos, kk, unit)

    lens = torch.full((R,), args.context)
    for r in range(R):
        write(r, torch.arange(args.context))
    print(f"core demo: {R} requests x {args.context} tokens, top_k={cfg.top_k} tokens "
          f"({k} pages of {unit}), B={cfg.device_buffer_size} tokens, policy={cfg.policy}")
    hits = total = 0
    for step in range(args.steps):
        for r in range(R):
            write(r, lens[r:r + 1].clone())
        lens += 1
        q = 2 * torch.randn(R, H * G, D, generator=g) + drift[(lens - 1) // unit].repeat_interleave(G, 1)
        sel = torch.empty(R, k, dtype=torch.int32)
        ref.quest_select(ref.quest_scores(q, kmin, kmax, (lens + unit - 1) // unit), lens, unit, sel)
        locs, miss = resolve(state, sel)
        fetch_misses(buf, slot_map, locs, miss, sel,
                     lambda rr, uu: torch.stack([pool.data[0, pool.page_table(int(a))[int(b)]]
                                                 for a, b in zip(rr, uu)]))
        phys = torch.where(locs >= 0, torch.gather(slot_map.long(), 1, locs.clamp(min=0)), -1).int()
        res = torch.where(sel >= 0, torch.arange(R)[:, None] * U + sel, -1).int()
        a = ref.sparse_decode_attention(q, buf, phys, sel, lens.int(), D ** -0.5)
        b = ref.sparse_decode_attention(q, full, res, sel, lens.int(), D ** -0.5)
        if not torch.equal(a, b):
            print(f"step {step}: MISMATCH between hisparse and resident attention")
            return 1
        n_sel, n_miss = int((sel >= 0).sum()), int(miss.sum())
        hits, total = hits + n_sel - n_miss, total + n_sel
        if step < 4 or step == args.steps - 1:
            print(f"step {step:3d}: selected {n_sel} pages, misses {n_miss:4d}, "
                  f"hit rate {1 - n_miss / n_sel:.1%}  (bit-identical to resident: yes)")
    gpu = R * S * unit
    print(f"overall hit rate {hits / total:.1%} after warm-up misses; hot buffer {gpu} tokens on the "
          f"'GPU' vs {int(lens.sum())} resident; host pool pages used {pool.used_pages}")
    return 0
