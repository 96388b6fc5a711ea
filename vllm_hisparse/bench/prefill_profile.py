"""Where a long prompt's prefill time goes, per backend: what ``bench.step_profile`` shows for a
decode step, for the time to the first token. One vLLM engine in this process; a warm-up prefill
(first-use compiles), ``--repeats`` timed prefills of ``--rows`` fresh prompts of ``--input-len``
tokens with one output token each (engine steps from their arrival until they finish: their chunks,
the first token, the finish), then one more under the torch profiler: every GPU activity by name
with its count and µs a prefill, the GPU's busy time, the host's top ops, the hisparse runtime's
host time a prefill. ``diff`` lines two backends up kernel by kernel.

    python -m vllm_hisparse.bench.prefill_profile run --model DIR --backend elastic \\
        --input-len 32768 --load-format dummy --no-prefix-caching --capture-sizes 1,2 \\
        --hisparse '{"host_pool_gib": 8, "quest_rows": 2, "dense_pool_gib": 1}' --out OUT
    python -m vllm_hisparse.bench.prefill_profile diff OUT/stock-prefill.json OUT/elastic-prefill.json

``run`` writes OUT/BACKEND-prefill.json. The prompts differ from each other (fresh random tokens),
so prefix caching never serves one from another.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from vllm_hisparse.bench import step_profile as sp
from vllm_hisparse.bench.profile_tables import diff, print_diff
from vllm_hisparse.bench.serving import backend_config


def run(a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")    # the worker in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = backend_config(a.backend, a.hisparse)
    # step_profile.engine sizes max_model_len from these: the prompt and a few tokens
    a.warm_steps, a.steps, a.profile_steps = 1, 0, 0
    eng = sp.engine(a, cfg).llm_engine
    vocab = json.load(open(os.path.join(a.model, "config.json"))).get("vocab_size", 32000)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    n = 0

    def prefill() -> int:
        """--rows fresh prompts, run until all have their one token; 1 (the unit: a prefill)."""
        nonlocal n
        for _ in range(a.rows):
            ids = [rng.randrange(min(1000, vocab // 4), vocab - 1) for _ in range(a.input_len)]
            eng.add_request(f"p{n}", TokensPrompt(prompt_token_ids=ids), params)
            n += 1
        while eng.has_unfinished_requests():
            eng.step()
        return 1

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prefill()                                                        # warm-up: first-use compiles
    rt = sp.runtime()
    host0 = dict(rt._host_s) if rt is not None else {}
    walls = []
    for _ in range(a.repeats):
        sync()
        t = time.perf_counter()
        prefill()
        sync()
        walls.append((time.perf_counter() - t) * 1e3)
    host = sp.host_since(rt, host0, a.repeats, "ms")
    out = {"backend": a.backend, "config": cfg, "input_len": a.input_len, "rows": a.rows,
           "prefix_caching": not a.no_prefix_caching, "capture_sizes": a.capture_sizes,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "prefill_wall_ms": sp.step_stats(walls), "prefill_walls_ms": [round(w, 3) for w in walls],
           "runtime_host_per_prefill": host, "profiled_steps": 0, "gpu_busy_us_per_step": 0.0,
           "kernels_per_step": 0.0, "kernels": [], "host_ops": []}
    try:
        out.update(sp.profile(prefill, cuda))        # its tables are "a step" = a prefill here
    except Exception as e:          # noqa: BLE001  (recorded: the timing above is still worth having)
        out["profile_error"] = f"{type(e).__name__}: {e}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.backend}-prefill.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(summary_line(out))
    return out


def summary_line(r: dict) -> str:
    w = r["prefill_wall_ms"]
    h = ", ".join(f"{k} {v:.2f}" for k, v in r["runtime_host_per_prefill"].items() if v)
    return (f"{r['backend']}: {r['rows']} x {r['input_len']}: prefill {w.get('median', 0):.1f} ms "
            f"(median of {w.get('n', 0)}; mean {w.get('mean', 0):.1f}); GPU busy "
            f"{r['gpu_busy_us_per_step'] / 1e3:.1f} ms and {r['kernels_per_step']:.0f} kernels a "
            f"prefill; runtime host ms a prefill: {h or '-'}"
            + (f"; profile failed: {r['profile_error']}" if r.get("profile_error") else ""))


def show_diff(pa: str, pb: str, top: int = 25) -> None:
    ra, rb = json.load(open(pa)), json.load(open(pb))
    print(f"a = {summary_line(ra)}\nb = {summary_line(rb)}")
    dw = rb["prefill_wall_ms"].get("median", 0) - ra["prefill_wall_ms"].get("median", 0)
    print(f"b - a: prefill {dw:+.1f} ms, GPU busy "
          f"{(rb['gpu_busy_us_per_step'] - ra['gpu_busy_us_per_step']) / 1e3:+.2f} ms, kernels "
          f"{rb['kernels_per_step'] - ra['kernels_per_step']:+.0f} (tables: µs a prefill)")
    for what in ("kernels", "host_ops"):
        print_diff(what, diff(ra[what], rb[what]), top)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile one backend's prefill")
    sp.engine_args(r, "prompts prefilled together", "out/prefill_profile")
    r.add_argument("--repeats", type=int, default=3, help="timed prefills (no profiler)")
    d = sub.add_parser("diff", help="two runs' tables side by side")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    if a.cmd == "run":
        for name in ("rows", "repeats", "input-len"):
            if getattr(a, name.replace("-", "_")) < 1:
                p.error(f"--{name} must be at least 1")
        a.log_stats = False
        run(a)
        return 0
    show_diff(a.a, a.b, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
