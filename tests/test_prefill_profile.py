"""bench.prefill_profile on the CPU engine: a backend's prefill timed and profiled, two diffed."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.vllm
@pytest.mark.slow
def test_cpu_engine_prefill_run_and_diff(tmp_path):
    from vllm_hisparse.tiny_model import build

    model = build(str(tmp_path / "tiny"))
    cfg = json.dumps({"top_k": 48, "device_buffer_size": 64, "page_size": 16, "dense_layers": [0],
                      "host_pool_gib": 0.05, "min_context": 64})
    out = tmp_path / "prof"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    from engine_jobs import run_pooled

    done = run_pooled({backend: ([sys.executable, "-m", "vllm_hisparse.bench.prefill_profile", "run",
                               "--model", model, "--backend", backend, "--hisparse", cfg,
                               "--input-len", "300", "--rows", "2", "--repeats", "2",
                               "--dtype", "float32", "--no-prefix-caching", "--out", str(out)],
                              env)
                    for backend in ("elastic", "stock")})             # side by side, kept processes
    for r in done.values():
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    stock, el = (json.load(open(out / f"{b}-prefill.json")) for b in ("stock", "elastic"))
    for r in (stock, el):
        assert r["prefill_wall_ms"]["n"] == 2 and len(r["prefill_walls_ms"]) == 2
        assert min(r["prefill_walls_ms"]) > 0 and r["profiled_steps"] == 1
        assert r["host_ops"] and r["kernels"] == []                       # no CUDA here
        assert r["prefix_caching"] is False and "profile_error" not in r
    assert stock["runtime_host_per_prefill"] == {} and stock["config"] is None
    host = el["runtime_host_per_prefill"]          # 300 > min_context: the prompts turn sparse
    assert host["sparse_layers_ms"] > 0 and host["dense_layers_ms"] > 0
    assert el["config"]["resident_first"] is True
    res = subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.prefill_profile", "diff",
                          str(out / "stock-prefill.json"), str(out / "elastic-prefill.json")],
                         check=True, capture_output=True, text=True, env=env)
    assert "b - a: prefill" in res.stdout and "-- host_ops" in res.stdout
