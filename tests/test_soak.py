"""The soak test (vllm_hisparse/bench/soak.py), short, against a CPU `vllm serve` of the tiny model
sized so that the host pool fills (28 pages; a request reserves up to 7: every one of them may turn
sparse, prompt + max_tokens reaching min_context) and requests get preempted (24 GPU blocks, 6
requests at once): random prompts around min_context, a third of the requests
streamed and abandoned mid-stream. Afterwards the host pool and the GPU blocks are empty, the fixed
greedy prompt gives the tokens it gave before, the server never failed. The load stops as soon as
each of those events has happened (``--until-seen``; at most 60 s), then the drain. The long run for the GPU box: docs/vllm-integration.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE, MIN_CONTEXT, MAX_LEN = 16, 32, 256
POOL_PAGES = 28                                 # one max_model_len request (16 pages) + 12
PAGE_ALL_LAYERS = 2 * PAGE * 2 * 32 * 4 * 4     # K+V, Hkv=2, D=32, fp32, 4 layers


def test_until_seen_waits_for_every_event():
    """--until-seen stops the load only once completed and aborted requests, a wait for host pages
    and a preemption since the start have all been seen; any one missing keeps it going."""
    from types import SimpleNamespace

    from vllm_hisparse.bench.soak import all_seen

    pre = "vllm:num_preemptions_total"
    start = {pre: 3.0}
    every = ({"completed": 2, "aborted": 1}, {"waiting_pool": 1.0}, {pre: 4.0})
    assert all_seen(every[0], SimpleNamespace(peak=every[1], last=every[2]), start)
    for missing in ({"completed": 0, "aborted": 1}, {"completed": 2, "aborted": 0}):
        assert not all_seen(missing, SimpleNamespace(peak=every[1], last=every[2]), start)
    assert not all_seen(every[0], SimpleNamespace(peak={"waiting_pool": 0.0}, last=every[2]), start)
    assert not all_seen(every[0], SimpleNamespace(peak=every[1], last={pre: 3.0}), start)  # none new
    assert not all_seen(every[0], SimpleNamespace(peak=every[1], last={}), start)


@pytest.mark.vllm
@pytest.mark.slow
def test_soak_cpu(tmp_path):
    import socket

    from engine_jobs import tiny_model

    model = tiny_model()
    cfg = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
           "min_context": MIN_CONTEXT, "host_pool_gib": POOL_PAGES * PAGE_ALL_LAYERS / (1 << 30),
           "dense_pool_gib": 0}      # no dense pool: the host pool holds all 4 layers (POOL_PAGES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "vllm_hisparse.bench.soak", "--out", str(out), "--port", str(port),
           "--duration-s", "60", "--until-seen", "--concurrency", "6", "--min-context", str(MIN_CONTEXT),
           "--max-len", str(MAX_LEN), "--max-tokens", "48", "--abort-frac", "0.33",
           "--ref-tokens", "32", "--start-timeout-s", "600",
           "--", model, "--attention-backend", "hisparse", "--additional-config",
           json.dumps({"hisparse": cfg}), "--dtype", "float32", "--max-model-len", str(MAX_LEN),
           "--max-num-seqs", "6", "--max-num-batched-tokens", "256", "--enforce-eager",
           "--num-gpu-blocks-override", "24", "--seed", "0"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, cwd=ROOT)
    res = json.loads((out / "soak.json").read_text())
    log = (out / "serve.log").read_text() if (out / "serve.log").exists() else ""
    assert r.returncode == 0 and res["ok"], json.dumps(res)[:3000] + r.stderr[-2000:] + log[-3000:]
    q = res["requests"]
    assert q["completed"] > 0 and q["aborted"] > 0 and q["errors"] == 0, q
    assert res["pool_full_seen"], res["peaks"]                      # requests waited for pages
    assert res["preemptions"] > 0
    assert res["lookups"] > 0 and res["decode_rows"]["sparse"] > 0 and res["decode_rows"]["dense"] > 0
    assert res["after_drain"] == {"host_pages_used": 0, "host_pages_reserved": 0,
                                  "kv_cache_usage": 0, "running": 0, "waiting": 0}
    assert res["ref_tokens_before"] == res["ref_tokens_after"] and len(res["ref_tokens_after"]) == 32
    assert "hisparse: host pool full" in log
