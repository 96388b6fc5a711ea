"""An engine with no hisparse config at all (vLLM's CPU build, the tiny random Llama served at
max_model_len 32768): it sizes its host pool, Quest rows and dense pool itself
(core/auto_size.py), prints one startup line with each tier's size and requests, serves, and
`hisparse calc` given the same machine (the RAM the engine measured, its KV cache size) prints that
line word for word.

One engine (this file as a script, in-process engine core) in one of the session's kept engine
processes (tests/engine_jobs.py, run_pooled).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PY = sys.executable
GIB = 1 << 30
MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_TOKENS = 32768, 4, 8
KV_BYTES = 256 << 20                     # --kv-cache-memory-bytes: the CPU run's KV cache


def probe(model: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_hisparse.vllm.deployment import deployment_of
    from vllm_hisparse.vllm.plugin import register

    register()
    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              enforce_eager=True, seed=0, attention_backend="hisparse",
              kv_cache_memory_bytes=KV_BYTES,
              hf_overrides={"max_position_embeddings": MAX_MODEL_LEN})   # the model says 4096
    vc = llm.llm_engine.vllm_config
    assert "hisparse" not in (vc.additional_config or {})
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (o,) = llm.generate([{"prompt_token_ids": [3 + i % 500 for i in range(40)]}], sp,
                        use_tqdm=False)
    dep = deployment_of(vc)
    m = dep.limits.machine
    with open(out, "w") as f:
        json.dump({"generated": len(o.outputs[0].token_ids), "auto": list(dep.auto),
                   "host_ram_bytes": m.host_available_bytes, "gpu_kv_bytes": m.gpu_kv_bytes,
                   "rows": dep.indexer_rows, "host_pages": dep.host_pages,
                   "dense_pool_pages": dep.dense_pool_pages}, f)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engine_jobs import engine_env, run_script, tiny_model

    model = tiny_model()
    env = engine_env(VLLM_CPU_KVCACHE_SPACE=None)     # it would replace kv_cache_memory_bytes
    out = run_script(__file__, tmp_path_factory.mktemp("auto_engine"), {"engine": [model]}, env,
                     timeout=400)
    res = out["engine"]
    res["log"], res["model"] = out.log("engine"), model
    return res


def test_no_config_sizes_itself_prints_one_line_and_serves(engine):
    e = engine
    assert e["generated"] == MAX_TOKENS
    assert e["auto"] == ["host_pool_gib", "quest_rows", "dense_pool_gib"]
    assert e["gpu_kv_bytes"] == KV_BYTES
    (line,) = re.findall(r"hisparse: room for [^\n]*", e["log"])
    # the KV cache (32 KiB blocks) runs 1 + (8192 - 1 - 2049) // 257 = 24 requests of 32K: the
    # max_num_seqs cap binds the rows; the pools hold what those rows fill (2048 pages each)
    assert e["rows"] == MAX_NUM_SEQS and e["host_pages"] == e["dense_pool_pages"] == 4 * 2048
    assert line.startswith(f"hisparse: room for {MAX_NUM_SEQS} requests of max_model_len=32768")
    # 8192 pages of 2 layers x 8 KiB = 128 MiB each, printed as 0.12 GiB
    for part in ("quest_rows=4 auto", "host pool 0.12 GiB auto: 8192 pages = 4 requests",
                 "GPU dense pool 0.12 GiB auto: 8192 pages = 4 requests",
                 "GPU KV 0.25 GiB (kv_cache_memory_bytes): 24 requests", "host RAM available"):
        assert part in line


def test_calc_prints_the_engine_line(engine):
    e = engine
    args = ["--model", e["model"], "--context", MAX_MODEL_LEN, "--dtype", "fp32",
            "--max-num-seqs", MAX_NUM_SEQS, "--gpu-kv-gib", repr(KV_BYTES / GIB), "--explicit-kv",
            "--host-ram-gib", repr(e["host_ram_bytes"] / GIB), "--json"]   # exact: bytes / 2^30
    r = subprocess.run([PY, "-m", "vllm_hisparse.cli", "calc", *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    h = json.loads(r.stdout)["hisparse"]
    assert re.findall(r"hisparse: room for [^\n]*", e["log"]) == [h["startup_line"]]
    assert h["quest_rows"] == MAX_NUM_SEQS and set(h["auto"]) == set(e["auto"])


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2])
