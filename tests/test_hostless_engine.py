"""Capacity = HBM + host (issue 45 item 1) through the real vLLM 0.26 engine (CPU): a host pool of
32 pages holds request 0 (300 + 40 tokens: 22 pages) and no other; requests 1-3, which may be
sparse too, are admitted *host-less* instead of waiting (the GPU holds them whole beside request
0's floor and the spill reserve) and run at once beside it: dense and resident, no host page, no
indexer row, never spilled, while request 0 (resident_first) is spilled to make room. Request 2 is
preempted once mid-decode and resumes host-less; request 3 is aborted mid-decode, and request 4
takes its place, host-less too; once request 0 has finished, request 4, still decoding, moves
into the host tier (phase 2): sparse from that step on.

Outputs: requests 1 and 2 equal the dense model's (the same engine in resident mode with
min_context above max_model_len: nobody sparse), tokens and logprobs, and request 4 does up to
its move; request 0, sparse here, does not (the tiny model's attention matters), so a host-less
request run sparse would fail. (Request 0's equality with resident mode under spills is
tests/test_resident_first_engine.py's; a moved request's with resident mode switching at the move
is tests/test_hostless_move.py's.)
Afterwards no GPU block, host page, indexer row or host-less promise is left.

Both engines run in subprocesses (this file as a script, in-process engine core), side by side
(tests/engine_jobs.py).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PY = sys.executable
PAGE = 16
# host pool: 0.00075 GiB / (24 KiB a page of the tiny model's 3 sparse layers; layer 0 in the
# dense pool) = 32 pages; every size set (none sized from the machine)
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "host_pool_gib": 0.00075, "dense_pool_gib": 0.01, "quest_rows": 4, "min_context": 64,
       "hostless": "dense"}
MML, SEQS, BATCHED = 384, 4, 128
# 72 usable blocks, R = cdiv(128, 16) + 4 = 12: host-less promises 19 + 14 + 13 (then 12 for
# request 4) blocks beside request 0's floor (5) and R fit (63 <= 72); all four at their longest
# (68) do not fit beside R, so request 0 is spilled
BLOCKS = 73
PROMPTS = (300, 280, 200, 180, 120)
MAX_TOKENS = (40, 24, 24, 24, 72)        # request 0 outlives 1-3; request 4 outlives request 0
PREEMPT = ("2", 12)                 # request 2 (host-less) preempted once after 12 tokens
ABORT = ("3", 6)                    # request 3 (host-less) aborted after 6 tokens


def probe(model: str, cfg: dict, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.v1.request import RequestStatus

    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.plugin import register

    register()
    llm = LLM(model, dtype="float32", max_model_len=MML, max_num_seqs=SEQS, block_size=PAGE,
              max_num_batched_tokens=BATCHED, enforce_eager=True, seed=0,
              num_gpu_blocks_override=BLOCKS, attention_backend="hisparse",
              additional_config={"hisparse": cfg})
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    conn = sched.connector.connector_scheduler
    rt = worker_state.get_runtime()
    sent = []                                        # each step's metadata: its host-less ids
    moved = {}                                       # request -> its tokens when it moved
    build = conn.build_connector_meta

    def build_and_record(so):
        md = build(so)
        sent.extend(r.split("-")[0] for r in md.hostless)
        moved.update({r.split("-")[0]: generated.get(r.split("-")[0], 0)
                      for r in getattr(md, "hosted", ())})
        return md
    conn.build_connector_meta = build_and_record

    def preempt(rid):
        """What vLLM's scheduler does to a running request when a block is missing."""
        [req] = [r for k, r in sched.requests.items() if k.split("-")[0] == rid]
        assert req.status == RequestStatus.RUNNING
        sched.running.remove(req)
        sched._preempt_request(req, time.monotonic())
        req.async_tokens_to_discard = req.num_output_placeholders
        req.num_output_placeholders = 0
        sched.prev_step_scheduled_req_ids.discard(req.request_id)

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPTS]
    for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
        eng.add_request(str(i), {"prompt_token_ids": p},
                        SamplingParams(temperature=0.0, max_tokens=n, logprobs=3, ignore_eos=True))
    done, generated, timeline = {}, {}, []
    preempted = aborted = False
    indexer_free = len(rt.ix._free)
    for _ in range(2000):
        for o in eng.step():
            generated[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = o.outputs[0]
        conn.stats()                         # the scheduler's report, now (vLLM may ask too)
        timeline.append({
            "running": len(sched.running), "host_pages_used": rt.host_pages_used,
            "sched": dict(conn._sched_report),
            "waiting": sorted(r.request_id.split("-")[0] for r in sched.waiting),
            "sparse": sorted(r.split("-")[0] for r, q in rt.reqs.items() if q.sparse),
            "hostless": sorted(r.split("-")[0] for r, q in rt.reqs.items() if q.hostless),
            "spills": rt.stats["spills"], "preempted": preempted})
        if not preempted and generated.get(PREEMPT[0], 0) >= PREEMPT[1]:
            preempt(PREEMPT[0])
            preempted = True
        if not aborted and generated.get(ABORT[0], 0) >= ABORT[1]:
            eng.abort_request([r for r in sched.requests if r.split("-")[0] == ABORT[0]])
            aborted = True
        if {"0", "1", "2", "4"} <= set(done) and aborted and not sched.requests:
            break
    eng.step()                                        # the worker drops the last finished ones
    res = {"outputs": {rid: {"tokens": list(o.token_ids),
                             "logprobs": [sorted([k, v.logprob] for k, v in d.items())
                                          for d in o.logprobs]}
                       for rid, o in done.items() if rid != ABORT[0]},
           "timeline": timeline, "stats": rt.stats_dict(), "sent_hostless": sent, "moved": moved,
           "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks,
           "left": {"hostless": len(conn._hostless), "reserved": conn._reserved_total,
                    "rows": len(conn._rows_held), "ledger": len(getattr(conn._shared, "hostless",
                                                                        ())),
                    "indexer_free": len(rt.ix._free) - indexer_free}}
    with open(out, "w") as f:
        json.dump(res, f)


def job(tmp, model, tag, cfg) -> tuple:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1")
    return [PY, __file__, model, json.dumps(cfg), str(tmp / f"{tag}.json")], env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """hisparse with the small host pool and the dense model, side by side."""
    from engine_jobs import run_all

    tmp = tmp_path_factory.mktemp("hostless")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = subprocess.run([PY, os.path.join(root, "scripts", "make_tiny_model.py")], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
    done = run_all({"hisparse": job(tmp, model, "hisparse", CFG),
                    "dense": job(tmp, model, "dense",
                                 dict(CFG, host_tier=False, min_context=2 * MML))})

    def get(tag):
        r = done[tag]
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        return json.loads((tmp / f"{tag}.json").read_text())
    return get


def test_hostless_requests_run_at_once_and_match_the_dense_model(runs):
    hs, dense = runs("hisparse"), runs("dense")
    tl = hs["timeline"]
    # requests 1-3 were admitted host-less, never waited for the host pool, all four ran at once
    assert max(t["sched"]["requests_hostless"] for t in tl) == 3
    assert all(t["sched"]["waiting_host_pool"] == 0 and t["sched"]["waiting_quest_rows"] == 0
               for t in tl)
    assert max(t["running"] for t in tl) == 4
    # the worker ran them dense (never sparse), request 0 sparse, and request 4 once it moved;
    # request 0 was spilled
    assert {r for t in tl for r in t["hostless"]} == {"1", "2", "3", "4"}
    assert {r for t in tl for r in t["sparse"]} == {"0", "4"}
    assert max(t["host_pages_used"] for t in tl) <= 22 and hs["stats"]["spills"] > 0
    out = hs["outputs"]
    assert set(out) == {"0", "1", "2", "4"}
    assert all(len(out[r]["tokens"]) == MAX_TOKENS[int(r)] for r in out)
    # request 4 moved into the host tier mid-decode, once request 0 had finished
    k = hs["moved"].get("4")
    assert set(hs["moved"]) == {"4"} and 0 < k < MAX_TOKENS[4]
    assert max(t["sched"]["requests_moved_to_host"] for t in tl) == 1
    assert out["4"]["tokens"][:k] == dense["outputs"]["4"]["tokens"][:k]
    assert out["4"]["logprobs"][:k] == dense["outputs"]["4"]["logprobs"][:k]
    for rid in ("1", "2"):
        assert out[rid]["tokens"] == dense["outputs"][rid]["tokens"], f"request {rid}: tokens"
        assert out[rid]["logprobs"] == dense["outputs"][rid]["logprobs"], f"request {rid}"
    # sparse differs from dense here: a host-less request run sparse would not match
    assert out["0"]["logprobs"] != dense["outputs"]["0"]["logprobs"]


def test_finish_abort_and_preemption_leak_nothing(runs):
    hs = runs("hisparse")
    assert hs["free_blocks"] == hs["num_blocks"] - 1          # block 0 is vLLM's null block
    assert hs["stats"]["host_pages_used"] == 0 and hs["stats"]["live_requests"] == 0
    assert hs["left"] == {"hostless": 0, "reserved": 0, "rows": 0, "ledger": 0,
                          "indexer_free": 0}
    # request 2 was sent to the worker host-less when admitted and again when it resumed after
    # its preemption (never sparse: the first test); request 3 left mid-decode
    tl = hs["timeline"]
    assert sorted(hs["sent_hostless"]) == ["1", "2", "2", "3", "4"]
    cut = next(i for i, t in enumerate(tl) if t["preempted"])
    assert any(t["running"] == 4 for t in tl[:cut]) and "2" in tl[cut + 1]["hostless"]


if __name__ == "__main__":
    probe(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
