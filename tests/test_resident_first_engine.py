"""issue 15 item 1-3 through the real vLLM 0.26 engine (CPU): resident-first with partial spills
under pressure, and a preemption, is exact.

Requests arrive while others decode (each added to the engine once the previous one has generated
a few tokens), on a small KV pool: a request keeps every block after its prompt (resident rows)
until the pool's free blocks fall below the reserve R, or below what an arriving prompt needs
(the connector asks the KV manager for room when it admits it); then the manager takes just the
missing blocks, oldest pages first, from the request with the most surplus (vllm/spec.py), and
the worker learns each new keep before that step's forward (connector metadata). Request 0 is
preempted once mid-run (after it was spilled) and resumes resident, on both sides. Every free GPU
block is overwritten with large values after each schedule, before its forward's layers (right
after the step's plan, which may copy the pages a spill of this step gives back into hot slots), so
a layer's read of a block already given back (e.g. a spill the worker learns a step late) changes
outputs. Tokens and
logprobs equal resident mode's (host_tier false) and hisparse's without resident_first, all with
the same preemption; the worker's residency equals the manager's after every step; no GPU block or
host page is left afterwards. With blocks to spare, nothing spills and nothing misses.

Each engine runs this file as a script (in-process engine core) in one of the session's kept
engine processes, the four side by side (tests/engine_jobs.py, run_pooled).
"""
from __future__ import annotations

import json
import random
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PAGE = 16
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "host_pool_gib": 0.05, "min_context": 64,
       "resident_first": False}                      # the runs below turn it on
MML, SEQS, BATCHED = 512, 4, 256
# R = cdiv(256, 16) + 4 = 20 free blocks; an arriving prompt asks for its own blocks + 1. 55 usable
# blocks: the first two prompts (19 + 18 blocks) fit resident, then the pool runs below R and
# every later page or prompt takes blocks from the resident ones, a few at a time.
PRESSURE_BLOCKS, SPARE_BLOCKS = 56, 400
POISON = 100.0                      # written into free blocks before every forward (probe)
PROMPTS, MAX_TOKENS, ARRIVE_AFTER = (300, 280, 200), 40, 8   # next one after 8 generated tokens
PREEMPT = ("0", 24)                 # request 0 is preempted once, after 24 generated tokens


def probe(model: str, cfg: dict, num_blocks: int, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.v1.request import RequestStatus

    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.plugin import register

    from engine_jobs import SAME_SCHEDULE
    register()
    llm = LLM(model, dtype="float32", max_model_len=MML, max_num_seqs=SEQS, block_size=PAGE,
              max_num_batched_tokens=BATCHED, enforce_eager=True, seed=0,
              num_gpu_blocks_override=num_blocks, attention_backend="hisparse",
              additional_config={"hisparse": cfg},
              **SAME_SCHEDULE)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    rt = worker_state.get_runtime()
    orig = sched.schedule

    free_now: list[int] = []

    def schedule_and_poison(*a, **k):
        """After each schedule, before its forward: every free block (given back, possibly this
        very step) is overwritten with large keys and values, so a read of one changes outputs.
        The blocks are overwritten right after the step's plan (before its layers), when their
        next owner's forward may first write them: the plan may still copy pages a spill of this
        very step gives back (core/give_back.py); no layer may read one."""
        so = orig(*a, **k)
        free_now[:] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        return so

    def poison():
        for kv in rt._kv:
            if kv is not None and free_now:
                kv[free_now] = POISON
        free_now.clear()

    def after(fn):
        def planned(*a, **k):
            out = fn(*a, **k)
            poison()
            return out
        return planned

    sched.schedule = schedule_and_poison
    rt.plan, rt.plan_full = after(rt.plan), after(rt.plan_full)
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]

    def preempt(rid):
        """What vLLM's scheduler does to the lowest-priority running request when a block is
        missing (and reset_prefix_cache to every one): its blocks freed, back to waiting,
        recomputed from token 0 when it resumes."""
        [req] = [r for k, r in sched.requests.items() if k.split("-")[0] == rid]  # engine's id
        assert req.status == RequestStatus.RUNNING
        sched.running.remove(req)
        sched._preempt_request(req, time.monotonic())
        req.async_tokens_to_discard = req.num_output_placeholders
        req.num_output_placeholders = 0
        sched.prev_step_scheduled_req_ids.discard(req.request_id)
        return req.request_id

    def keep_of(rid):
        """Request rid's keep on the worker (None: resident; its window of pages), "gone" while
        the KV manager does not hold it (not admitted yet, waiting to resume, or finished)."""
        ids = [k for k in mgr._seen if k.split("-")[0] == rid and k in rt.reqs]
        return rt.reqs[ids[0]].keep if ids else "gone"

    def agree():
        """The worker's keep of every request the KV manager tracks equals the manager's (None:
        resident); None when this run has no resident_first."""
        if not cfg.get("resident_first"):
            return None
        return all(rt.reqs[r].keep == mgr._keep.get(r) for r in mgr._seen if r in rt.reqs)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
    done, generated, timeline = {}, {}, []
    eng.add_request("0", {"prompt_token_ids": prompts[0]}, sp)
    nxt, preempted = 1, None
    for _ in range(2000):
        for o in eng.step():
            generated[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = o.outputs[0]
        st = rt.stats_dict()
        timeline.append({k: st[k] for k in ("resident_rows", "partial_rows", "spills", "shrinks",
                                            "misses", "resident_requests", "partial_requests")}
                        | {"free_blocks": pool.get_num_free_blocks(), "agree": agree(),
                           "preempted": bool(preempted), "keep": keep_of(PREEMPT[0])})
        if not preempted and generated.get(PREEMPT[0], 0) >= PREEMPT[1]:
            preempted = preempt(PREEMPT[0])
        if nxt < len(prompts) and generated.get(str(nxt - 1), 0) >= ARRIVE_AFTER:
            eng.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, sp)
            nxt += 1
        if len(done) == len(prompts) and rt.stats_dict()["live_requests"] == 0:
            break
    res = {"outputs": [{"tokens": list(done[str(i)].token_ids),
                        "logprobs": [sorted([k, v.logprob] for k, v in d.items())
                                     for d in done[str(i)].logprobs]}
                       for i in range(len(prompts))],
           "stats": rt.stats_dict(), "timeline": timeline,
           "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks}
    with open(out, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four engines, side by side (tests/engine_jobs.py, run_script)."""
    from engine_jobs import run_script, tiny_model

    model = tiny_model()
    return run_script(__file__, tmp_path_factory.mktemp("rf"), {
        "rf": [model, json.dumps(dict(CFG, resident_first=True)), PRESSURE_BLOCKS],
        "hisparse": [model, json.dumps(CFG), PRESSURE_BLOCKS],
        "resident": [model, json.dumps(dict(CFG, host_tier=False)), SPARE_BLOCKS],
        "rf_spare": [model, json.dumps(dict(CFG, resident_first=True)), SPARE_BLOCKS]})


def _no_leaks(res):
    assert res["free_blocks"] == res["num_blocks"] - 1          # block 0 is vLLM's null block
    assert res["stats"]["host_pages_used"] == 0 and res["stats"]["live_requests"] == 0


def test_spills_under_pressure_are_exact(runs):
    rf, resident, hs = runs["rf"], runs["resident"], runs["hisparse"]
    for i, (a, b, c) in enumerate(zip(rf["outputs"], resident["outputs"], hs["outputs"])):
        assert len(a["tokens"]) == MAX_TOKENS
        assert a["tokens"] == b["tokens"] == c["tokens"], f"request {i}: tokens differ"
        assert a["logprobs"] == b["logprobs"] == c["logprobs"], f"request {i}: logprobs differ"
    tl = rf["timeline"]
    first_spill = next(i for i, t in enumerate(tl) if t["spills"] > 0)
    # resident rows were served (and missed nothing) before the first spill, spills happened
    # mid-run and misses only after them
    assert tl[first_spill - 1]["resident_rows"] > 0 and tl[first_spill - 1]["misses"] == 0
    assert rf["stats"]["spills"] > 0 and rf["stats"]["misses"] > 0
    assert rf["stats"]["inserts"] > 0          # spilled pages copied into hot slots at the plan
    # partial spills: requests kept a window of pages beside their hot slots, rows resolved
    # partly through the block table, and a request was shrunk more than once
    assert max(t["partial_requests"] for t in tl) > 0 and rf["stats"]["partial_rows"] > 0
    assert rf["stats"]["shrinks"] > rf["stats"]["spills"] and rf["stats"]["resident_units"] > 0
    # the spilled run held more blocks than hisparse without resident_first at some step
    assert min(t["free_blocks"] for t in tl) < min(t["free_blocks"] for t in hs["timeline"])
    _no_leaks(rf)
    _no_leaks(hs)


def test_worker_residency_follows_the_manager_through_a_preemption(runs):
    """After every step the worker's keep of every request equals the KV manager's; request 0,
    spilled before its preemption, resumes resident on both sides (and may be spilled again)."""
    tl = runs["rf"]["timeline"]
    assert all(t["agree"] for t in tl)
    cut = next(i for i, t in enumerate(tl) if t["preempted"])
    assert any(t["keep"] not in (None, "gone") for t in tl[:cut]), "not spilled before"
    after = [t["keep"] for t in tl[cut:] if t["keep"] != "gone"]
    assert after and after[0] is None, "the resumed request is not resident"
    assert all(t["agree"] is None for t in runs["hisparse"]["timeline"])


def test_no_pressure_no_misses(runs):
    spare, resident = runs["rf_spare"], runs["resident"]
    assert spare["outputs"] == resident["outputs"]
    assert spare["stats"]["spills"] == 0 and spare["stats"]["misses"] == 0
    assert spare["stats"]["resident_rows"] > 0
    _no_leaks(spare)


if __name__ == "__main__":
    probe(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
