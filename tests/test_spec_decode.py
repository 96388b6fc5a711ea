"""ngram speculative decoding with hisparse (issue 47 item 3; core/spec_rows.py), on the real vLLM
0.26 CPU engine: a sparse request's verify rows (verified token + drafts) resolve one selection per
request and attend causally, and hisparse (host tier, 4 hot slots: misses) == resident mode
(``host_tier`` false) with the same speculation: tokens, logprobs and vLLM's acceptance counts.
Prompts repeat a token pattern so that drafts are proposed and accepted. The negative control runs
the same harness with every host fetch reading its neighbour page (HISPARSE_TEST_CORRUPT_FETCH=1):
it must differ. Prefix caching is on in every engine (issue 47's combination with the host tier)
and the prompts run twice: the first batch has no hit, the second is all prefix hits; resident
mode with prefix caching on makes the same hits and schedules the same batches, so both batches
compare bit for bit, the verify rows of a hit's first steps included. The three engines start together in the session's kept engine processes
(tests/engine_jobs.py, run_pooled); this file is also their
script (``python tests/test_spec_decode.py CONFIG [LLM_KWARGS] OUT``).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": 16, "dense_layers": [0],
       "host_pool_gib": 0.05, "resident_first": False, "min_context": 0}
PATTERNS = ([5, 17, 33, 81, 99, 120, 7, 64], [200, 11, 300, 42, 9], [77, 78, 79, 80, 81, 82])
REPEATS = (20, 41, 30)                         # 160, 205, 180 tokens: 10-13 pages, 4 hot slots
MAX_TOKENS = 48
PC = {"enable_prefix_caching": True, "batches": 2}    # prefix caching on, the prompts twice


def _engine(cfg: dict, out: str, over: dict | None = None) -> None:
    """One engine: the prompts at once, greedy; tokens, logprobs, vLLM's spec-decode counters and
    the worker runtime's stats to ``out``. over: LLM keyword arguments replacing the CPU test's
    (a GPU run: model, dtype, enforce_eager; docs/vllm-integration.md, "Speculative decoding")."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.plugin import register

    from engine_jobs import SAME_SCHEDULE
    register()
    kw = dict(model=os.path.join(ROOT, "models", "tiny-llama"), dtype="float32",
              max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256, enforce_eager=True,
              seed=0, skip_tokenizer_init=True, attention_backend="hisparse",
              additional_config={"hisparse": cfg}, disable_log_stats=False,
              speculative_config=SPEC, **SAME_SCHEDULE)
    over = dict(over or {})
    batches = over.pop("batches", 1)         # > 1: the same prompts again (prefix hits if on)
    llm = LLM(**dict(kw, **over))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True,
                        detokenize=False)
    outs, cached = [], []
    for _ in range(batches):
        got = llm.generate([{"prompt_token_ids": p * n} for p, n in zip(PATTERNS, REPEATS)], sp,
                           use_tqdm=False)
        outs += got
        cached.append([o.num_cached_tokens or 0 for o in got])
    metrics = {m.name: m.value for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}
    stats = worker_state.get_runtime().stats_dict()
    res = {"cached": cached,                              # per batch: prefix-hit tokens
           "tokens": [list(o.outputs[0].token_ids) for o in outs],
           "logprobs": [[sorted([k, v.logprob] for k, v in d.items())
                         for d in o.outputs[0].logprobs] for o in outs],
           "spec": metrics, "stats": {k: stats[k] for k in ("spec_rows", "decode_rows", "hits",
                                                            "misses", "prefix_hits")}}
    with open(out, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from engine_jobs import engine_env, run_script, tiny_model

    tiny_model()
    # NUMBA_DISABLE_JIT: the ngram proposer in plain Python (numba compiles it in ~30 s per
    # process, uncached); the same proposals, in both modes alike
    env = engine_env(NUMBA_DISABLE_JIT="1", HISPARSE_TEST_CORRUPT_FETCH=None)
    pc = json.dumps(PC)
    out = run_script(__file__, tmp_path_factory.mktemp("spec"), {
        "hisparse": ([json.dumps(CFG), pc], env),
        "resident": ([json.dumps(dict(CFG, host_tier=False)), pc], env),
        "corrupt": ([json.dumps(CFG), pc], dict(env, HISPARSE_TEST_CORRUPT_FETCH="1"))},
        timeout=300)
    return out.__getitem__


def test_hisparse_equals_resident_under_ngram_speculation(runs):
    hs, res = runs("hisparse"), runs("resident")
    # drafts were proposed and accepted, the same in both modes
    assert hs["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0, hs["spec"]
    assert hs["spec"] == res["spec"]
    # the verify rows went through core/spec_rows.py, with misses from the host pool
    assert hs["stats"]["spec_rows"] > 0 and res["stats"]["spec_rows"] == hs["stats"]["spec_rows"]
    assert hs["stats"]["misses"] > 0 and res["stats"]["misses"] == 0
    assert hs["tokens"] == res["tokens"]
    assert hs["logprobs"] == res["logprobs"]          # bit for bit (floats through JSON)


def test_the_second_batch_is_prefix_hits_in_both_modes(runs):
    """The second batch's requests are prefix hits (their first step fills their Quest row and
    host pages from the hit's GPU blocks) and speculate from their first decode step on; the
    comparison above covers their tokens and logprobs."""
    hs, res = runs("hisparse"), runs("resident")
    first, second = hs["cached"]
    assert max(first) < 16 and min(second) >= 16 and hs["cached"] == res["cached"], hs["cached"]
    assert hs["stats"]["prefix_hits"] == len(PATTERNS)


def test_corrupted_fetch_differs(runs):
    bad, res = runs("corrupt"), runs("resident")
    assert bad["stats"]["misses"] > 0
    from control_steps import CONTROL_STEPS, differing, requests

    toks, steps = differing(requests(res), requests(bad))
    # clearly, not by one step's rounding
    assert toks or steps >= CONTROL_STEPS, f"the negative control: {steps} steps differ"
    print("negative control: steps whose logprobs differ:", steps)


if __name__ == "__main__":
    _engine(json.loads(sys.argv[1]), sys.argv[-1],
            json.loads(sys.argv[2]) if len(sys.argv) == 4 else None)
