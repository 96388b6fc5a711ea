"""fp8 (e4m3) KV through vLLM 0.26's CPU engine (``kv_cache_dtype="fp8"``, the tiny Llama):
vLLM allocates the fp8 cache, the backend quantizes each layer's K/V with the layer's scales and
every hisparse tier holds the fp8 bytes (ops/fp8.py). hisparse (host tier, the fixed hot buffer:
misses every step) == resident mode with the same fp8 cache, tokens and logprobs bit for bit; the
negative control (every host fetch reads its neighbour page, HISPARSE_TEST_CORRUPT_FETCH=1) must
differ. Each run reports the dtypes of the cache and host pool it held. The three engines run side
by side in the session's kept engine processes (tests/engine_jobs.py, run_pooled); this file is
also their script (``python tests/test_fp8_engine.py CONFIG OUT KV_CACHE_DTYPE``)."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": 16, "dense_layers": [0],
       "host_pool_gib": 0.05, "resident_first": False, "dense_pool_gib": 0, "min_context": 0}
PROMPT_LENS = (150, 333, 90)                 # 10-21 pages against 4 hot slots: misses
MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    import random
    rng = random.Random(8)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


def _engine(cfg: dict, out: str, kv_cache_dtype: str) -> None:
    """One engine: the prompts at once, greedy; tokens, logprobs, the worker runtime's stats and
    the KV tiers' dtypes to ``out``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.plugin import register

    from engine_jobs import SAME_SCHEDULE
    register()
    llm = LLM(model=os.path.join(ROOT, "models", "tiny-llama"), dtype="float32",
              max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256, enforce_eager=True,
              seed=0, skip_tokenizer_init=True, attention_backend="hisparse",
              kv_cache_dtype=kv_cache_dtype, additional_config={"hisparse": cfg},
              **SAME_SCHEDULE)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True,
                        detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], sp, use_tqdm=False)
    rt = worker_state.get_runtime()
    stats = rt.stats_dict()
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
           "logprobs": [[sorted([k, v.logprob] for k, v in d.items())
                         for d in o.outputs[0].logprobs] for o in outs],
           "stats": {k: stats[k] for k in ("decode_rows", "hits", "misses")},
           "dtypes": {"cache": str(rt.kv_cache(1).dtype),
                      "host": str(rt.host_layer(1).dtype) if rt.pool is not None else None}}
    if rt.pool is not None:        # what the pool pins, and one page of all its layers
        d = rt.pool.data
        res["pool"] = {"bytes": d.numel() * d.element_size(),
                       "page_all": d[:, 0].numel() * d.element_size()}
    with open(out, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from engine_jobs import run_pooled

    from engine_jobs import tiny_model

    tiny_model()
    tmp = tmp_path_factory.mktemp("fp8")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("HISPARSE_TEST_CORRUPT_FETCH", None)
    jobs = {tag: ([sys.executable, __file__, json.dumps(cfg), str(tmp / f"{tag}.json"), dt],
                  dict(env, **extra))
            for tag, cfg, dt, extra in (
                ("hisparse", CFG, "fp8", {}),
                ("resident", dict(CFG, host_tier=False), "fp8", {}),
                ("corrupt", CFG, "fp8", {"HISPARSE_TEST_CORRUPT_FETCH": "1"}))}
    done = run_pooled(jobs, timeout=400)

    def get(tag):
        r = done[tag]
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-5000:]
        return json.loads((tmp / f"{tag}.json").read_text())
    return get


def test_fp8_hisparse_equals_resident(runs):
    hs, res = runs("hisparse"), runs("resident")
    assert hs["dtypes"] == {"cache": "torch.float8_e4m3fn", "host": "torch.float8_e4m3fn"}
    assert res["dtypes"]["cache"] == "torch.float8_e4m3fn"
    assert hs["stats"]["misses"] > 0 and res["stats"]["misses"] == 0
    assert hs["tokens"] == res["tokens"]
    assert hs["logprobs"] == res["logprobs"]          # bit for bit (floats through JSON)


def test_fp8_host_pool_pins_its_whole_gib(runs):
    """host_pool_gib counts fp8 pages at 1 byte a value (issue 45): the pool pins host_pool_gib
    less under one page of its layers, not half of it as pages of the model dtype would."""
    p, gib = runs("hisparse")["pool"], CFG["host_pool_gib"] * (1 << 30)
    assert gib - p["page_all"] < p["bytes"] <= gib


def test_fp8_corrupted_fetch_differs(runs):
    bad, res = runs("corrupt"), runs("resident")
    assert bad["stats"]["misses"] > 0
    from control_steps import CONTROL_STEPS, differing, requests

    toks, steps = differing(requests(res), requests(bad))
    # clearly, not by one step's rounding
    assert toks or steps >= CONTROL_STEPS, f"the negative control: {steps} steps differ"
    print("negative control: steps whose logprobs differ:", steps)



if __name__ == "__main__":
    _engine(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
