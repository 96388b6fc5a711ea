"""Host time of the DSA runtime's step plan for decode-only batches of 1, 8 and 32 requests, on
this machine's device (CPU: no H2D copies; CUDA: the copies and launches included), three ways
side by side (docs/dsa.md "The step's host plan"): ``steady`` = LatentRuntime.plan of a steady
decode step (each position one further on: the last plan advanced on the device, one launch),
``one-copy`` = LatentRuntime.plan of a step that is not steady (plan_arrays on the host,
LatentGraphStep.load_arrays: one pinned H2D copy, then the buffers from it), ``tensors`` = the
per-tensor load (LatentStep.plan's device tensors, LatentGraphStep.load), as the runtime planned
before.

    OMP_NUM_THREADS=1 python scripts/dsa_plan_cost.py [cpu|cuda] [--profile]
"""
from __future__ import annotations

import sys
import time

import torch

from vllm_hisparse.core.latent_graph import batch_tokens
from vllm_hisparse.core.latent_ledger import LatentLedger
from vllm_hisparse.core.latent_runtime import LatentRuntime
from vllm_hisparse.core.latent_step import LatentStep


def runtime(D: int, device: str) -> tuple[LatentRuntime, list[str]]:
    """D requests of 3,000-token prompts decoding (up to 1,000 outputs): 4 layers, max_model_len
    4096, B 256, top_k 64."""
    rt = LatentRuntime(4, 4096, 256, D, 1, D * 4200, 8192, D, 64, device=device)  # pinned on CUDA
    led = LatentLedger(D, 1, D * 4200, 4096, False)
    keys = [f"r{i}" for i in range(D)]
    for k in keys:
        assert led.admit(k, 3000, 1000)
        rt.apply(led.take_events())
        rt.plan([k], [0, 1], [1])
        led.prompt_done(k)
    rt.apply(led.take_events())
    return rt, keys


def us_per_plan(D: int, device: str, way: str, n: int = 200) -> float:
    rt, keys = runtime(D, device)
    qsl, seq = list(range(D + 1)), [3001] * D
    rt.plan(keys, qsl, seq)

    def plan():
        if way == "steady":                  # one position further each step: advanced
            seq[:] = [s + 1 for s in seq]
            rt.plan(keys, qsl, seq)
        elif way == "one-copy":              # the same positions again: not steady, planned
            rt.plan(keys, qsl, seq)
        else:
            req, pos = batch_tokens(qsl, seq)
            rt.graph.load(LatentStep.plan(rt.adm, keys, req, pos))
    for _ in range(20):
        plan()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        plan()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def main(argv: list[str]) -> int:
    device = argv[0] if argv and argv[0] in ("cpu", "cuda") else "cpu"
    for D in (1, 8, 32):
        got = {w: us_per_plan(D, device, w) for w in ("steady", "one-copy", "tensors")}
        print(f"{D} decode requests ({device}): " + ", ".join(f"{w} {t:.0f} us a plan"
                                                          for w, t in got.items()))
    if "--profile" in argv:
        import cProfile
        import pstats

        rt, keys = runtime(1, device)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            rt.plan(keys, [0, 1], [3001])
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
