"""Prefix caching with the host tier for requests that never turn sparse (issue 47; docs/design/
prefix-caching.md, section 3.1 "as built"): a request whose context can never reach min_context
(prompt + max_tokens, plus speculative decoding's draft tokens, within max_model_len) never
writes its hot slots, so its floor is block 0 alone (the worker's identity of its rows), as in
resident mode, and it shares the rest of a hit with stock vLLM's sharing; a hit block below S that
a live request that may turn sparse computed as its own slot is still copied (that request will
overwrite it). A request that may turn sparse keeps F = S. The connector's admission count
(``admission_blocks``) adds the copies the floor will take.

Without an engine: the KV manager on a real vLLM BlockPool (tests/test_prefix_host_pool.py's
helpers), the connector's rule and count. Through the CPU engine (this file run as a script per
mode, tests/engine_jobs.py run_script): a system prompt computed by a never-sparse request, then
``ns`` (never sparse, 40 tokens) and ``sp`` (turns sparse after ~16 tokens, then misses overwrite
its slots) admitted together with its hit; the host tier (with and without resident_first) equals
resident mode with prefix caching on, tokens and top-5 logprobs, with the same hits; ``ns`` copies
block 0 only and shares the hit's other blocks, ``sp`` copies S; negative control: ``sp`` forced
onto the never-sparse floor shares its slots with ``ns``, whose outputs then differ.
"""
from __future__ import annotations

import json
import random
import sys
import weakref
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
PAGE, S = 16, 4


# ---- no engine: the KV manager and the connector -------------------------------------------
def _manager(num_blocks: int = 41):
    from test_prefix_host_pool import manager

    m, pool = manager(num_blocks)                     # host tier, min_context 64, S = 4
    return m, pool, m._shared


def _prefill(m, rid, pages, seed=0):
    from test_prefix_host_pool import prefill, request

    req = request(rid, pages, seed)
    return req, prefill(m, req, pages)


def _hit(m, rid, hits, pages):
    """Allocate ``rid`` (``pages`` pages) with the prefix-cache hit ``hits``; returns (count vLLM
    checks, its blocks, the copies queued)."""
    n = m.get_num_blocks_to_allocate(rid, pages * PAGE, hits, len(hits) * PAGE,
                                     len(hits) * PAGE, pages * PAGE)
    m.add_local_computed_blocks(rid, hits, len(hits) * PAGE, 0)
    m.allocate_new_blocks(rid, pages * PAGE, pages * PAGE)
    return n, list(m.req_to_blocks[rid]), m.take_pending_cow_copies()


def test_a_never_sparse_hit_copies_block_0_and_shares_the_rest():
    m, pool, led = _manager()
    a_req, a = _prefill(m, "a", 6)
    led.never_sparse.add("a")                         # (its slots were recorded may-sparse)
    m.free("a")                                       # finished: its blocks cached, free
    led.never_sparse.add("b")
    m.new_step_starts()
    assert m.floor_copies(a_req, 6) == 1
    n, b, copies = _hit(m, "b", a[:6], 7)
    assert n == 1 + 6 + 1                             # its new page, 6 evictable hits, block 0
    assert [src for src, _ in copies] == [a[0]] and b[0] is not a[0]
    assert all(b[i] is a[i] for i in range(1, 6))     # shared, as stock vLLM does
    pool.free_blocks([blk for pair in copies for blk in pair])
    m.free("b")
    assert pool.get_num_free_blocks() == 40


def test_a_may_sparse_hit_still_copies_the_s_hot_slots():
    m, pool, led = _manager()
    a_req, a = _prefill(m, "a", 6)
    m.free("a")
    m.new_step_starts()
    assert m.floor_copies(a_req, 6) == S
    n, b, copies = _hit(m, "b", a[:6], 7)
    assert n == 1 + 6 + S and [src for src, _ in copies] == a[:S]
    assert all(b[i] is not a[i] for i in range(S)) and b[S] is a[S]


def test_a_never_sparse_hit_copies_the_slots_a_live_sparse_owner_will_overwrite():
    """The owner may turn sparse and is live: its own slots [0, S) will be overwritten (after
    its donation moved their cache entries), so a never-sparse hit copies them too; once the
    owner is gone (or if it is never sparse itself) they are shared."""
    m, pool, led = _manager()
    a_req, a = _prefill(m, "a", 6)                    # may turn sparse, live
    led.never_sparse.update({"b", "c", "d"})
    m.new_step_starts()
    assert m.floor_copies(a_req, 6) == S
    n, b, copies = _hit(m, "b", a[:6], 7)
    assert n == 1 + S and [src for src, _ in copies] == a[:S]   # a's blocks held: not evictable
    assert b[S] is a[S] and b[S + 1] is a[S + 1]
    pool.free_blocks([blk for pair in copies for blk in pair])
    # a never-sparse owner: its slots are never written, a never-sparse hit shares them
    c_req, c = _prefill(m, "c", 3, seed=1)
    m.new_step_starts()
    n, d, copies = _hit(m, "d", c[:3], 4)
    assert [src for src, _ in copies] == [c[0]] and d[1:3] == c[1:3]
    pool.free_blocks([blk for pair in copies for blk in pair])
    m.free("a")                                       # the sparse owner gone: nothing to copy
    assert m._slot_owner == {}
    led.never_sparse.add("e")
    e_req = SimpleNamespace(request_id="e", block_hashes=a_req.block_hashes)
    assert m.floor_copies(e_req, 6) == 1


def test_a_class_level_floor_overrides_the_never_sparse_rule():
    """The tests' F control (HiSparseManager.floor_blocks) wins over the connector's rule."""
    from vllm_hisparse.vllm.spec import HiSparseManager

    HiSparseManager.floor_blocks = 2
    try:
        m, pool, led = _manager()
        a_req, a = _prefill(m, "a", 6)
        m.free("a")
        led.never_sparse.add("b")
        m.new_step_starts()
        n, b, copies = _hit(m, "b", a[:6], 7)
        assert [src for src, _ in copies] == a[:2]
    finally:
        HiSparseManager.floor_blocks = None


def _connector(spec_tokens: int = 0, min_context: int = 64, mml: int = 1024):
    from vllm_hisparse.config import HiSparseConfig
    from vllm_hisparse.vllm.connector_scheduler import ConnectorScheduler as C

    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=PAGE, min_context=min_context,
                         host_tier=True, resident_first=True, host_pool_gib=0.05)
    sc = SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=4, watermark=0.0,
                         scheduler_reserve_full_isl=True)
    me = SimpleNamespace(cfg=cfg, max_model_len=mml, _spec_tokens=spec_tokens,
                         _watermark_blocks=0, _vllm_config=SimpleNamespace(scheduler_config=sc))
    for name in ("_max_tokens", "_most_tokens", "_may_be_sparse"):
        setattr(me, name, getattr(C, name).__get__(me))
    return C, me


@pytest.mark.parametrize("prompt,max_tokens,spec,never", [
    (32, 31, 0, True),         # context at most 62 < 64 (the rule keeps one token of slack)
    (32, 32, 0, False),        # prompt + max_tokens reaches min_context: may turn sparse
    (32, 30, 2, False),        # draft tokens past max_tokens may reach it
    (32, 29, 2, True),
    (64, 1, 0, False),         # sparse from its prompt
    (32, None, 0, False),      # max_tokens unset: up to max_model_len
])
def test_the_connector_names_requests_that_never_turn_sparse(prompt, max_tokens, spec, never):
    C, me = _connector(spec)
    req = SimpleNamespace(num_prompt_tokens=prompt, max_tokens=max_tokens)
    assert C._never_sparse(me, req) is never
    # a max_model_len below min_context bounds every request (drafts included)
    C, me = _connector(spec_tokens=8, mml=60)
    assert C._never_sparse(me, SimpleNamespace(num_prompt_tokens=32, max_tokens=None))


@pytest.mark.parametrize("prompt,max_tokens,spec,mml,pages", [
    (32, 32, 0, 1024, 4),      # 64 tokens: 4 pages of 16
    (32, 32, 2, 1024, 5),      # a step's drafts may reach token 66: a fifth page
    (32, 32, 2, 64, 4),        # max_model_len bounds the drafts too
    (32, 30, 2, 1024, 4),      # 64 with drafts: may turn sparse, so it reserves them
    (32, 29, 2, 1024, 0),      # never sparse: no host page
])
def test_host_pages_cover_the_draft_tokens(prompt, max_tokens, spec, mml, pages):
    """Host pages are reserved for the context's reach with drafts, which the worker's pool then
    grows into (HostKVPool.ensure raised HostPoolFull past the reservation)."""
    C, me = _connector(spec, mml=mml)
    req = SimpleNamespace(num_prompt_tokens=prompt, max_tokens=max_tokens)
    me._life_blocks = C._life_blocks.__get__(me)
    assert C._pages_needed(me, req) == pages


def test_admission_counts_the_copies_the_floor_will_take():
    """admission_blocks: the whole sequence + watermark + 1 + the floor's copies of the hit
    (the manager's own count, looked up as vLLM's hit is): S for a request that may turn sparse,
    1 for one that never does (block 0), none without a hit."""
    m, pool, led = _manager()
    led._manager = weakref.ref(m)
    C, me = _connector()
    me._ledger = led
    a_req, a = _prefill(m, "a", 6)
    m.free("a")
    b = SimpleNamespace(request_id="b", num_tokens=7 * PAGE, block_hashes=a_req.block_hashes)
    assert C.admission_blocks(me, b) == 7 + 1
    assert C.admission_blocks(me, b, 6 * PAGE) == 7 + 1 + S
    assert C.admission_blocks(me, b, 6 * PAGE + 5) == 7 + 1 + S     # whole hit blocks only
    led.never_sparse.add("b")
    assert C.admission_blocks(me, b, 6 * PAGE) == 7 + 1 + 1
    # what allocation then takes (a later step): its new page, the 6 evictable hits, one copy
    m.new_step_starts()
    n, _, _ = _hit(m, "b", a[:6], 7)
    assert n == 1 + 6 + 1 <= C.admission_blocks(me, b, 6 * PAGE)
    # no manager bound (resident_first off): an upper bound, every hit block
    led._manager = None
    assert C.admission_blocks(me, b, 6 * PAGE) == 7 + 1 + 6


def test_the_connector_marks_and_releases_never_sparse_requests():
    """get_num_new_matched_tokens names the request in the pool's ledger before vLLM allocates
    it (every call: a resumption asks again); its release drops it."""
    from test_hostless_admission import make

    conn, _, _ = make(quest_rows=4)                   # min_context 64, the pool bound
    short = SimpleNamespace(request_id="s", num_prompt_tokens=16, max_tokens=8, num_tokens=16,
                            block_hashes=[])
    long = SimpleNamespace(request_id="l", num_prompt_tokens=16, max_tokens=200, num_tokens=16,
                           block_hashes=[])
    assert conn.get_num_new_matched_tokens(short, 0) == (0, False)
    assert conn.get_num_new_matched_tokens(long, 0) == (0, False)
    assert conn._shared.never_sparse == {"s"}
    assert conn.get_num_new_matched_tokens(short, 0) == (0, False)     # asked again
    assert conn._shared.never_sparse == {"s"}
    conn.request_finished(short, [])
    assert conn._shared.never_sparse == set()


# ---- the CPU engine ---------------------------------------------------------------------------
SYSTEM, MIN_CONTEXT = 96, 160
# ns: prompt 112 + 40 = 152 < 160, never sparse; sp: prompt 144 + 40 >= 160, sparse from its
# context 160 (~16 generated tokens) on, its hot slots overwritten by misses while ns decodes
NS_USER, SP_USER, OWN_USER, MAX_TOKENS = 16, 48, 16, 40
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "min_context": MIN_CONTEXT, "host_tier": False}
HOST = dict(CFG, host_tier=True, resident_first=False, host_pool_gib=0.05)
MODES = {"on": CFG, "host": HOST, "elastic": dict(HOST, resident_first=True), "control": HOST}
MML, SEQS, BATCHED = 1024, 8, 2048


def _drive(mode: str, model: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.plugin import register

    register()
    llm = LLM(model, dtype="float32", max_model_len=MML, max_num_seqs=SEQS, block_size=PAGE,
              max_num_batched_tokens=BATCHED, enforce_eager=True, seed=0,
              enable_prefix_caching=True, attention_backend="hisparse",
              additional_config={"hisparse": MODES[mode]})
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    [mgr] = sched.kv_cache_manager.coordinator.single_type_managers
    copies, hits, blocks = {}, {}, {}
    cow, add, alloc = mgr._apply_cow, mgr.add_local_computed_blocks, mgr.allocate_new_blocks

    def short(rid):
        return rid.split("-")[0]

    def apply_cow(rid, idx, src, dst):                # every copy-on-write of a hit block
        copies.setdefault(short(rid), []).append(idx)
        cow(rid, idx, src, dst)

    def add_local(rid, new, *a):
        hits[short(rid)] = [b.block_id for b in new]
        add(rid, new, *a)

    def allocate(rid, *a):
        got = alloc(rid, *a)
        blocks.setdefault(short(rid), [b.block_id for b in mgr.req_to_blocks[rid]])
        return got
    mgr._apply_cow, mgr.add_local_computed_blocks, mgr.allocate_new_blocks = \
        apply_cow, add_local, allocate
    cs = getattr(sched.connector, "connector_scheduler", None)
    if mode == "control":                             # sp forced onto the never-sparse floor
        rule = cs._never_sparse
        cs._never_sparse = lambda r: True if short(r.request_id) == "sp" else rule(r)

    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(SYSTEM)]
    user = {k: [rng.randrange(3, 500) for _ in range(n)]
            for k, n in (("own", OWN_USER), ("ns", NS_USER), ("sp", SP_USER))}
    res = {"outputs": {}, "error": None}

    def serve(batch, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
        for rid in batch:
            eng.add_request(rid, {"prompt_token_ids": system + user[rid]}, sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    res["outputs"][o.request_id] = {
                        "tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                        "logprobs": [sorted([k, v.logprob] for k, v in d.items())
                                     for d in o.outputs[0].logprobs]}
    try:
        serve(["own"], 4)                             # caches the system prompt, never sparse
        serve(["ns", "sp"], MAX_TOKENS)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    rt = worker_state.get_runtime()
    res["copies"], res["hits"], res["blocks"] = copies, hits, blocks
    res["stats"] = {k: rt.stats_dict()[k] for k in ("turned_sparse", "misses", "prefix_hits")}
    res["donation"] = dict(mgr.donation)
    with open(out, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from engine_jobs import run_script, tiny_model

    model = tiny_model()
    return run_script(__file__, tmp_path_factory.mktemp("pns"),
                      {mode: [mode, model] for mode in ("control", "host", "elastic", "on")})


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("host", "elastic"))
def test_never_sparse_hit_shares_and_both_stay_exact(runs, mode):
    ref, r = runs["on"], runs[mode]
    assert r["error"] is None and ref["error"] is None
    assert set(r["outputs"]) == set(ref["outputs"]) == {"own", "ns", "sp"}
    for rid in ("own", "ns", "sp"):
        a, b = r["outputs"][rid], ref["outputs"][rid]
        assert a["tokens"] == b["tokens"], f"{rid}: tokens differ"
        assert a["logprobs"] == b["logprobs"], f"{rid}: logprobs differ"
        assert a["cached"] == b["cached"]
    assert r["outputs"]["ns"]["cached"] == r["outputs"]["sp"]["cached"] == SYSTEM
    # ns: block 0 copied (its identity), the hit's 5 other blocks shared with the cache
    assert r["copies"]["ns"] == [0]
    hit, own = r["hits"]["ns"], r["blocks"]["ns"]
    assert len(hit) == SYSTEM // PAGE and own[1:len(hit)] == hit[1:] and own[0] != hit[0]
    # sp turns sparse: its S hot slots copied (resident mode copies block 0 only)
    assert r["copies"]["sp"] == list(range(S)) and ref["copies"]["sp"] == [0]
    assert "own" not in r["copies"]
    assert r["stats"]["turned_sparse"] == 1


@pytest.mark.slow
def test_the_engines_exercise_the_slot_writes(runs):
    host = runs["host"]
    assert host["stats"]["misses"] > 0               # sp's slots overwritten while ns decodes


@pytest.mark.slow
def test_negative_control_sparse_request_on_the_never_sparse_floor_differs(runs):
    c, ref = runs["control"], runs["on"]
    assert c["copies"]["sp"] == [0] and c["stats"]["misses"] > 0
    assert c["error"] is None, c["error"]
    from control_steps import CONTROL_STEPS, differing

    steps = differing([ref["outputs"]["ns"]], [c["outputs"]["ns"]])[1]
    print("negative control: steps whose logprobs differ:", steps)
    assert steps >= CONTROL_STEPS, steps                                   # clearly


if __name__ == "__main__":
    _drive(sys.argv[1], sys.argv[2], sys.argv[3])
