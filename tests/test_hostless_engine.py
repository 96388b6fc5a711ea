"""Capacity = HBM + host (issue 45 item 1) through the real vLLM 0.26 engine (CPU), ``hostless``
"sparse" (the default): host-less requests are sparse exactly as resident mode runs them.

A host pool of 64 pages is filled by requests 0 and 5 (32 pages each, host-backed). Requests 1-4,
added once those decode, may be sparse too: the pool has no room, so each is admitted *host-less*
(an indexer row, no host page, its whole life in vLLM's GPU blocks) and runs at once, sparse.
Request 3 is aborted while host-less; request 5 is spilled (the probe asks the KV manager for
every block it can take: ``SpillLedger.make_room``) and aborted while host-backed. Once the host
pool has room, requests 1, 2 and 4 move into the host tier (their KV so far bulk-copied to new
host pages); request 4 is aborted right after the step of its move; requests 1 and 2 are then
spilled to their floor and decode reading the pages they gave back from the host (misses).

Outputs: request 1 (host-less, moved, spilled) and request 0 (host-backed, spilled) equal resident
mode's (the same engine with ``host_tier`` false), token ids and logprobs. Request 2 is the
negative control: the probe skips its move's bulk copy, so its host pages hold no KV of its
tokens before the move, and its outputs differ from resident mode's. Afterwards no GPU block,
host page, indexer row, reservation or host-less promise is left.

Both engines run this file as a script (in-process engine core) in the session's kept engine
processes, side by side (tests/engine_jobs.py, run_script).
"""
from __future__ import annotations

import json
import random
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PAGE = 16
# host pool: 64 pages of 24 KiB (the tiny model's 3 sparse layers; layer 0 in the dense pool),
# every size set (none sized from the machine)
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "host_pool_gib": 64 * 24576 / (1 << 30), "dense_pool_gib": 0.01, "quest_rows": 6,
       "min_context": 64}
MML, SEQS, BATCHED, BLOCKS = 512, 6, 128, 110
# id: (prompt, max_tokens). 0 and 5: 500 tokens = 32 pages each, host-backed. 1-4 host-less:
# whole lives 27 + 23 + 15 + 13 = 78 blocks beside 0's and 5's floors (2 x 5) and R = 8 + 6: 102
# of 109 usable blocks; 1, 2 and 4 (63 pages) move once 0 and 5 are gone
FIRST = {"0": (460, 40), "5": (460, 40)}
THEN = {"1": (300, 120), "2": (240, 120), "3": (200, 40), "4": (100, 100)}
ABORT_HOSTLESS = ("3", 6)            # aborted after 6 tokens, host-less
SPILL_5, ABORT_5 = 8, 12             # request 5 spilled after 8 tokens, aborted after 12
SPILL_AFTER_MOVE = 8                 # requests 1 and 2 spilled 8 tokens after their move
CONTROL = "2"                        # its move's bulk copy skipped


def probe(model: str, cfg: dict, out: str) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.plugin import register

    from engine_jobs import SAME_SCHEDULE
    register()
    llm = LLM(model, dtype="float32", max_model_len=MML, max_num_seqs=SEQS, block_size=PAGE,
              max_num_batched_tokens=BATCHED, enforce_eager=True, seed=0,
              num_gpu_blocks_override=BLOCKS, attention_backend="hisparse",
              additional_config={"hisparse": cfg},
              **SAME_SCHEDULE)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    conn = sched.connector.connector_scheduler
    rt = worker_state.get_runtime()
    hosted = cfg.get("host_tier", True)
    base = lambda rid: rid.split("-")[0]                             # noqa: E731
    full = {}                                                        # "1" -> vLLM's id
    sent, moved = [], {}                 # each step's host-less ids; request -> tokens at move
    build = conn.build_connector_meta

    def build_and_record(so):
        md = build(so)
        sent.extend(base(r) for r in md.hostless)
        moved.update({base(r): generated.get(base(r), 0) for r in md.hosted})
        return md
    conn.build_connector_meta = build_and_record

    def control(plan):
        """The negative control around one of the runtime's planners (rt.plan for mixed steps,
        rt.plan_full for FULL decode steps: a move may come in either): CONTROL's move (host_back)
        copies nothing, and the host pages it is handed hold seeded noise of the pool's KV scale
        instead of whatever they held before (a freshly handed page may already hold the right
        bytes, or be read by no step, and prove nothing)."""
        def planned(*a, **k):
            moving = [rid for rid, r in rt.reqs.items() if base(rid) == CONTROL and r.moving]
            for rid in moving:
                rt.reqs[rid].moving = False
            out = plan(*a, **k)
            for rid in moving:
                pages = torch.tensor(rt.pool.page_table(rid), dtype=torch.long)
                g = torch.Generator().manual_seed(2)
                noise = torch.randn(rt.pool.data[:, pages].shape, generator=g)
                kv = rt.pool.data[rt.pool.data != 0].float()
                rt.pool.data[:, pages] = (noise * kv.std()).to(rt.pool.data.dtype)
                poisoned.append(rid)
            return out
        return planned
    poisoned: list = []
    # this runtime's only: the kept process's next engine has its own
    rt.plan, rt.plan_full = control(rt.plan), control(rt.plan_full)

    def spill_all():
        """What the KV manager does when an arriving request needs every block it can free."""
        if conn._ledger is not None:
            conn._ledger.make_room(pool.num_gpu_blocks)

    def abort(rid):
        eng.abort_request([full[rid]])
        aborted[rid] = {"tokens": generated.get(rid, 0), "keep": rt.reqs[full[rid]].keep,
                        "sparse": rt.reqs[full[rid]].sparse,
                        "hostless": rt.reqs[full[rid]].hostless,
                        "host_pages": len(rt.pool.page_table(full[rid])) if rt.pool else 0}

    rng = random.Random(0)
    prompts = {rid: [rng.randrange(3, 512) for _ in range(n)]
               for rid, (n, _) in {**FIRST, **THEN}.items()}

    def add(reqs):
        for rid, (_, n) in reqs.items():
            eng.add_request(rid, {"prompt_token_ids": prompts[rid]},
                            SamplingParams(temperature=0.0, max_tokens=n, logprobs=3,
                                           ignore_eos=True))
    add(FIRST)
    done, generated, timeline, aborted, events = {}, {}, [], {}, {}
    indexer_free = len(rt.ix._free)
    for _ in range(3000):
        for o in eng.step():
            generated[base(o.request_id)] = len(o.outputs[0].token_ids)
            if o.finished:
                done[base(o.request_id)] = o.outputs[0]
        full.update({base(r): r for r in sched.requests})
        conn.stats()                         # the scheduler's report, now (vLLM may ask too)
        timeline.append({
            "running": len(sched.running), "host_pages_used": rt.host_pages_used,
            "sched": dict(conn._sched_report or {}),
            "waiting": sorted(base(r.request_id) for r in sched.waiting),
            "sparse": sorted(base(r) for r, q in rt.reqs.items() if q.sparse),
            "hostless": sorted(base(r) for r, q in rt.reqs.items() if q.hostless),
            "host_pages": {base(r): len(rt.pool.page_table(r)) for r in rt.reqs} if rt.pool
            else {}, "keep": {base(r): q.keep for r, q in rt.reqs.items()},
            "misses": rt.stats_dict()["misses"]})
        if "then" not in events and all(generated.get(r, 0) >= 1 for r in FIRST):
            add(THEN)
            events["then"] = len(timeline)
        if "3" not in aborted and generated.get(ABORT_HOSTLESS[0], 0) >= ABORT_HOSTLESS[1]:
            abort(ABORT_HOSTLESS[0])
        if "spill5" not in events and generated.get("5", 0) >= SPILL_5:
            spill_all()
            events["spill5"] = len(timeline)
        if "5" not in aborted and generated.get("5", 0) >= ABORT_5:
            abort("5")
        if "4" not in aborted and ("4" in moved or not hosted and generated.get("4", 0) >= 40):
            abort("4")                       # right after the step of its move
        if ("spill12" not in events and hosted and {"1", "2"} <= set(moved) and all(
                generated.get(r, 0) >= moved[r] + SPILL_AFTER_MOVE for r in ("1", "2"))):
            events["misses_before"] = rt.stats_dict()["misses"]
            spill_all()
            events["spill12"] = len(timeline)
        if {"0", "1", "2"} <= set(done) and len(aborted) == 3 and not sched.requests:
            break
    eng.step()                                        # the worker drops the last finished ones
    res = {"outputs": {rid: {"tokens": list(o.token_ids),
                             "logprobs": [sorted([k, v.logprob] for k, v in d.items())
                                          for d in o.logprobs]}
                       for rid, o in done.items() if rid not in aborted},
           "timeline": timeline, "stats": rt.stats_dict(), "sent_hostless": sent, "moved": moved,
           "aborted": aborted, "events": events, "poisoned": [base(r) for r in poisoned],
           "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks,
           "left": {"hostless": len(conn._hostless), "reserved": conn._reserved_total,
                    "rows": len(conn._rows_held), "ledger": len(getattr(conn._shared, "hostless",
                                                                        ())),
                    "indexer_free": len(rt.ix._free) - indexer_free}}
    with open(out, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """hisparse with the small host pool and resident mode, side by side (tests/engine_jobs.py,
    run_script): runs[tag] is what the probe wrote."""
    from engine_jobs import run_script, tiny_model

    model = tiny_model()
    return run_script(__file__, tmp_path_factory.mktemp("hostless"), {
        "hisparse": [model, json.dumps(CFG)],
        "resident": [model, json.dumps(dict(CFG, host_tier=False))]})


def test_hostless_requests_run_sparse_and_equal_resident_mode(runs):
    hs, res = runs["hisparse"], runs["resident"]
    tl = hs["timeline"]
    # 1-4 were admitted host-less at once (no wait), sparse from their first token, with no host
    # page while host-less; all six ran at once
    assert max(t["sched"].get("requests_hostless", 0) for t in tl) == 4
    assert sorted(hs["sent_hostless"]) == ["1", "2", "3", "4"]
    assert all(t["sched"].get("waiting_host_pool", 0) == 0 for t in tl)
    assert max(t["running"] for t in tl) == 6
    for t in tl:
        assert set(t["hostless"]) <= set(t["sparse"]), t      # host-less and sparse
        assert all(t["host_pages"][r] == 0 for r in t["hostless"]), t
    # 1, 2 and 4 moved into the host tier mid-decode; 1 and 2 were then spilled to the floor
    assert set(hs["moved"]) == {"1", "2", "4"}
    assert all(0 < hs["moved"][r] < THEN[r][1] for r in hs["moved"])
    assert max(t["sched"].get("requests_moved_to_host", 0) for t in tl) == 3
    after = tl[hs["events"]["spill12"]]
    assert after["keep"]["1"] == 0 and after["keep"]["2"] == 0 and after["host_pages"]["1"] > 0
    # they read the pages they gave back from the host: misses after that spill
    assert hs["stats"]["misses"] > hs["events"]["misses_before"]
    out, ref = hs["outputs"], res["outputs"]
    assert set(out) == set(ref) == {"0", "1", "2"}
    assert all(len(out[r]["tokens"]) == dict(FIRST, **THEN)[r][1] for r in out)
    for rid in ("1", "0"):               # host-less -> moved -> spilled; host-backed, spilled
        assert out[rid]["tokens"] == ref[rid]["tokens"], f"request {rid}: tokens"
        assert out[rid]["logprobs"] == ref[rid]["logprobs"], f"request {rid}: logprobs"
    # the negative control: without its move's bulk copy, request 2 differs from resident mode
    assert hs["poisoned"] == [CONTROL]                        # its move came, and was skipped
    d = [i for i, (a, b) in enumerate(zip(out[CONTROL]["logprobs"], ref[CONTROL]["logprobs"]))
         if a != b]
    # equal before its move, then most steps after it differ (84 of the 84 since, 2026-12-07)
    assert d and d[0] >= hs["moved"][CONTROL] and len(d) >= (THEN[CONTROL][1] - d[0]) // 2, d


def test_aborts_in_each_state_leak_nothing(runs):
    hs = runs["hisparse"]
    ab = hs["aborted"]
    # 3 while host-less (sparse, no host page), 4 right after its move (host pages, resident),
    # 5 while host-backed and spilled
    assert ab["3"]["hostless"] and ab["3"]["sparse"] and ab["3"]["host_pages"] == 0
    assert not ab["4"]["hostless"] and ab["4"]["host_pages"] > 0 and ab["4"]["keep"] is None
    assert ab["4"]["tokens"] == hs["moved"]["4"] + 1          # aborted after the step it moved
    assert not ab["5"]["hostless"] and ab["5"]["keep"] == 0 and ab["5"]["host_pages"] > 0
    assert hs["free_blocks"] == hs["num_blocks"] - 1          # block 0 is vLLM's null block
    assert hs["stats"]["host_pages_used"] == 0 and hs["stats"]["live_requests"] == 0
    assert hs["left"] == {"hostless": 0, "reserved": 0, "rows": 0, "ledger": 0,
                          "indexer_free": 0}


if __name__ == "__main__":
    probe(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
