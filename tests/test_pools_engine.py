"""issue 14 item 5 through the real vLLM 0.26 engine (CPU): the GPU pools of sparse requests do not
starve short work, with one config for both loads (a dense pool and Quest rows sized for long
requests, as bench/serving.py's).

Each engine runs this file as a script (in-process engine core) in one of the session's kept
engine processes, the three side by side (tests/engine_jobs.py, run_pooled). On a GPU vLLM profiles memory after the model is built, so
hisparse's KV cache is stock's budget less what the backend reserved while it was built (Quest
rows, dense pool); on the CPU the KV size is explicit. So the probe measures the bytes the engine
really reserved and gives it the blocks a GPU would: stock's less ``cdiv(reserved, block bytes)``.

* short server (max_model_len 96 < min_context 128: no request can turn sparse): vLLM's own
  attention backend serves it (setup_check.serve_as_stock): no hisparse worker, and 12 requests of
  60 + 20 tokens run as many at once as in stock vLLM, on stock's blocks, with stock's tokens.
* long server (max_model_len 512): the same config reserves its Quest rows and a dense pool of
  quest_rows x 32 pages, admits the long requests, and they stay exact (tests/test_vllm_engine.py's
  dense-pool runs check tokens and logprobs against resident mode with this sizing).
"""
from __future__ import annotations

import json
import random
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PAGE = 16
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "host_pool_gib": 0.05, "dense_pool_gib": 0.01, "quest_rows": 3}     # min_context 128
LAYERS, HKV, D, ELT = 4, 2, 32, 4                 # scripts/make_tiny_model.py, fp32
BLOCK_BYTES = LAYERS * PAGE * 2 * HKV * D * ELT
# 33 usable (block 0 is vLLM's null block): 8 prompts of 4 blocks, one block to spare, so the
# one block the scratch row may cost does not cross a request (at 33 it would: 7 vs 8 running)
STOCK_BLOCKS = 34
N_REQ, PROMPT, OUT = 12, 60, 20


def probe(model: str, backend: str, mml: int, num_blocks: int, prompt: int, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    kw = {}
    if backend == "hisparse":
        from vllm_hisparse.vllm.plugin import register

        register()
        kw = {"attention_backend": "hisparse", "additional_config": {"hisparse": CFG}}
    running = {"max": 0}
    orig = Scheduler.schedule

    def spy(self, *a, **k):
        so = orig(self, *a, **k)
        running["max"] = max(running["max"], len(self.running))
        return so

    Scheduler.schedule = spy
    llm = LLM(model, dtype="float32", max_model_len=mml, max_num_seqs=16, block_size=PAGE,
              max_num_batched_tokens=512, enforce_eager=True, seed=0,
              num_gpu_blocks_override=num_blocks, **kw)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(prompt)]}
               for _ in range(N_REQ)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True),
                        use_tqdm=False)
    res = {"running_max": running["max"], "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if backend == "hisparse":
        from vllm_hisparse.vllm import worker_state
        from vllm_hisparse.vllm.plugin import selected

        vc = llm.llm_engine.vllm_config
        res["hisparse"] = [selected(vc), vc.kv_transfer_config is not None]
        if not any(res["hisparse"]):      # no request can be sparse: stock vLLM served it
            with open(out, "w") as f:
                json.dump(res, f)
            return

        kmin, kmax = worker_state.indexer_state
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        res["quest_bytes"] = sum(nbytes(t) for t in kmin + kmax if t is not None)
        dp = worker_state.dense_pool
        res["dense_pool_bytes"] = nbytes(dp.data) if dp is not None else 0
        rt = worker_state.get_runtime()
        for _ in range(20):                   # delayed frees complete on the following steps
            if rt.stats_dict()["live_requests"] == 0:
                break
            llm.llm_engine.step()
        res["quest_rows"] = rt.ix.rows
        res["host_pages"] = rt.pool.num_pages if rt.pool is not None else None
        res["stats"] = rt.stats_dict()
    with open(out, "w") as f:
        json.dump(res, f)


def cdiv(a, b):
    return -(-a // b)


SHORT_MML, LONG_MML = 96, 512


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three engines of this module, side by side (tests/engine_jobs.py, run_script): runs[tag]
    is what the probe wrote."""
    from engine_jobs import run_script, tiny_model

    model = tiny_model()
    return run_script(__file__, tmp_path_factory.mktemp("pools"), {
        "long": [model, "hisparse", LONG_MML, 200, 200],                 # sparse
        "stock": [model, "stock", SHORT_MML, STOCK_BLOCKS, PROMPT],
        "short": [model, "hisparse", SHORT_MML, STOCK_BLOCKS, PROMPT]})


def test_short_server_is_stock_vllm(runs):
    """No request of the short server can be sparse: vLLM's own attention backend serves it
    (setup_check.serve_as_stock), no hisparse backend or connector is installed, and it runs
    stock's requests at once on stock's blocks with stock's tokens."""
    stock, hs = runs["stock"], runs["short"]
    assert hs["hisparse"] == [False, False]           # vLLM's backend, no KV connector
    assert runs["long"]["hisparse"] == [True, True]
    # vLLM admits a request while its prompt's blocks fit (60 tokens: 4 blocks): 33 // 4 at once,
    # some preempted as they grow
    assert stock["running_max"] == (STOCK_BLOCKS - 1) // cdiv(PROMPT, PAGE)
    assert hs["running_max"] == stock["running_max"]
    assert hs["tokens"] == stock["tokens"] and len(hs["tokens"]) == N_REQ


def test_long_server_keeps_its_pools(runs):
    mml = LONG_MML
    res = runs["long"]                                        # sparse from the start
    rows, pages = CFG["quest_rows"], cdiv(mml, PAGE)
    assert res["quest_rows"] == rows
    assert res["host_pages"] == int(CFG["host_pool_gib"] * (1 << 30)) // (
        (LAYERS - 1) * 2 * PAGE * HKV * D * ELT)    # the sparse layers' pages (dense ones: pool)
    assert res["quest_bytes"] == 2 * (LAYERS - 1) * (rows + 1) * pages * HKV * D * ELT
    pool_pages = min(int(CFG["dense_pool_gib"] * (1 << 30)) // (2 * PAGE * HKV * D * ELT),
                     rows * pages)
    assert res["dense_pool_bytes"] == pool_pages * 2 * PAGE * HKV * D * ELT
    # admission: at most quest_rows long requests at once (the blocks would hold more), all served
    assert res["running_max"] == rows
    assert res["stats"]["decode_rows"] > 0 and res["stats"]["finished"] == N_REQ


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
          sys.argv[6])
