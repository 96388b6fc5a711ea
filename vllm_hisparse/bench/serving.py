"""Serving benchmark: throughput, TTFT, TPOT, the decode phase's rate and running requests vs
concurrency, per backend.

Starts `vllm serve` once per backend, then for each concurrency sends random-token (or, with
--text-ids, real-text) prompts through the
OpenAI-compatible completions API (streaming, outputs forced with ignore_eos); each server is warmed
up first (not measured). The server records every engine step (``HISPARSE_STEP_LOG``, the stat
logger of vllm/step_log.py): decode_tok_s is the rate over the steps in which no request was in
prefill, on the engine's clock (bench/steps.py), running_max/mean the scheduler's own counts; the
hisparse worker's counters (``HISPARSE_STATS_FILE``) give its host time per step (plan, layers).
Writes DIR/serving.csv, PNG plots (throughput vs concurrency, TTFT vs throughput: one line per
backend), the server logs, step records (DIR/steps-BACKEND.jsonl) and the hisparse worker's
counters (DIR/stats-BACKEND.json). Backend ``hisparse`` is the fixed hot buffer
(``resident_first`` off), ``elastic`` the default config (``resident_first`` on:
docs/vllm-integration.md, "Residency states"), so one run compares the two.

    python -m vllm_hisparse.bench.serving --model DIR --input-len 32768 --output-len 512 \
        --concurrency 1,2,4,8,16,32,64,128,256 --backends stock,resident,hisparse \
        --gpu-memory-utilization 0.3 --hisparse '{"top_k":2048,"device_buffer_size":4096}' --out DIR

A DSA model (config.json with ``index_topk``: DeepSeek-V3.2 shapes, bench/model_shapes.py) runs
the DSA path: hisparse's default config is ``DSA_DEFAULT`` (indexer dsa), stock is
FLASH_ATTN_MLA_SPARSE (FLASHMLA_SPARSE with ``-- --kv-cache-dtype fp8_ds_mla``) with every prefill
token through the sparse MQA path as hisparse's (``sparse_mla_force_mqa``); ``hisparse`` decodes
every complete prompt through its row set, ``elastic`` (resident_first) lends a complete prompt
its prefill region until another prompt needs it (core/latent_ledger.py).

``--speculative JSON`` (vLLM's speculative_config, e.g. ngram) serves each backend twice, without
and with it: rows BACKEND and BACKEND+spec with their acceptance, then the TPOT speedups
(bench/serving_spec.py); ``--repeat-block N`` makes each prompt a block of N tokens repeated (a
model that continues the repetition gets its ngram drafts accepted).

Decode-heavy workloads (``--workload``): ``paper`` = 32K in / 8K out (the HiSparse paper's),
``reasoning`` = 1K in / 16K out; ``--concurrency 1,cap`` runs each at one request and at the
backend's capacity (``cap``: read from the server's startup log, see ``capacity``).
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import re
import shutil
import subprocess
import sys

from vllm_hisparse.bench import served_profile
from vllm_hisparse.bench import serving_spec as spec
from vllm_hisparse.bench import steps as st
from vllm_hisparse.bench.serving_load import profiled_point, run_point, warm_up
from vllm_hisparse.core.deployment import STOCK_SERVES
from vllm_hisparse.server_health import stop, wait_healthy

BACKENDS = ("stock", "resident", "hisparse", "elastic")    # elastic: hisparse + resident_first
GQA_DEFAULT = ('{"top_k": 2048, "device_buffer_size": 4096, "dense_pool_gib": 6, '
               '"host_pool_gib": 84, "quest_rows": 22}')
DSA_DEFAULT = '{"indexer": "dsa", "top_k": 2048, "device_buffer_size": 4096, "dense_layers": []}'


def is_dsa(model: str) -> bool:
    """A model folder whose config.json names a DSA indexer (``index_topk``)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            return "index_topk" in json.load(f)
    except (OSError, ValueError):
        return False


def dsa_stock_attention(kv_cache_dtype: str) -> dict:
    """Stock's attention config for a DSA model, as hisparse runs it: FLASHMLA_SPARSE for an
    fp8_ds_mla cache, else FLASH_ATTN_MLA_SPARSE; every prefill token through the sparse MQA path."""
    backend = "FLASHMLA_SPARSE" if kv_cache_dtype == "fp8_ds_mla" else "FLASH_ATTN_MLA_SPARSE"
    return {"backend": backend, "sparse_mla_force_mqa": True}


def dsa_stock_args(extra: list[str]) -> list[str]:
    """``dsa_stock_attention`` as `vllm serve` arguments, the cache dtype read from the extra
    server args."""
    fp8 = any(a in ("fp8_ds_mla", "--kv-cache-dtype=fp8_ds_mla") for a in extra)
    return ["--attention-config", json.dumps(dsa_stock_attention("fp8_ds_mla" if fp8 else "auto"))]
WORKLOADS = {"paper": (32768, 8192), "reasoning": (1024, 16384)}     # (input, output) tokens


def max_model_len(args) -> int:
    return args.input_len + args.output_len + 16


def max_num_seqs(args) -> int:
    """--max-num-seqs, else the largest numeric concurrency (256, vLLM's default, with ``cap``)."""
    if getattr(args, "max_num_seqs", None):
        return args.max_num_seqs
    nums = [c for c in args.concurrency if c != "cap"]
    return 256 if "cap" in args.concurrency else max(nums)


def serve_cmd(args, backend: str, port: int, max_len: int, *, max_seqs: int | None = None,
              prefix_caching: bool = False, extra: list[str] = ()) -> list[str]:
    """`vllm serve` of one backend (BACKENDS) as the benchmarks start it (bench.serving, bench.chat):
    args.model / gpu_memory_utilization / load_format / hisparse / extra_server_args; prefix caching
    off unless asked (the serving benchmark's requests share no prefix; chat's do)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--port", str(port),
           "--max-model-len", str(max_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if not prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if max_seqs is not None:
        cmd += ["--max-num-seqs", str(max_seqs)]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    dsa = getattr(args, "dsa", False)
    if dsa:
        cmd += ["--tokenizer-mode", "hf"]   # the shapes carry the tiny tokenizer (model_shapes.py)
    cfg = backend_config(backend, args.hisparse)
    if cfg is not None:
        cmd += ["--attention-backend", "hisparse", "--additional-config", json.dumps({"hisparse": cfg})]
    elif dsa:
        cmd += dsa_stock_args(args.extra_server_args)
    return cmd + list(extra) + args.extra_server_args


def server_cmd(args, backend: str, port: int, trace_dir: str | None = None,
               extra: list[str] = ()) -> list[str]:
    # --profile-decode: the worker's torch profiler (served_profile)
    prof = ([] if trace_dir is None else
            served_profile.profiler_args(trace_dir, args.profile_delay, args.profile_decode))
    return serve_cmd(args, backend, port, max_model_len(args), max_seqs=max_num_seqs(args),
                     extra=prof + list(extra))


def backend_config(backend: str, hisparse: str) -> dict | None:
    """The hisparse config of a backend (BACKENDS) from the --hisparse JSON; None for stock."""
    if backend == "stock":
        return None
    cfg = json.loads(hisparse)
    if backend == "resident":
        cfg["host_tier"] = False
    if backend == "hisparse":          # the fixed hot buffer: every page through its S slots
        cfg.setdefault("resident_first", False)
    if backend == "elastic":           # the default: resident, spilling only under pressure
        cfg["resident_first"] = True
    return cfg


def capacity(log: str, backend: str, mml: int, seqs: int) -> int:
    """Requests of max_model_len tokens a server runs at once, from its startup log: vLLM's
    "Maximum concurrency for N tokens per request: X" (its KV blocks; for hisparse, S + 1 blocks a
    request) and, for the hisparse backends, the connector's "hisparse: room for N requests" (host /
    dense pool and Quest rows; none where the server said it is stock vLLM); at most max_num_seqs,
    at least 1."""
    m = re.findall(rf"Maximum concurrency for {mml:,} tokens per request: ([\d.]+)x", log)
    if not m:
        raise RuntimeError(f"{backend}: no 'Maximum concurrency for {mml:,} tokens' line in the "
                           f"server log; give numbers to --concurrency instead of cap")
    n = min(int(float(m[-1])), seqs)
    # a hisparse server where no request can be sparse is stock vLLM (setup_check.serve_as_stock):
    # no connector, no room line, vLLM's blocks alone
    stock = backend == "stock" or STOCK_SERVES in log
    if not stock:                # the GQA connector's line, or the DSA ledger's
        room = re.findall(r"hisparse(?: dsa)?: (?:room for|admission of) (\d+) requests", log)
        if not room:
            raise RuntimeError(f"{backend}: no 'hisparse: room for N requests' line in the server "
                               f"log; give numbers to --concurrency instead of cap")
        n = min(n, int(room[-1]))
    return max(n, 1)


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for b in dict.fromkeys(r["backend"] for r in rows):
        rs = sorted((r for r in rows if r["backend"] == b), key=lambda r: r["concurrency"])
        line = ax[0].plot([r["concurrency"] for r in rs], [r["output_tok_s"] for r in rs], "o-", label=b)
        dec = [(r["concurrency"], r["decode_tok_s"]) for r in rs if r.get("decode_tok_s")]
        if dec:                                    # dashed: the decode phase's rate
            ax[0].plot(*zip(*dec), "x--", color=line[0].get_color(), alpha=0.6,
                       label=f"{b} decode only")
        ax[1].plot([r["output_tok_s"] for r in rs], [r["ttft_mean_s"] for r in rs], "o-", label=b)
    ax[0].set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax[1].set(xlabel="output tokens/s", ylabel="mean TTFT (s)", yscale="log", title="TTFT vs throughput")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_backends(p: argparse.ArgumentParser, text: str) -> list[str]:
    """--backends (comma-separated BACKENDS); an unknown one is a usage error."""
    backends = text.split(",")
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        p.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    return backends


def model_vocab(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f).get("vocab_size", 32000)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="decode-heavy presets: " + ", ".join(f"{k} = {i} in / {o} out" for k, (i, o)
                                                             in WORKLOADS.items())
                        + " (--input-len / --output-len override)")
    p.add_argument("--input-len", type=int, default=None, help="default 4096")
    p.add_argument("--output-len", type=int, default=None, help="default 512")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256",
                   help="comma-separated; 'cap' = the backend's capacity, read from its startup log")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vllm serve --max-num-seqs (default: the largest --concurrency; 256 with cap)")
    p.add_argument("--rounds", type=int, default=2, help="requests per point = concurrency x rounds")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hisparse", default=None,
                   help="hisparse config (JSON); with a DSA model the default is DSA_DEFAULT; "
                        "else the default is sized with `hisparse calc` for the "
                        "128 GiB GPU box at 32K and gpu_memory_utilization 0.3: 84 GiB pinned host "
                        "= 22 requests' sparse layers, 22 Quest rows, their two dense layers in a "
                        "6 GiB GPU dense pool (neither reserved when max_model_len < min_context, "
                        "e.g. at 4K: core/gpu_pools.py)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--text-ids", metavar="FILE",
                   help="prompts of real text (token ids of the model's tokenizer: a JSON list, "
                        "lists, or {name: ids} as `bench.quality forced --save-ids` writes), each "
                        "request at its own offset; default: random tokens (with a real model "
                        "use --load-format auto and real text, so the selection is real)")
    p.add_argument("--repeat-block", type=int, default=0, metavar="N",
                   help="each prompt a block of N tokens (real text with --text-ids, each request "
                        "its own window) repeated to --input-len (0: off)")
    p.add_argument("--speculative", default=None, metavar="JSON",
                   help="vLLM's speculative_config: each backend served again with it (rows "
                        "BACKEND+spec, their acceptance, the TPOT speedups; bench/serving_spec.py)")
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--profile-decode", type=int, default=0, metavar="N",
                   help="after the sweep, one more point (the first concurrency, one round, not "
                        "recorded) with N of its engine steps under vLLM's torch profiler "
                        "(bench/served_profile.py): OUT/profile-BACKEND.json")
    p.add_argument("--profile-delay", type=int, default=64,
                   help="engine steps from that point's start to the profile's (past prefill)")
    p.add_argument("--out", default="out/serving")
    p.add_argument("extra_server_args", nargs="*", help="after --: passed to vllm serve")
    args = p.parse_args(argv)
    preset = WORKLOADS.get(args.workload, (4096, 512))
    args.input_len = args.input_len or preset[0]
    args.output_len = args.output_len or preset[1]
    try:
        args.concurrency = [x if x == "cap" else int(x) for x in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency}: numbers or 'cap', comma-separated")
    backends = parse_backends(p, args.backends)
    args.dsa = is_dsa(args.model)
    if args.hisparse is None:
        args.hisparse = DSA_DEFAULT if args.dsa else GQA_DEFAULT
    os.makedirs(args.out, exist_ok=True)
    vocab = model_vocab(args.model)
    rows: list[dict] = []
    servers = spec.runs(backends, args.speculative)   # (backend, row name, extra serve args)
    for i, (b, name, extra) in enumerate(servers):
        ftag = spec.file_tag(name)
        log = open(os.path.join(args.out, f"server-{ftag}.log"), "w")
        k = [n for _, n, _ in servers[:i]].count(name)   # a backend's second server: BACKEND-2
        tag = ftag if k == 0 else f"{ftag}-{k + 1}"
        trace = os.path.abspath(os.path.join(args.out, f"trace-{tag}"))
        shutil.rmtree(trace, ignore_errors=True)
        trace = trace if args.profile_decode else None
        # the worker's counters (hit rate, host pages, host time) and the server's step records
        # land beside the CSV
        stats = os.path.abspath(os.path.join(args.out, f"stats-{ftag}.json"))
        step_log = os.path.abspath(os.path.join(args.out, f"steps-{ftag}.jsonl"))
        for f in (stats, step_log):
            if os.path.exists(f):
                os.remove(f)
        env = dict(os.environ, HISPARSE_STATS_FILE=stats, HISPARSE_STEP_LOG=step_log)
        proc = subprocess.Popen(server_cmd(args, b, args.port, trace, extra), stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(proc, args.port, args.ready_timeout)
            warm_up(args, b, args.port, args.model, vocab, step_log)
            if not st.read(step_log)[0]:
                raise RuntimeError(
                    f"{b}: the server wrote no step records to {step_log}: vLLM did not load the "
                    f"stat logger plugin (entry point vllm.stat_logger_plugins: hisparse_steps); "
                    f"reinstall the package (pip install -e .) or source scripts/gpu_setup.sh")
            first = None
            for c in args.concurrency:
                if c == "cap":
                    log.flush()
                    with open(log.name) as f:
                        c = capacity(f.read(), b, max_model_len(args), max_num_seqs(args))
                    print(f"{b}: capacity {c} requests", flush=True)
                first = c if first is None else first
                before = spec.scrape(args.port) if args.speculative else None
                pt = asyncio.run(run_point(args, name, c, args.port, args.model, vocab, step_log,
                                           None if b == "stock" else stats))
                rows.append(pt.row())
                if before is not None:             # the point's drafts and acceptance
                    rows[-1].update(spec.acceptance(before, spec.scrape(args.port)))
                print(json.dumps(rows[-1]), flush=True)
            if trace:
                profiled_point(args, b, tag, first, vocab, step_log, trace)
        finally:
            stop(proc, timeout=120)
            log.close()
    with open(os.path.join(args.out, "serving.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for line in spec.speedup_lines(rows) if args.speculative else ():
        print(line, flush=True)
    plot(rows, os.path.join(args.out, "serving.png"),
         f"input {args.input_len} / output {args.output_len}, gpu_mem_util {args.gpu_memory_utilization}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
