"""bench.step_profile: its analysis against different computations (a millisecond grid for the
union of kernel intervals, per-name sums by hand), and one CPU engine run per backend kind
(a hisparse backend reports the runtime's host time a step; stock does not)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from vllm_hisparse.bench import step_profile as sp


def test_union_matches_a_grid_count():
    rng = random.Random(7)
    for _ in range(50):
        iv = []
        for _ in range(rng.randrange(0, 12)):
            s = rng.randrange(0, 200)
            iv.append((float(s), float(s + rng.randrange(0, 40))))
        covered = set()
        for s, e in iv:
            covered.update(range(int(s), int(e)))
        assert sp.union_us(iv) == len(covered)


def test_kernel_table_sums_by_name_and_orders_by_time():
    rng = random.Random(3)
    names = ["a", "b", "c", "d"]
    ev = [(rng.choice(names), float(i), float(rng.randrange(1, 9))) for i in range(200)]
    steps = 5
    tab = sp.kernel_table(ev, steps)
    assert [r["us_per_step"] for r in tab] == sorted((r["us_per_step"] for r in tab), reverse=True)
    for r in tab:
        mine = [d for n, _, d in ev if n == r["name"]]
        assert r["calls_per_step"] * steps == pytest.approx(len(mine))
        assert r["us_per_step"] * steps == pytest.approx(sum(mine))
    assert {r["name"] for r in tab} == {n for n, _, _ in ev}


def test_diff_joins_by_name_with_missing_as_zero():
    a = [{"name": "x", "us_per_step": 5.0, "calls_per_step": 1.0},
         {"name": "y", "us_per_step": 2.0, "calls_per_step": 2.0}]
    b = [{"name": "x", "us_per_step": 4.0, "calls_per_step": 1.0},
         {"name": "z", "us_per_step": 3.0, "calls_per_step": 1.0}]
    d = {r["name"]: r for r in sp.diff(a, b)}
    assert (d["x"]["delta_us"], d["y"]["delta_us"], d["z"]["delta_us"]) == (-1.0, -2.0, 3.0)
    assert d["y"]["b_calls"] == 0.0 and d["z"]["a_calls"] == 0.0
    assert [r["name"] for r in sp.diff(a, b)] == ["z", "y", "x"]


def test_slow_steps_finds_injected_spikes():
    """Spikes injected every 16th step (from step 5) into noisy times are found with their
    period; the extra share is recounted from the spikes' own sizes."""
    rng = random.Random(1)
    times = [3.0 + rng.uniform(-0.1, 0.1) for _ in range(200)]
    spikes = list(range(5, 200, 16))
    for i in spikes:
        times[i] += 1.5
    r = sp.slow_steps(times)
    assert r["count"] == len(spikes) and r["indices"] == spikes and r["gaps"] == [16]
    med = sorted(times)[100] / 2 + sorted(times)[99] / 2
    want = sum(times[i] - med for i in spikes) / sum(times)
    assert abs(r["extra_share"] - want) < 1e-12
    assert sp.slow_steps([]) == {} and sp.slow_steps([1.0] * 10)["count"] == 0


def test_step_stats():
    st = sp.step_stats([float(x) for x in range(1, 11)])
    assert (st["n"], st["median"], st["mean"], st["p10"], st["p90"]) == (10, 5.5, 5.5, 2.0, 10.0)
    assert sp.step_stats([]) == {}


@pytest.mark.vllm
@pytest.mark.slow
def test_cpu_engine_run_and_diff(tmp_path):
    from vllm_hisparse.tiny_model import build

    model = build(str(tmp_path / "tiny"))
    cfg = json.dumps({"top_k": 48, "device_buffer_size": 64, "page_size": 16, "dense_layers": [0],
                      "host_pool_gib": 0.05, "min_context": 64})
    out = tmp_path / "prof"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    from engine_jobs import run_pooled

    done = run_pooled({backend: ([sys.executable, "-m", "vllm_hisparse.bench.step_profile", "run",
                               "--model", model, "--backend", backend, "--hisparse", cfg,
                               "--input-len", "300", "--rows", "2", "--warm-steps", "2",
                               "--steps", "4", "--profile-steps", "3", "--dtype", "float32",
                               "--out", str(out)]
                              + (["--log-stats", "--no-prefix-caching"] if backend == "elastic"
                                 else []), env)                           # as a server runs
                    for backend in ("elastic", "stock")})             # side by side, kept processes
    for r in done.values():
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    stock, el = (json.load(open(out / f"{b}.json")) for b in ("stock", "elastic"))
    for r in (stock, el):
        assert r["profiled_steps"] >= 3 and r["step_wall_ms"]["n"] >= 1
        assert r["wall_ms_per_step"] > 0 and r["host_ops"]
        assert r["kernels"] == [] and r["gpu_busy_us_per_step"] == 0     # no CUDA here
    assert stock["runtime_host_per_step"] == {} and stock["config"] is None
    assert el["config"]["resident_first"] is True
    assert el["prefix_caching"] is False and stock["prefix_caching"] is True
    assert el["log_stats"] is True and stock["log_stats"] is False
    host = el["runtime_host_per_step"]
    assert host["plan_us"] > 0
    assert host["dense_layers_us"] + host["sparse_layers_us"] + host["full_layers_us"] > 0
    csv_path = tmp_path / "d.csv"
    res = subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.step_profile", "diff",
                          str(out / "stock.json"), str(out / "elastic.json"), "--csv",
                          str(csv_path)], check=True, capture_output=True, text=True, env=env)
    assert "b - a: wall" in res.stdout and csv_path.read_text().startswith("table,")


def test_engine_kwargs_of_a_dsa_model(tmp_path):
    """A DSA model's engines: the hf tokenizer mode, stock on its sparse-MLA backend with every
    prefill token through the sparse MQA path (FLASHMLA_SPARSE with fp8_ds_mla), hisparse with
    its config; a GQA model's unchanged. The DSA runtime's host time and steps are read as the
    GQA runtime's."""
    from types import SimpleNamespace

    from vllm_hisparse.core.latent_runtime import LatentRuntime

    (tmp_path / "config.json").write_text(json.dumps({"index_topk": 2048, "kv_lora_rank": 512}))
    a = SimpleNamespace(model=str(tmp_path), input_len=100, warm_steps=2, steps=3, profile_steps=4,
                        capture_sizes=None, rows=2, load_format="dummy", gpu_memory_utilization=0.5,
                        dtype="auto", log_stats=False, no_prefix_caching=True,
                        max_num_batched_tokens=None, kv_cache_dtype="auto")
    stock = sp.engine_kwargs(a, None, cuda=True)
    assert stock["tokenizer_mode"] == "hf" and stock["max_model_len"] == 141
    assert stock["attention_config"] == {"backend": "FLASH_ATTN_MLA_SPARSE",
                                         "sparse_mla_force_mqa": True}
    a.kv_cache_dtype = "fp8_ds_mla"
    f8 = sp.engine_kwargs(a, None, cuda=True)
    assert f8["attention_config"]["backend"] == "FLASHMLA_SPARSE"
    assert f8["kv_cache_dtype"] == "fp8_ds_mla"
    his = sp.engine_kwargs(a, {"indexer": "dsa"}, cuda=True)
    assert "attention_config" not in his and his["attention_backend"] == "hisparse"
    gqa = sp.engine_kwargs(SimpleNamespace(**{**vars(a), "model": str(tmp_path / "none"),
                                              "kv_cache_dtype": "auto"}), None, cuda=False)
    assert "tokenizer_mode" not in gqa and "attention_config" not in gqa and gqa["enforce_eager"]
    rt = LatentRuntime(1, 64, 16, 1, 1, 100, 32, 2, 8, pin=False)
    rt.plan([None], [0, 0], [0])
    assert sp.steps_of(rt) == 1 and set(rt._host_s) == {"apply", "plan"}
    assert sp.host_since(rt, {"apply": 0.0, "plan": 0.0}, 1, "us")["plan_us"] > 0
