"""bench.served_profile: a served worker's trace summarized against a different computation (a
microsecond grid for the GPU's busy time, steps counted from the events as built), the profiler
arguments as vLLM's own CLI parses them, the serving bench's server command, and the
/stop_profile -> trace -> summary round trip against a stand-in server."""
from __future__ import annotations

import gzip
import http.server
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading

import pytest

from vllm_hisparse.bench import served_profile as spf

DECODE = "execute_context_0(0)_generation_{g}({g})"


def synthetic(seed: int, steps: int = 12):
    """A prefill step, then `steps` decode steps (integer µs), each with a few kernels, some
    overlapping, some starting in the previous step; kernels before the window and a memcpy; a
    trailing step of another kind after the last decode step. Returns (events, facts)."""
    rng = random.Random(seed)
    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_1(4096)_generation_0(0)",
           "ts": 0, "dur": 900},
          {"ph": "X", "cat": "kernel", "name": "prefill_gemm", "ts": 100, "dur": 2000}]
    t, starts, hosts = 3000, [], []
    for i in range(steps):
        host = rng.randint(100, 400)
        ev.append({"ph": "X", "cat": "user_annotation", "name": DECODE.format(g=rng.randint(1, 3)),
                   "ts": t, "dur": host})
        starts.append(t)
        hosts.append(host)
        k0 = t + rng.randint(-50, 300)
        for j in range(rng.randint(2, 5)):
            d = rng.randint(20, 600)
            ev.append({"ph": "X", "cat": "kernel", "name": f"k{j}", "ts": k0, "dur": d})
            k0 += rng.randint(-10, d + 40)       # sometimes overlapping, sometimes a gap
        if i % 4 == 0:
            ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": t + 5,
                       "dur": 3})
        t += rng.randint(1500, 2500)
    ev.append({"ph": "X", "cat": "user_annotation", "name": "execute_context_1(512)_generation_1(1)",
               "ts": t, "dur": 200})
    ev.append({"ph": "X", "cat": "kernel", "name": "late", "ts": t + 10, "dur": 50})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t, "dur": 30})
    rng.shuffle(ev)
    return ev, {"starts": starts, "hosts": hosts, "hi": t}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summary_against_a_microsecond_grid(seed):
    ev, f = synthetic(seed)
    r = spf.summarize(ev)
    lo, hi, n = f["starts"][0], f["hi"], len(f["starts"])
    grid = bytearray(hi - lo)
    count = 0
    for e in ev:
        if e["cat"] in ("kernel", "gpu_memcpy") and e["ts"] < hi and e["ts"] + e["dur"] > lo:
            count += 1
            for us in range(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)):
                grid[us - lo] = 1
    assert r["decode_steps"] == n and r["window_us"] == hi - lo
    assert r["gpu_busy_us_per_step"] == pytest.approx(sum(grid) / n)
    assert r["gpu_idle_us_per_step"] == pytest.approx((len(grid) - sum(grid)) / n)
    assert r["kernels_per_step"] == pytest.approx(count / n)
    gaps = [b - a for a, b in zip(f["starts"], f["starts"][1:])]
    assert r["step_interval_us"]["median"] == statistics.median(gaps)
    assert r["execute_host_us"]["mean"] == pytest.approx(statistics.fmean(f["hosts"]))
    names = {k["name"] for k in r["kernels"]}
    assert "prefill_gemm" not in names and "late" not in names and "Memcpy HtoD" in names
    tab = sum(k["us_per_step"] for k in r["kernels"]) * n
    assert tab >= sum(grid) - 1e-6                  # overlaps count in the table, once in busy


def test_no_decode_step():
    assert spf.summarize([{"cat": "user_annotation", "ts": 0, "dur": 5,
                           "name": "execute_context_1(64)_generation_0(0)"}]) == {"decode_steps": 0}


def test_cli_summarize_and_diff(tmp_path):
    for i, seed in enumerate((3, 4)):
        ev, _ = synthetic(seed)
        d = tmp_path / f"t{i}" / "sub"
        d.mkdir(parents=True)
        with gzip.open(d / "worker.123.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": ev}, f)
        out = tmp_path / f"s{i}.json"
        subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.served_profile", "summarize",
                        str(tmp_path / f"t{i}"), "--out", str(out)], check=True, timeout=120)
        assert json.load(open(out))["decode_steps"] == 12
    res = subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.served_profile", "diff",
                          str(tmp_path / "s0.json"), str(tmp_path / "s1.json")],
                         capture_output=True, text=True, check=True, timeout=120)
    assert "decode steps" in res.stdout and " k0" in res.stdout
    os.makedirs(tmp_path / "nothing", exist_ok=True)
    bad = subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.served_profile", "summarize",
                          str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--profiler-config" in bad.stderr


def test_profiler_args_as_vllm_parses_them(tmp_path):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = spf.profiler_args(str(tmp_path / "tr"), delay=64, steps=40)
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", str(tmp_path), *argv])      # a local folder: no hub lookup
    pc = AsyncEngineArgs.from_cli_args(ns).profiler_config
    assert pc.profiler == "torch" and pc.torch_profiler_dir == str(tmp_path / "tr")
    assert (pc.delay_iterations, pc.max_iterations) == (64, 40)
    assert pc.ignore_frontend and not pc.torch_profiler_with_stack


def test_server_cmd_profiles_only_when_asked():
    from types import SimpleNamespace

    from vllm_hisparse.bench.serving import server_cmd
    a = SimpleNamespace(model="/m", input_len=1000, output_len=24, concurrency=[1],
                        gpu_memory_utilization=0.3, load_format="dummy", extra_server_args=[],
                        hisparse='{"top_k": 64}', profile_delay=8, profile_decode=30)
    assert "--profiler-config" not in server_cmd(a, "elastic", 9)
    cmd = server_cmd(a, "elastic", 9, "/tmp/tr")
    cfg = json.loads(cmd[cmd.index("--profiler-config") + 1])
    assert (cfg["torch_profiler_dir"], cfg["delay_iterations"], cfg["max_iterations"]) == \
        ("/tmp/tr", 8, 30)


def test_collect_round_trip(tmp_path):
    """A stand-in server: /stop_profile writes the trace (in two goes, as a large one lands);
    collect waits for it whole and writes the summary."""
    ev, _ = synthetic(5)
    trace_dir = tmp_path / "tr"
    trace_dir.mkdir()
    calls = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            calls.append(self.path)
            if self.path == "/stop_profile":
                data = json.dumps({"traceEvents": ev}).encode()
                p = trace_dir / "w.1.pt.trace.json"
                p.write_bytes(data[:10])
                threading.Timer(1.0, p.write_bytes, (data,)).start()
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        spf.post(port, "/start_profile")
        r = spf.collect(port, str(trace_dir), str(tmp_path / "p.json"), wait_s=30)
    finally:
        srv.shutdown()
    assert calls == ["/start_profile", "/stop_profile"]
    assert r["decode_steps"] == 12 and json.load(open(tmp_path / "p.json")) == r


@pytest.mark.vllm
@pytest.mark.slow
def test_served_cpu_engine_profiled(tmp_path):
    """bench.serving --profile-decode against a real `vllm serve` (CPU, tiny model): the measured
    point is recorded, the profiled one is not, and the worker's trace holds the profiled decode
    steps (vLLM's per-step annotations, as summarize reads them)."""
    from vllm_hisparse.tiny_model import build

    model = build(str(tmp_path / "tiny"))
    out = tmp_path / "srv"
    cfg = json.dumps({"top_k": 8, "device_buffer_size": 16, "page_size": 16,
                      "host_pool_gib": 0.05, "min_context": 64, "dense_layers": []})
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with socket.socket() as s:           # a free port: another run may serve on a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.serving", "--model", model,
                    "--backends", "elastic", "--concurrency", "1", "--rounds", "1",
                    "--input-len", "300", "--output-len", "40", "--load-format", "auto",
                    "--profile-decode", "10", "--profile-delay", "6", "--hisparse", cfg,
                    "--port", str(port), "--out", str(out)], check=True, env=env, timeout=900)
    with open(out / "serving.csv") as f:
        assert len(f.read().strip().splitlines()) == 2          # header + the measured point
    r = json.load(open(out / "profile-elastic.json"))
    assert 5 <= r["decode_steps"] <= 11 and r["execute_host_us"]["median"] > 0
    # (no timing relation asserted: the interval against the host time raced on a loaded CI
    # machine, 10.6 against 13.0 ms; the test checks what was recorded, not how fast)
    assert r["step_interval_us"]["median"] > 0
    assert r["trace"].startswith(str(out / "trace-elastic"))
