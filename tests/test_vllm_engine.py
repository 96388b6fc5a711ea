"""The real vLLM 0.26 engine (CPU) with the hisparse backend: hisparse == resident, bit for bit.

Each engine config runs once for the whole module (engine start is ~20 s on 2 cores), each in its
own process through scripts/hisparse_generate.py, the module's offline runs started together by
the engines fixture and run side by side (tests/engine_jobs.py). k and B are tiny (3 pages selected of up to 24,
4 hot slots) so that misses happen on almost every decode step. Short prompts that generate past
min_context turn sparse on the way (core/residency.py's length rule).
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time

import numpy as np
import pytest

from engine_generate import MAX_TOKENS, PY, generate_all
from engine_jobs import tiny_model
from vllm_hisparse.server_health import stop, wait_healthy

pytestmark = pytest.mark.vllm

PAGE = 16
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "host_pool_gib": 0.05, "resident_first": False,   # the fixed hot buffer: misses every step
       "dense_pool_gib": 0}      # no dense pool unless a run sets one (auto would size one)
PROMPT_LENS = (150, 333, 90, 260, 17)       # 17 + 40 < min_context below: resident and dense
SHORT_LENS = (17, 25, 9, 30)                  # dense, and two that turn sparse at 64 tokens
MIN_CONTEXT = 64
GROW_LENS = (20, 40)                          # short prompts generating far past min_context
GROW_TOKENS = 100


def prompts(lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lens]


def batches() -> list:
    """Mixed sparse and dense requests; the serve test's request alone; short requests (two of
    them turn sparse at their last steps); short prompts that turn sparse and decode long after."""
    return [prompts(), [prompts()[1]], prompts(SHORT_LENS, seed=1),
            {"prompts": prompts(GROW_LENS, seed=2), "max_tokens": GROW_TOKENS}]


def requests() -> list[tuple[int, int, int]]:
    """(batch, prompt length, max_tokens) of every request of batches(), in order."""
    out = []
    for i, b in enumerate(batches()):
        mt = b["max_tokens"] if isinstance(b, dict) else MAX_TOKENS
        out += [(i, len(p), mt) for p in (b["prompts"] if isinstance(b, dict) else b)]
    return out


def ever_sparse(n: int, max_tokens: int) -> bool:
    """The request's context reaches MIN_CONTEXT (its last step computes n + max_tokens - 1)."""
    return n + max_tokens - 1 >= MIN_CONTEXT


# Every offline engine run of this module, started together by the engines fixture (each alone
# in its own process, with the requests and settings its test gives it), longest first.
def engine_runs(tmp) -> dict:
    cfg = dict(CFG, min_context=MIN_CONTEXT)
    rng = random.Random(1)
    preempt = [[rng.randrange(3, 512) for _ in range(n)] for n in (40, 41, 42, 43)]
    page_bytes_all_layers = 2 * PAGE * 2 * 32 * 4 * 4        # K+V, Hkv=2, D=32, fp32, 4 layers
    return {
        # hisparse keeps the dense layer of long requests in a GPU dense pool (dense_pool_gib);
        # the host read-back of dense layers is covered by the pool-full and preemption runs.
        "hisparse": (dict(cfg, trace_dir=str(tmp / "traces"), dense_pool_gib=0.01), batches(),
                     ()),
        # 20 KV blocks for 4 requests of 40 + 200 tokens (test_preemption_recovers)
        "preempt": (cfg, [preempt], ["--num-blocks", "20", "--max-tokens", "200",
                                     "--max-model-len", "256"]),
        "full": (dict(cfg, dense_pool_gib=0.01, full_decode_graphs=True), batches(), ()),
        "crf": (dict(cfg, dense_pool_gib=0.01, policy="crf"), batches(), ()),
        "resident": (dict(cfg, host_tier=False), batches(), ()),
        # a host pool that holds one max-length request: 36 pages of all layers
        "poolfull": (dict(cfg, host_pool_gib=36 * page_bytes_all_layers / (1 << 30),
                          hostless="wait"),
                     [prompts()], ["--max-model-len", "512"]),
        "questrows": (dict(cfg, quest_rows=1), [prompts()], ()),
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    out = generate_all(tmp, tiny_model(), engine_runs(tmp))
    out["trace_dir"] = tmp / "traces"
    return out


@pytest.fixture(scope="module")
def runs(engines):
    resident, hisparse = engines["resident"](), engines["hisparse"]()
    hisparse["trace_dir"] = engines["trace_dir"]
    return resident, hisparse


def test_tokens_and_logprobs_identical(runs):
    resident, hisparse = runs
    want = [mt for _, _, mt in requests()]
    got = [len(r["tokens"]) for b in resident["batches"] for r in b]
    assert got == want
    for b_res, b_hs in zip(resident["batches"], hisparse["batches"], strict=True):
        assert len(b_res) == len(b_hs)
        for i, (r, h) in enumerate(zip(b_res, b_hs)):
            assert h["tokens"] == r["tokens"], f"request {i}: tokens differ"
            assert h["logprobs"] == r["logprobs"], f"request {i}: logprobs differ"
    # the batches each engine ran (scripts/hisparse_generate.py's schedule, which the GPU verdict
    # compares): recorded, equal, and covering every prompt and fed-back token of each request
    for res in runs:
        for b, info in zip(res["batches"], res["batch_info"], strict=True):
            totals = {}
            for step in info["schedule"]:
                for req, n in step:
                    totals[req] = totals.get(req, 0) + n
            assert sorted(totals.values()) == sorted(r["prompt_len"] + len(r["tokens"]) - 1 for r in b)
    assert [i["schedule"] for i in resident["batch_info"]] == [i["schedule"] for i in hisparse["batch_info"]]


def test_builder_reads_the_host_block_table(runs):
    """The metadata builder found vLLM's host block table (vllm/host_block_table.py) in the engine,
    after vLLM froze its GC heap, so no step copies the first blocks back from the device."""
    for res in runs:
        assert "host block table not found" not in res["log"]


def test_misses_happen_every_step(runs):
    _, hisparse = runs
    s = hisparse["stats"]
    assert s["misses"] > 0 and s["hits"] > 0
    # Every decode step of a long request past its S hot pages resolves k-1 = 2 pages.
    assert s["misses"] >= s["decode_rows"] // 4, s


def test_host_pool_empty_afterwards(runs):
    resident, hisparse = runs
    assert hisparse["stats"]["host_pages_used"] == 0
    assert hisparse["stats"]["dense_pool_pages_used"] == 0
    sparse_pages = sum(-(-(n + mt - 1) // PAGE) for _, n, mt in requests() if ever_sparse(n, mt))
    assert hisparse["stats"]["dense_pool_pages_handed"] == sparse_pages   # the pool was used
    assert hisparse["stats"]["live_requests"] == 0
    assert hisparse["stats"]["finished"] == len(requests())
    assert resident["stats"]["host_pages_used"] == 0


def test_trace_dir_records_every_decode_step(runs):
    """config trace_dir: one trace per finished request that was sparse (the short ones that never
    reach min_context have none), loadable by sim.trace, one row per sparse decode step (from the
    first decode step for a long prompt, from the step its context reaches min_context for a short
    one), one layer row per sparse layer, every page inside the step's context, the newest page
    first (Quest always attends it)."""
    from vllm_hisparse.sim import trace as tr

    _, hisparse = runs
    files = sorted(hisparse["trace_dir"].glob("*.npz"))
    # (context at the first traced step, steps): the prefill step yields the first token
    want = sorted((n + 1, mt - 1) if n >= MIN_CONTEXT else (MIN_CONTEXT, n + mt - MIN_CONTEXT)
                  for _, n, mt in requests() if ever_sparse(n, mt))
    assert len(files) == len(want), [f.name for f in files]
    got = []
    for f in files:
        t = tr.load(str(f))
        assert t.unit == PAGE and t.meta["num_layers"] == 4
        assert t.layers == 4 - len(CFG["dense_layers"]) == len(t.meta["sparse_layers"])
        first = int(t.context_len[0])
        got.append((first, t.steps))
        assert (t.context_len == first + np.arange(t.steps)).all()
        pages = (t.context_len.astype(np.int64) + PAGE - 1) // PAGE
        assert ((t.positions < pages[:, None, None]) | (t.positions == -1)).all()
        assert (t.positions[:, :, 0] == (pages - 1)[:, None]).all()
        assert t.k_max == CFG["top_k"] // PAGE and (t.positions >= 0).all()
    assert sorted(got) == want


def test_short_prompts_turn_sparse_at_min_context(runs):
    """Issue 16's length rule in the engine: prompts of 20 and 40 tokens generating 100 turn sparse
    at the step their context reaches min_context (their traces start there: the test above), in
    both modes; from then on they decode through the hot buffer with misses, hold the GPU blocks a
    long prompt holds (S hot slots + the newest page), give tokens and logprobs identical to
    resident mode (the first test), and leave the pools empty."""
    resident, hisparse = runs
    grow = len(batches()) - 1
    before, after = (hisparse["batch_info"][grow - 1]["stats"], hisparse["batch_info"][grow]["stats"])
    d = {k: after[k] - before[k] for k in ("turned_sparse", "decode_rows", "dense_decode_rows",
                                           "misses", "hits")}
    assert d["turned_sparse"] == len(GROW_LENS)
    # decode steps compute contexts n+1 .. n+GROW_TOKENS-1: dense below min_context, sparse from it
    assert d["decode_rows"] == sum(n + GROW_TOKENS - MIN_CONTEXT for n in GROW_LENS)
    assert d["dense_decode_rows"] == sum(MIN_CONTEXT - 1 - n for n in GROW_LENS)
    assert d["misses"] > 0 and d["hits"] > 0
    r_before, r_after = (resident["batch_info"][grow - 1]["stats"],
                         resident["batch_info"][grow]["stats"])
    assert r_after["turned_sparse"] - r_before["turned_sparse"] == len(GROW_LENS)
    assert r_after["decode_rows"] - r_before["decode_rows"] == d["decode_rows"]
    slots = CFG["device_buffer_size"] // PAGE
    info = hisparse["batch_info"][grow]
    assert 0 < info["peak_sparse_blocks"] <= slots + 1
    assert resident["batch_info"][grow]["peak_decode_blocks"] >= (max(GROW_LENS) + GROW_TOKENS
                                                                   - 1) // PAGE
    assert after["host_pages_used"] == 0 and after["dense_pool_pages_used"] == 0
    assert after["live_requests"] == 0


def test_gpu_blocks_shrink_to_hot_buffer(runs):
    resident, hisparse = runs
    slots = CFG["device_buffer_size"] // PAGE
    # After prefill a request holds its S hot slots plus the newest page ...
    assert hisparse["peak_decode_blocks"] <= slots + 1
    # ... where resident mode holds every page of its longest request.
    longest = max(PROMPT_LENS) + MAX_TOKENS
    assert resident["peak_decode_blocks"] >= longest // PAGE



def test_full_decode_graphs_with_dense_pool_equal_resident(runs, engines):
    """full_decode_graphs true and a dense pool: the builder declares FULL-graph support (on the
    CPU vLLM captures no graphs, so every uniform decode step calls the layers eagerly); each such
    step is planned once from the connector's start_load_kv as one decode batch (plan_full) whose
    layers run core/decode_body.py, mixed sparse and dense rows together, the dense layers of the
    long requests from the dense pool. Tokens and logprobs equal the resident run's."""
    resident, _ = runs
    full = engines["full"]()
    s = full["stats"]
    assert s["full_steps"] >= MAX_TOKENS - 1 and s["host_ms_full_layers"] > 0, s
    assert s["misses"] > 0 and s["decode_rows"] > 0, s
    assert s["dense_pool_pages_handed"] > 0 and s["dense_pool_pages_used"] == 0, s
    assert s["host_pages_used"] == 0 and s["live_requests"] == 0
    for b_res, b_full in zip(resident["batches"], full["batches"], strict=True):
        for i, (r, f) in enumerate(zip(b_res, b_full, strict=True)):
            assert f["tokens"] == r["tokens"], f"request {i}: tokens differ"
            assert f["logprobs"] == r["logprobs"], f"request {i}: logprobs differ"


def test_policy_crf_equals_lru_and_resident(runs, engines):
    """policy crf (its branch of the select_resolve kernel's reference on the CPU): the same
    tokens and logprobs as the resident run and the lru run, over the same lookups, with its own
    misses; pools empty afterwards."""
    resident, lru = runs
    crf = engines["crf"]()
    for b_res, b_lru, b_crf in zip(resident["batches"], lru["batches"], crf["batches"], strict=True):
        for i, (r, h, c) in enumerate(zip(b_res, b_lru, b_crf, strict=True)):
            assert c["tokens"] == r["tokens"] == h["tokens"], f"request {i}: tokens differ"
            assert c["logprobs"] == r["logprobs"] == h["logprobs"], f"request {i}: logprobs differ"
    s, sl = crf["stats"], lru["stats"]
    assert s["policy"] == "crf" and sl["policy"] == "lru"
    assert s["resolved_units"] == sl["resolved_units"] and s["misses"] > 0
    assert s["misses"] != sl["misses"], (s["misses"], sl["misses"])   # the policy really ran
    assert s["host_pages_used"] == 0 and s["dense_pool_pages_used"] == 0 and s["live_requests"] == 0


def test_host_pool_full_requests_wait(engines):
    """A host pool that holds one max-length request (32 pages of 16 tokens): the 5 requests need
    ~70 pages in all, so with hostless "wait" some wait for others to finish (with the default
    "sparse" they run host-less: tests/test_hostless_engine.py); all complete, none crashes."""
    res = engines["poolfull"]()
    assert "host pool full" in res["log"]
    assert [len(b["tokens"]) for b in res["batches"][0]] == [MAX_TOKENS] * len(PROMPT_LENS)
    assert res["stats"]["host_pages_used"] == 0 and res["stats"]["finished"] == len(PROMPT_LENS)


def test_quest_rows_full_requests_wait(engines):
    """quest_rows=1: one Quest bounds row on the worker, so the four long requests run one at a time
    (the short one needs no row and runs beside them); all complete, nothing leaks."""
    res = engines["questrows"]()
    assert "indexer rows full" in res["log"]
    assert res["stats"]["full_steps"] > 0
    assert [len(b["tokens"]) for b in res["batches"][0]] == [MAX_TOKENS] * len(PROMPT_LENS)
    assert res["stats"]["host_pages_used"] == 0 and res["stats"]["finished"] == len(PROMPT_LENS)


def test_preemption_recovers(engines):
    """20 KV blocks for 4 requests of 40 + 200 tokens, each turning sparse at min_context (64
    tokens) and holding S + 2 = 6 blocks while decoding from then on (max_model_len 256: one whole
    prompt must fit the blocks during its prefill, a startup check): one gets preempted, resumes
    (recomputed from token 0, sparse again at once), completes; the host pool ends empty. (A resumed request recomputes its generated tokens
    with dense prefill attention, so its continuation may differ from an uninterrupted run.)"""
    res = engines["preempt"]()
    assert res["preemptions"] > 0
    assert [len(b["tokens"]) for b in res["batches"][0]] == [200] * 4
    assert res["stats"]["host_pages_used"] == 0 and res["stats"]["live_requests"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One `vllm serve --attention-backend HiSparse --hisparse-config F` for the module's server
    tests; its worker writes HISPARSE_STATS_FILE."""
    from types import SimpleNamespace

    tmp = tmp_path_factory.mktemp("serve")
    model = tiny_model()
    port = _free_port()
    stats = tmp / "stats.json"
    cfg_file = tmp / "hisparse.json"                # through the --hisparse-config shorthand
    cfg_file.write_text(json.dumps(dict(CFG, min_context=MIN_CONTEXT)))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               HISPARSE_STATS_FILE=str(stats))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [os.path.join(os.path.dirname(PY), "vllm"), "serve", model, "--port", str(port),
           "--host", "127.0.0.1", "--attention-backend", "HiSparse", "--dtype", "float32",
           "--hisparse-config", str(cfg_file),
           "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
           "--enforce-eager", "--seed", "0"]
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, port, timeout=480)
        yield SimpleNamespace(model=model, port=port, stats=stats, url=f"http://127.0.0.1:{port}")
    finally:
        stop(proc)
        log.close()


def _wait_idle(stats, done=lambda st: True, tries=120) -> dict:
    """The worker's stats once no request is live and ``done(stats)`` holds (the delayed free, and
    what reports after it, land a step or two after the last answer)."""
    st = {}
    for _ in range(tries):
        if stats.exists():
            st = json.loads(stats.read_text())
            if st["live_requests"] == 0 and done(st):
                break
        time.sleep(0.5)
    return st


def test_vllm_serve_openai_client(runs, server):
    """`vllm serve --attention-backend HiSparse --hisparse-config F` + the OpenAI client: the
    answer equals the offline resident engine's for the same request, token for token and logprob
    for logprob; the server's worker then reports its host pool empty."""
    from openai import OpenAI

    resident, _ = runs
    want = resident["batches"][1][0]
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    r = client.completions.create(model=server.model, prompt=prompts()[1], max_tokens=MAX_TOKENS,
                                  temperature=0.0, logprobs=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    assert c.token_ids == want["tokens"]
    chosen = [dict(map(tuple, lp))[t] for lp, t in zip(want["logprobs"], want["tokens"])]
    assert c.logprobs.token_logprobs == chosen
    st = _wait_idle(server.stats)
    assert st["host_pages_used"] == 0 and st["live_requests"] == 0
    assert st["misses"] > 0


def test_metrics_on_prometheus_agree_with_worker_stats(server):
    """vLLM's /metrics carries the hisparse series (vllm/metrics.py, through the KV-connector stats
    path): after a long (sparse) and a short (dense) request they have moved, and they equal the
    worker's own counters (HISPARSE_STATS_FILE, written when a request is dropped): hits, lookups
    = hits + misses, miss bytes = misses x one page of one layer, decode rows by kind; the host
    pool is empty again, its capacity the connector's, nobody waits."""
    from openai import OpenAI

    from vllm_hisparse.bench import prom

    before = prom.hisparse(prom.scrape(server.url))
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    for p in (prompts()[0], prompts()[4]):                     # 150 tokens: sparse; 17: dense
        client.completions.create(model=server.model, prompt=p, max_tokens=MAX_TOKENS,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    page_bytes = 2 * PAGE * 2 * 32 * 4                        # K+V, Hkv=2, D=32, fp32: one layer
    m = {}

    def agree(st):
        nonlocal m
        m = prom.hisparse(prom.scrape(server.url))
        return (m["hot_buffer_lookups_total"] == st["hits"] + st["misses"]
                and m['decode_rows_total{kind="dense"}'] == st["dense_decode_rows"])

    st = _wait_idle(server.stats, agree)
    assert m["hot_buffer_hits_total"] == st["hits"] > before["hot_buffer_hits_total"]
    assert m["hot_buffer_lookups_total"] == st["hits"] + st["misses"]
    assert m["miss_bytes_total"] == st["misses"] * page_bytes > before["miss_bytes_total"]
    assert m['decode_rows_total{kind="sparse"}'] == st["decode_rows"] \
        > before['decode_rows_total{kind="sparse"}']
    assert m['decode_rows_total{kind="dense"}'] == st["dense_decode_rows"] \
        > before['decode_rows_total{kind="dense"}']
    assert m["host_pool_pages_used"] == m["host_pool_pages_reserved"] == 0
    assert m["host_pool_pages_capacity"] == int(CFG["host_pool_gib"] * (1 << 30)) // (page_bytes * 4)
    assert all(m[f'requests_waiting{{reason="{r}"}}'] == 0
               for r in ("host_pool", "dense_pool", "quest_rows"))


def test_out_of_vocabulary_prompt_ids_are_400_and_the_server_lives(server):
    """A prompt token id equal to the vocab size passes vLLM 0.26's own check and used to crash the
    engine, and every request in flight with it (issue 44): now a 400 naming the id, while a
    streaming request already in flight completes and a later one is served (plugin.py,
    _wrap_prompt_check). -1 is a 400 of the OpenAI schema (``ge=0``)."""
    import httpx
    from openai import OpenAI

    vocab = json.loads(open(os.path.join(server.model, "config.json")).read())["vocab_size"]
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    body = dict(model=server.model, max_tokens=200, temperature=0.0,
                extra_body={"ignore_eos": True})
    stream = client.completions.create(prompt=prompts()[1], stream=True,
                                       stream_options={"include_usage": True}, **body)
    chunks = [next(stream)]                             # in flight: its first token is out
    for bad, words in ((vocab, [f"Token id {vocab} is out of vocabulary: this model's prompt token "
                                f"ids are 0 to {vocab - 1}"]),
                       (-1, ["greater than or equal to 0", "'input': -1"])):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json=dict(model=server.model, prompt=[5, bad, 7], max_tokens=4))
        assert r.status_code == 400, (bad, r.status_code, r.text)
        assert all(w in r.json()["error"]["message"] for w in words), r.text
    chunks += list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 200
    after = client.completions.create(prompt=prompts()[4], **dict(body, max_tokens=8))
    assert after.usage.completion_tokens == 8
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
