"""`hisparse calc` against the real vLLM 0.26 engine (CPU): the figures calc prints are the ones the
engine computes and logs at startup, and the per-request bytes are what a request really holds.

One hisparse engine (tiny random Llama: 4 layers, 2 KV heads x 32, fp32; page 16, B = 4 pages,
max_model_len 256 = 16 pages, 64 Quest rows) runs in a subprocess (this file as a script, in-process
engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0) with an explicit, deliberately odd KV size
(--kv-cache-memory-bytes 5,000,000: 152 blocks, so the concurrency is not a round number), serves one
request of 200 + 56 = max_model_len tokens, and writes what vLLM and the runtime hold to JSON.

On a GPU vLLM profiles memory after the model is built, so hisparse's KV cache gets the stock KV
budget minus the Quest rows; an explicit KV size (what a CPU run needs) is used as is. So calc is
given the engine's KV bytes plus the Quest bytes the engine really allocated — the stock budget of
the same run on a GPU — and must land on the engine's KV cache exactly.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PY = sys.executable
GIB = 1 << 30
PAGE, MAX_MODEL_LEN, MAX_NUM_SEQS = 16, 256, 64
KV_BYTES = 5_000_000
PROMPT, MAX_TOKENS = 200, 56                # one request of exactly max_model_len tokens
CFG = {"top_k": 32, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "host_pool_gib": 0.02, "resident_first": False,   # the floor calc counts
       "quest_rows": 0, "dense_pool_gib": 0}   # given: max_num_seqs rows, no dense pool (the auto
                                               # sizes: tests/test_auto_size_engine.py)


def probe(model: str, out: str) -> None:
    """Run in a fresh process: start the engine, serve one request, dump what vLLM computed."""
    import dataclasses

    from vllm import LLM, SamplingParams
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from vllm_hisparse.vllm.plugin import register

    register()
    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.spec import HiSparseManager

    peak = {"gpu_blocks": 0, "host_pages": 0, "host_reserved": 0}
    orig = HiSparseManager.remove_skipped_blocks

    def spy(self, request_id, processed, num_prompt_tokens=None):   # blocks held after prefill
        orig(self, request_id, processed, num_prompt_tokens)
        if num_prompt_tokens is not None and processed > num_prompt_tokens:
            real = sum(not b.is_null for b in self.req_to_blocks.get(request_id, ()))
            peak["gpu_blocks"] = max(peak["gpu_blocks"], real)

    HiSparseManager.remove_skipped_blocks = spy
    from vllm_hisparse.config import HiSparseConfig

    parses, post_init = [], HiSparseConfig.__post_init__

    def counted(self):                           # every HiSparseConfig built is one parse
        parses.append(1)
        post_init(self)

    HiSparseConfig.__post_init__ = counted
    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=256, enforce_eager=True, seed=0, attention_backend="hisparse",
              additional_config={"hisparse": CFG}, kv_cache_memory_bytes=KV_BYTES)
    core = llm.llm_engine.engine_core.engine_core
    vc, kvc = llm.llm_engine.vllm_config, core.scheduler.kv_cache_config
    (group,) = kvc.kv_cache_groups
    spec = group.kv_cache_spec
    tokens, conc = get_kv_cache_capacity(vc, kvc)
    # vLLM's own figures for a stock full-attention spec on the same blocks
    stock = FullAttentionSpec(**{f.name: getattr(spec, f.name)
                                 for f in dataclasses.fields(FullAttentionSpec)})
    stock_tokens, stock_conc = get_kv_cache_capacity(
        vc, dataclasses.replace(kvc, kv_cache_groups=[KVCacheGroupSpec(group.layer_names, stock)]))

    rt, conn = worker_state.get_runtime(), core.scheduler.connector

    def spy_plan(orig):                             # host pages after each step's growth
        def plan(*a, **k):
            p = orig(*a, **k)
            peak["host_pages"] = max(peak["host_pages"], rt.host_pages_used)
            peak["host_reserved"] = max(peak["host_reserved"], conn._reserved_total)
            return p
        return plan

    rt.plan, rt.plan_full = spy_plan(rt.plan), spy_plan(rt.plan_full)   # eager and decode steps
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (o,) = llm.generate([{"prompt_token_ids": [3 + i % 500 for i in range(PROMPT)]}], sp,
                        use_tqdm=False)
    kmin, kmax = worker_state.indexer_state
    quest = [t for t in kmin + kmax if t is not None]
    res = {
        "num_blocks": kvc.num_blocks, "num_layers": len(group.layer_names),
        "page_size_bytes": spec.page_size_bytes, "block_size": spec.block_size,
        "kv_tensor_bytes": sum(t.size for t in kvc.kv_cache_tensors),
        "spec_max_memory_usage_bytes": spec.max_memory_usage_bytes(vc),
        "kv_cache_tokens": tokens, "max_concurrency": conc,
        "stock_kv_cache_tokens": stock_tokens, "stock_max_concurrency": stock_conc,
        "quest_bytes": sum(t.numel() * t.element_size() for t in quest),
        "quest_rows": sorted({t.shape[0] for t in quest}),
        "pool_pages": rt.pool.num_pages, "pool_layers": rt.pool.data.shape[0],
        "pool_page_bytes": rt.pool.data[0, 0].numel() * rt.pool.data.element_size(),
        "connector_capacity": conn.capacity, "generated": len(o.outputs[0].token_ids), **peak,
        "config_parses": len(parses),
    }
    with open(out, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engine_jobs import tiny_model

    model, out = tiny_model(), tmp_path_factory.mktemp("calc_engine") / "engine.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)            # it would replace kv_cache_memory_bytes
    r = subprocess.run([PY, os.path.abspath(__file__), model, str(out)], capture_output=True,
                       text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads(out.read_text())
    res["log"], res["model"] = r.stdout + r.stderr, model
    return res


def calc(model: str, gpu_bytes: int, *extra) -> dict:
    args = ["--model", model, "--context", MAX_MODEL_LEN, "--dtype", "fp32", "--page-size", PAGE,
            "--top-k", CFG["top_k"], "--buffer", CFG["device_buffer_size"],
            "--dense-layers", len(CFG["dense_layers"]), "--host-gib", CFG["host_pool_gib"],
            "--quest-rows", CFG["quest_rows"], "--dense-pool-gib", CFG["dense_pool_gib"],
            "--gpu-kv-gib", repr(gpu_bytes / GIB), *extra, "--json"]   # exact: bytes / 2^30
    r = subprocess.run([PY, "-m", "vllm_hisparse.cli", "calc", *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def logged(log: str) -> tuple[int, str]:
    """vLLM's startup lines: (KV cache tokens, concurrency as printed)."""
    tokens = re.findall(r"GPU KV cache size: ([\d,]+) tokens", log)
    conc = re.findall(rf"Maximum concurrency for {MAX_MODEL_LEN:,} tokens per request: ([\d.]+)x", log)
    assert len(tokens) == 1 and len(conc) == 1, (tokens, conc)
    return int(tokens[0].replace(",", "")), conc[0]


def test_hisparse_matches_engine(engine):
    e = engine
    out = calc(e["model"], KV_BYTES + e["quest_bytes"], "--max-num-seqs", MAX_NUM_SEQS,
               "--max-num-batched-tokens", 256, "--no-resident-first")
    h = out["hisparse"]
    # the Quest rows: what the engine allocated, for max_num_seqs rows
    assert e["quest_rows"] == [MAX_NUM_SEQS + 1]           # + the runtime's scratch row
    assert h["quest_meta_bytes"] == e["quest_bytes"] == (MAX_NUM_SEQS + 1) * h["quest_meta_bytes_per_request"]
    # the KV cache: same blocks, same bytes
    assert (h["num_blocks"], h["kv_cache_bytes"]) == (e["num_blocks"], KV_BYTES)
    assert e["num_blocks"] * e["page_size_bytes"] * e["num_layers"] == e["kv_tensor_bytes"]
    # per request: the spec's bound x layers, and what the request really held after its prefill
    assert h["gpu_bytes_per_request"] == e["num_layers"] * e["spec_max_memory_usage_bytes"]
    assert h["gpu_bytes_per_request"] == e["gpu_blocks"] * e["page_size_bytes"] * e["num_layers"]
    assert e["gpu_blocks"] == CFG["device_buffer_size"] // PAGE + 1
    # vLLM's two startup lines, from its objects and from its log
    assert h["vllm_max_concurrency"] == e["max_concurrency"]
    assert h["vllm_kv_cache_tokens"] == e["kv_cache_tokens"]
    assert logged(e["log"]) == (h["vllm_kv_cache_tokens"], f"{h['vllm_max_concurrency']:.2f}")
    # this config is GPU-bound and the engine's concurrency is not a whole number
    assert h["bound_by"] == "gpu" and e["max_concurrency"] % 1
    # N - 1 requests at the floor while the last one admitted holds its whole prompt (vLLM's
    # scheduler_reserve_full_isl): fewer than vLLM's concurrency line, which counts every one at
    # its floor
    pages = -(-MAX_MODEL_LEN // PAGE)
    assert h["max_requests"] == 1 + (e["num_blocks"] - 1 - pages) // e["gpu_blocks"]
    assert h["max_requests"] < int(e["max_concurrency"]) == (e["num_blocks"] - 1) // e["gpu_blocks"]


def test_host_matches_runtime(engine):
    e = engine
    h = calc(e["model"], KV_BYTES + e["quest_bytes"], "--max-num-seqs", MAX_NUM_SEQS)["hisparse"]
    assert e["generated"] == MAX_TOKENS
    # the pool holds every layer; a request reserves all its pages at admission and fills them
    assert e["pool_layers"] == e["num_layers"]
    assert h["host_pool_pages"] == e["pool_pages"] == e["connector_capacity"]
    assert h["host_bytes_per_request"] == e["host_reserved"] * e["pool_layers"] * e["pool_page_bytes"]
    assert e["host_pages"] == e["host_reserved"] == -(-MAX_MODEL_LEN // PAGE)
    assert e["pool_page_bytes"] == e["page_size_bytes"]       # a host page = a GPU block


def test_one_config_parse_and_calc_prints_the_startup_line(engine):
    """Starting the engine (front end, engine core and worker in one process here) and serving a
    request parsed the hisparse config once (vllm/deployment.py keeps it on the VllmConfig); calc
    prints the connector's startup line word for word (both are Deployment.room_line), given the
    engine's KV size as vLLM takes it (--kv-cache-memory-bytes: the reservations come on top)."""
    e = engine
    assert e["config_parses"] == 1
    h = calc(e["model"], KV_BYTES, "--explicit-kv", "--max-num-seqs", MAX_NUM_SEQS,
             "--no-resident-first")["hisparse"]
    assert "; GPU KV 4.8 MiB (kv_cache_memory_bytes): " in h["startup_line"]
    assert re.findall(r"hisparse: room for [^\n]*", e["log"]) == [h["startup_line"]]


def test_stock_lines_match_vllm(engine):
    """calc's stock lines against vLLM's own computation for a full-attention spec on the same
    blocks (no second engine: the stock sizing is also checked against an H200 in test_calc.py)."""
    e = engine
    b = calc(e["model"], KV_BYTES, "--max-num-seqs", MAX_NUM_SEQS)["baseline"]
    assert b["num_blocks"] == e["num_blocks"]
    assert b["vllm_max_concurrency"] == e["stock_max_concurrency"]
    assert b["vllm_kv_cache_tokens"] == e["stock_kv_cache_tokens"]
    assert b["max_requests"] == (e["num_blocks"] - 1) // -(-MAX_MODEL_LEN // PAGE)


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2])
