"""A third indexer is one file plus one registry line (issue 44 item 3): tests/recent_indexer.py
(the newest pages win), registered with ``indexers.register`` in the engine's process only, is
served through vLLM 0.26 on the CPU: the config accepts its name, the runtime selects with it, and
the engine generates. A process that has not registered it refuses the name in one line.

The engine runs this file as a script (in-process engine core and worker) in one of the session's
kept engine processes (tests/engine_jobs.py, run_pooled), so the registration never reaches the
pytest process (the built-in registry stays as it is there)."""
from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CFG = {"indexer": "recent", "top_k": 48, "device_buffer_size": 64, "page_size": 16,
       "dense_layers": [0], "host_pool_gib": 0.05, "min_context": 64, "resident_first": False}
PROMPT, MAX_TOKENS = 300, 40


def register() -> None:
    """The one line that serves the indexer."""
    from vllm_hisparse.core import indexers

    indexers.register("recent", "recent_indexer:RecentIndexer", unit="page")


def probe(model: str, out: str) -> None:
    register()
    from vllm import LLM, SamplingParams

    from recent_indexer import RecentIndexer
    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.plugin import register as register_plugin

    register_plugin()
    llm = LLM(model, dtype="float32", max_model_len=512, max_num_seqs=4, block_size=16,
              max_num_batched_tokens=256, enforce_eager=True, seed=0,
              attention_backend="hisparse", additional_config={"hisparse": CFG})
    prompt = [3 + (7 * j) % 500 for j in range(PROMPT)]
    (o,) = llm.generate([{"prompt_token_ids": prompt}],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    rt = worker_state.get_runtime()
    with open(out, "w") as f:
        json.dump({"indexer": type(rt.ix).__name__, "scored": RecentIndexer.scored,
                   "tokens": len(o.outputs[0].token_ids), "stats": rt.stats_dict()}, f)


def test_an_unregistered_indexer_is_refused_in_one_line():
    from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError

    with pytest.raises(HiSparseConfigError, match="indexer.*'recent'.*quest, dsa"):
        HiSparseConfig.load({"indexer": "recent"})


@pytest.mark.vllm
def test_a_test_only_indexer_is_served_through_vllm(tmp_path):
    from engine_jobs import engine_env, run_script, tiny_model

    res = run_script(__file__, tmp_path, {"recent": [tiny_model()]},
                     engine_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    res = res["recent"]
    assert res["indexer"] == "RecentIndexer" and res["tokens"] == MAX_TOKENS
    assert res["scored"] > 0 and res["stats"]["decode_rows"] > 0, res


if __name__ == "__main__":
    probe(*sys.argv[1:])
