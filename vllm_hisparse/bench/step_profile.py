"""Where a decode step's time goes, per backend: one vLLM engine in this process, ``--rows`` prompts
of ``--input-len`` tokens, then decode steps, first timed (wall ms a step, no profiler), then a
window of them under the torch profiler: every GPU activity CUPTI records (kernels, those a CUDA
graph replays included, and memcpy / memset) by name with its count and µs a step, the GPU's busy time a step (the union of the kernels'
intervals), the host's top ops, and the hisparse runtime's host time a step (plan, layers). ``diff``
lines two runs up kernel by kernel, largest difference first: what one backend's step does that the
other's does not.

    python -m vllm_hisparse.bench.step_profile run --model DIR --backend elastic \\
        --input-len 32768 --steps 200 --profile-steps 30 --load-format dummy \\
        --hisparse '{"host_pool_gib": 8, "quest_rows": 2, "dense_pool_gib": 1}' --out OUT
    python -m vllm_hisparse.bench.step_profile diff OUT/resident.json OUT/elastic.json

Backends as ``bench.serving`` (stock, resident, hisparse, elastic). A DSA model (issue 46: the
decode step at 32K for 1, 8 and 32 rows against stock FLASH_ATTN_MLA_SPARSE) runs as there:

    python -m vllm_hisparse.bench.step_profile run --model DIR --backend hisparse --rows 8 \
        --input-len 32768 --load-format scaled_dummy --gpu-memory-utilization 0.9 \
        --hisparse '{"indexer": "dsa", "top_k": 2048, "device_buffer_size": 4096,
                     "dense_layers": [], "prefill_slots": 4}' --out OUT

(the DSA runtime's host time a step is its ``apply`` and ``plan``; its layers run in the graph).
``--log-stats``: vLLM's per-step stats on (the connector's reports among them), as a server has
them; off by default, as in ``LLM``.
``--no-prefix-caching`` and ``--capture-sizes 1,2``: as ``bench.serving``'s servers of one request.
``run`` writes OUT/BACKEND.json (summary and tables) and OUT/BACKEND-kernels.csv. On a machine
without CUDA the kernel table is empty and the host table (CPU ops, self time) is what there is.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import time

from vllm_hisparse.bench.profile_tables import diff, kernel_table, print_diff, union_us
from vllm_hisparse.bench.serving import BACKENDS, backend_config, dsa_stock_attention, is_dsa

TOP_HOST_OPS = 40


# ---- analysis (pure) ---------------------------------------------------------------------------
def step_stats(times_ms: list[float]) -> dict:
    """median / mean / p10 / p90 of per-step wall times (ms)."""
    if not times_ms:
        return {}
    q = sorted(times_ms)
    pick = lambda f: q[min(len(q) - 1, int(f * len(q)))]      # noqa: E731
    return {"n": len(q), "median": statistics.median(q), "mean": statistics.fmean(q),
            "p10": pick(0.1), "p90": pick(0.9)}


def slow_steps(times_ms: list[float], factor: float = 1.25) -> dict:
    """The steps slower than ``factor`` x the median: how many, their indices in the timed window,
    the share of the window's time they take beyond the median, and the gaps between them (a
    period, e.g. the page size, names what they wait for)."""
    if not times_ms:
        return {}
    med = statistics.median(times_ms)
    idx = [i for i, t in enumerate(times_ms) if t > factor * med]
    extra = sum(times_ms[i] - med for i in idx)
    return {"factor": factor, "count": len(idx), "indices": idx[:64],
            "extra_share": extra / sum(times_ms),
            "gaps": sorted({b - a for a, b in zip(idx, idx[1:])})[:16]}


# ---- the engine run ----------------------------------------------------------------------------
def _profiler_events(prof) -> tuple[list, list]:
    """(kernel events (name, start, dur) µs, host ops table rows) of a finished torch profiler."""
    from torch.autograd import DeviceType

    kernels = [(e.name, e.time_range.start, e.time_range.end - e.time_range.start)
               for e in prof.events() if e.device_type == DeviceType.CUDA]
    host = [(k.key, k.count, k.self_cpu_time_total) for k in prof.key_averages()
            if k.self_cpu_time_total > 0]
    return kernels, host


def engine_kwargs(a, cfg: dict | None, cuda: bool) -> dict:
    """``LLM`` keyword arguments of a backend's engine (cfg: its hisparse config, None = stock). A
    DSA model (bench.serving.is_dsa) gets the hf tokenizer mode of the model shapes, its
    kv_cache_dtype, and stock's sparse-MLA backend with every prefill token through the sparse
    MQA path, as hisparse runs (FLASHMLA_SPARSE for fp8_ds_mla)."""
    mml = a.input_len + getattr(a, "warm_steps", 0) + getattr(a, "steps", 0) \
        + getattr(a, "profile_steps", 0) + 32
    sizes = a.capture_sizes or [1 << i for i in range(0, 10) if (1 << i) < 2 * a.rows]
    kw = dict(max_model_len=mml, max_num_seqs=a.rows, seed=0, skip_tokenizer_init=True,
              load_format=a.load_format, gpu_memory_utilization=a.gpu_memory_utilization,
              enforce_eager=not cuda, dtype=a.dtype,
              disable_log_stats=not getattr(a, "log_stats", False),
              enable_prefix_caching=not a.no_prefix_caching)
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if cuda:
        kw["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    if getattr(a, "kv_cache_dtype", "auto") != "auto":
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    if is_dsa(a.model):
        kw["tokenizer_mode"] = "hf"
        if cfg is None:
            kw["attention_config"] = dsa_stock_attention(getattr(a, "kv_cache_dtype", "auto"))
    if cfg is not None:
        kw.update(attention_backend="hisparse", additional_config={"hisparse": cfg})
    return kw


def engine(a, cfg: dict | None):
    import torch
    from vllm import LLM

    from vllm_hisparse.vllm.plugin import register

    register()
    return LLM(a.model, **engine_kwargs(a, cfg, torch.cuda.is_available()))


def runtime():
    from vllm_hisparse.vllm import worker_state
    return worker_state.runtime


def steps_of(rt) -> int:
    """Steps the runtime planned (the GQA runtime's ``stats`` dict; the DSA runtime's ``steps``)."""
    return rt.stats["steps"] if isinstance(getattr(rt, "stats", None), dict) else rt.steps


def host_since(rt, before: dict | None, per: int, unit: str) -> dict:
    """The runtime's host time (plan, layers) since ``before`` (``dict(rt._host_s)`` then) over
    ``per`` units of work, keyed NAME_UNIT in ``unit`` ("us" or "ms"); {} without a runtime."""
    if rt is None:
        return {}
    scale = {"us": 1e6, "ms": 1e3}[unit] / max(per, 1)
    return {f"{k}_{unit}": (t - (before or {}).get(k, 0.0)) * scale for k, t in rt._host_s.items()}


def run(a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")    # the worker in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = backend_config(a.backend, a.hisparse)
    llm = engine(a, cfg)
    eng = llm.llm_engine
    vocab = json.load(open(os.path.join(a.model, "config.json"))).get("vocab_size", 32000)
    rng = random.Random(0)
    total = a.warm_steps + a.steps + a.profile_steps + 16     # slack: rows finish after the window
    sp = SamplingParams(max_tokens=total, ignore_eos=True, temperature=0.0)
    for i in range(a.rows):
        ids = [rng.randrange(min(1000, vocab // 4), vocab - 1) for _ in range(a.input_len)]
        eng.add_request(str(i), TokensPrompt(prompt_token_ids=ids), sp)
    made = dict.fromkeys(map(str, range(a.rows)), 0)

    def step() -> int:
        """One engine step; the fewest tokens any row has made so far."""
        for o in eng.step():
            made[o.request_id] = len(o.outputs[0].token_ids)
        return min(made.values())

    def until(n: int, times: list | None = None) -> int:
        have, t = min(made.values()), time.perf_counter()
        while have < n:
            got = step()
            if got > have and times is not None:
                now = time.perf_counter()
                times.append((now - t) * 1e3 / (got - have))
                t = now
            have = got
        return have

    cuda = torch.cuda.is_available()
    t_start = time.perf_counter()
    until(a.warm_steps)
    prefill_s = time.perf_counter() - t_start
    rt = runtime()
    host0 = dict(rt._host_s) if rt is not None else {}
    steps0 = steps_of(rt) if rt is not None else 0
    times: list[float] = []
    t0, n0 = time.perf_counter(), min(made.values())
    n1 = until(a.warm_steps + a.steps, times)
    wall_ms = (time.perf_counter() - t0) * 1e3 / max(n1 - n0, 1)
    host = host_since(rt, host0, steps_of(rt) - steps0 if rt is not None else 0, "us")
    out = {"backend": a.backend, "config": cfg, "input_len": a.input_len, "rows": a.rows,
           "log_stats": a.log_stats, "prefix_caching": not a.no_prefix_caching,
           "capture_sizes": a.capture_sizes,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "prefill_s": round(prefill_s, 2), "step_wall_ms": step_stats(times),
           "step_walls_ms": [round(t, 4) for t in times], "slow_steps": slow_steps(times),
           "wall_ms_per_step": wall_ms, "runtime_host_per_step": host, "profiled_steps": 0,
           "gpu_busy_us_per_step": 0.0, "kernels_per_step": 0.0, "kernels": [], "host_ops": []}
    _write(a, out)                  # the timing stands even if the profiler fails below

    def window() -> int:
        """profile_steps more decode steps; the steps run."""
        p0 = min(made.values())
        return until(p0 + a.profile_steps) - p0

    try:
        out.update(profile(window, cuda))
    except Exception as e:          # noqa: BLE001  (recorded: the timing above is still worth having)
        out["profile_error"] = f"{type(e).__name__}: {e}"
    for rid in made:
        eng.abort_request([rid])
    _write(a, out)
    print(summary_line(out))
    return out


def profile(work, cuda: bool) -> dict:
    """``work()`` under the torch profiler; it returns how many units (decode steps, prefills) it
    ran, and the tables are per unit."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        torch.cuda.synchronize()
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        units = work()
        if cuda:
            torch.cuda.synchronize()
    psteps = max(units, 1)
    kernels, host_ops = _profiler_events(prof)
    htab = sorted(({"name": n, "calls_per_step": c / psteps, "us_per_step": t / psteps}
                   for n, c, t in host_ops), key=lambda r: -r["us_per_step"])[:TOP_HOST_OPS]
    return {"profiled_steps": psteps, "kernels": kernel_table(kernels, psteps), "host_ops": htab,
            "gpu_busy_us_per_step": union_us([(s, s + d) for _, s, d in kernels]) / psteps,
            "kernels_per_step": len(kernels) / psteps}


def _write(a, out: dict) -> None:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.backend}.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(a.out, f"{a.backend}-kernels.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["name", "calls_per_step", "us_per_step"])
        w.writeheader()
        w.writerows(out["kernels"])


def summary_line(r: dict) -> str:
    s = r["step_wall_ms"]
    h = ", ".join(f"{k} {v:.1f}" for k, v in r["runtime_host_per_step"].items() if v)
    return (f"{r['backend']}: {r['rows']} x {r['input_len']}: wall {r['wall_ms_per_step']:.3f} ms a "
            f"step (median {s.get('median', 0):.3f}, p10 {s.get('p10', 0):.3f}, p90 "
            f"{s.get('p90', 0):.3f}); GPU busy {r['gpu_busy_us_per_step']:.1f} us and "
            f"{r['kernels_per_step']:.1f} kernels a step (profiled {r['profiled_steps']}); "
            f"runtime host us a step: {h or '-'}"
            + (f"; {sl['count']} steps over {sl['factor']}x the median ({100 * sl['extra_share']:.1f}% "
               f"of the time), gaps {sl['gaps'][:6]}" if (sl := r.get("slow_steps")) else "")
            + (f"; profile failed: {r['profile_error']}" if r.get("profile_error") else ""))


def show_diff(pa: str, pb: str, top: int = 25) -> list[dict]:
    ra, rb = json.load(open(pa)), json.load(open(pb))
    print(f"a = {summary_line(ra)}\nb = {summary_line(rb)}")
    print(f"b - a: wall {rb['wall_ms_per_step'] - ra['wall_ms_per_step']:+.3f} ms a step, GPU busy "
          f"{rb['gpu_busy_us_per_step'] - ra['gpu_busy_us_per_step']:+.1f} us, kernels "
          f"{rb['kernels_per_step'] - ra['kernels_per_step']:+.1f}")
    rows = []
    for what in ("kernels", "host_ops"):
        d = diff(ra[what], rb[what])
        print_diff(what, d, top)
        rows += [{"table": what, **r} for r in d]
    return rows


def engine_args(r, rows_help: str, out: str) -> None:
    """The engine's arguments (``engine`` reads them), shared with bench.prefill_profile."""
    r.add_argument("--model", required=True)
    r.add_argument("--backend", choices=BACKENDS, required=True)
    r.add_argument("--hisparse", default="{}", help="hisparse config (JSON), as bench.serving")
    r.add_argument("--input-len", type=int, default=32768)
    r.add_argument("--rows", type=int, default=1, help=rows_help)
    r.add_argument("--load-format", default="dummy")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--kv-cache-dtype", default="auto",
                   help="vLLM's --kv-cache-dtype (a DSA model: auto or fp8_ds_mla)")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    r.add_argument("--max-num-batched-tokens", type=int, default=None)
    r.add_argument("--no-prefix-caching", action="store_true",
                   help="prefix caching off, as bench.serving's servers run")
    r.add_argument("--capture-sizes", default=None,
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="CUDA-graph sizes to capture, comma-separated (default: powers of two "
                        "below 2 x rows; a server of --max-num-seqs 1 captures 1,2)")
    r.add_argument("--out", default=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile one backend's decode steps")
    engine_args(r, "requests decoding together", "out/step_profile")
    r.add_argument("--warm-steps", type=int, default=8, help="decode steps before the timed ones")
    r.add_argument("--steps", type=int, default=200, help="decode steps timed (no profiler)")
    r.add_argument("--profile-steps", type=int, default=30, help="decode steps profiled")
    r.add_argument("--log-stats", action="store_true",
                   help="vLLM's per-step stats on, as a server has them (the connector's reports)")
    d = sub.add_parser("diff", help="two runs' tables side by side")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--top", type=int, default=25)
    d.add_argument("--csv", default=None, help="write the whole joined table here")
    a = p.parse_args(argv)
    if a.cmd == "run":
        for name in ("rows", "steps", "profile-steps", "input-len", "warm-steps"):
            if getattr(a, name.replace("-", "_")) < 1:
                p.error(f"--{name} must be at least 1")
        run(a)
        return 0
    rows = show_diff(a.a, a.b, a.top)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["table"])
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
