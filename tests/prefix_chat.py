"""A fake multi-turn chat driver for prefix caching (docs/design/prefix-caching.md section 4), run
as a script per engine: ``python tests/prefix_chat.py MODE MODEL OUT``.

CONVS conversations x TURNS turns share a system prompt of SYSTEM tokens (>= MIN_CONTEXT, so every
request is sparse from its prompt on); turn t of a conversation is its history (the previous
prompt + the model's greedy reply) + USER new ids; the conversations' turn t go in together, so
live requests hit one cached block 0 (the system prompt's) at once. Greedy, logprobs 5, fp32, a
token budget no prompt chunks under (the design doc's Q1: fp32 CPU prefill is then PC on == off
bit for bit in stock vLLM). After the turns, an abort: a fourth conversation's first turn and a
second turn of conversation 0 go in, the latter is aborted after two steps.

A preemption (PREEMPT, every mode): conversation 1's turn 1, a request with a hit, is preempted
by vLLM's own ``Scheduler._preempt_request`` right after its prefill step and resumes at the next
step, where it hits its own prompt's blocks (and the system prompt's block 0: the floor copies it
again). The driver picks the moment, not a small pool: a preemption changes hisparse's outputs
(the generated tokens' KV, computed by sparse decode rows before it, is recomputed by a dense
prefill after it), so PC on and off must preempt the same request at the same point to be
compared, and after its prefill no generated token's KV exists yet, so no hit block holds
decode-written KV (a hit on such a block would be the decode's KV where PC off recomputes it
densely: docs/design/prefix-caching.md, step 1).

MODE: stock (vLLM's own backend, prefix caching on), on / off (hisparse resident mode, prefix
caching on / off), noswitch (on, the first-step Quest rebuild of a hit turned off), floor0 (on,
no floor copy-on-write: F = 0). Writes {outputs, hits, error, leaks...} as JSON.
"""
from __future__ import annotations

import json
import random
import sys

PAGE, SYSTEM, USER, MAX_TOKENS, CONVS, TURNS = 16, 80, 16, 6, 3, 3
MIN_CONTEXT = 64
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "min_context": MIN_CONTEXT, "host_tier": False}
MML, SEQS, BATCHED = 1024, 8, 2048
PREEMPT = ("c1t1", 1)            # preempted once, after this many engine steps of its turn


def engine(model: str, mode: str):
    from vllm import LLM

    kw = dict(dtype="float32", max_model_len=MML, max_num_seqs=SEQS, block_size=PAGE,
              max_num_batched_tokens=BATCHED, enforce_eager=True, seed=0,
              enable_prefix_caching=mode != "off")
    if mode == "stock":
        return LLM(model, **kw)
    from vllm_hisparse.vllm.plugin import register

    register()
    if mode == "floor0":
        from vllm_hisparse.vllm.spec import HiSparseManager

        HiSparseManager.floor_blocks = 0          # put back after the job (engine_jobs)
    return LLM(model, attention_backend="hisparse", additional_config={"hisparse": CFG}, **kw)


def run(eng, batch: dict, sp, abort_after: dict | None = None,
        preempt_after: dict | None = None) -> dict:
    """Serve {rid: prompt ids} to completion; abort_after / preempt_after {rid: steps}. Returns
    {rid: output}."""
    for rid, ids in batch.items():
        eng.add_request(rid, {"prompt_token_ids": ids}, sp)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        for rid, n in (abort_after or {}).items():
            if steps == n:
                eng.abort_request([rid])
        for rid, n in (preempt_after or {}).items():
            if steps == n:
                preempt(eng.engine_core.engine_core.scheduler, rid)
    return done


def preempt(sched, rid: str) -> None:
    """What vLLM's scheduler does to a running request when a block is missing (its blocks
    freed, back to the front of the waiting queue, recomputed from token 0 when it resumes; as
    tests/test_resident_first_engine.py does). In-process engine core, synchronous scheduling
    (the CPU platform's): nothing of it is in flight between steps."""
    import time

    from vllm.v1.request import RequestStatus

    [req] = [r for k, r in sched.requests.items() if k.split("-")[0] == rid]   # engine's id
    assert req.status == RequestStatus.RUNNING, req.status
    sched.running.remove(req)
    sched._preempt_request(req, time.monotonic())
    req.async_tokens_to_discard = req.num_output_placeholders
    req.num_output_placeholders = 0
    sched.prev_step_scheduled_req_ids.discard(req.request_id)


def record_resumed_hits(sched, into: list) -> None:
    """Each lookup of a request vLLM preempted before (``num_preemptions``, as its own prefix
    cache stats tell them apart) appends [request id, preemptions, hit tokens] to ``into``."""
    mgr = sched.kv_cache_manager
    lookup = mgr.get_computed_blocks

    def get_computed_blocks(request):
        out = lookup(request)
        if request.num_preemptions > 0:
            into.append([request.request_id.split("-")[0], request.num_preemptions, out[1]])
        return out
    mgr.get_computed_blocks = get_computed_blocks


def main(mode: str, model: str, out: str) -> None:
    from vllm import SamplingParams

    llm = engine(model, mode)
    eng = llm.llm_engine
    rt = None
    if mode != "stock":
        from vllm_hisparse.vllm import worker, worker_state

        rt = worker_state.get_runtime()
        if mode == "noswitch":                     # every request looks planned before
            add = rt.add

            def add_unfresh(rid, *a, **k):
                add(rid, *a, **k)
                rt.reqs[rid].fresh = False
            rt.add = add_unfresh
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(SYSTEM)]
    users = [[[rng.randrange(3, 500) for _ in range(USER)] for _ in range(TURNS + 1)]
             for _ in range(CONVS + 1)]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    hist = [list(system) for _ in range(CONVS + 1)]
    res = {"outputs": [], "hits": 0, "error": None, "resumed": []}
    record_resumed_hits(eng.engine_core.engine_core.scheduler, res["resumed"])
    try:
        for t in range(TURNS):
            batch = {f"c{c}t{t}": hist[c] + users[c][t] for c in range(CONVS)}
            done = run(eng, batch, sp, preempt_after=dict([PREEMPT]) if PREEMPT[0] in batch
                       else None)
            for c in range(CONVS):
                o = done[f"c{c}t{t}"]
                toks = list(o.outputs[0].token_ids)
                res["outputs"].append({"tokens": toks, "cached": o.num_cached_tokens,
                                       "logprobs": [sorted([k, v.logprob] for k, v in d.items())
                                                    for d in o.outputs[0].logprobs]})
                res["hits"] += o.num_cached_tokens
                hist[c] = batch[f"c{c}t{t}"] + toks
        # an abort mid-turn of a request sharing the cached prefix
        run(eng, {"abort": hist[0] + users[0][TURNS], "c3t0": hist[CONVS] + users[CONVS][0]},
            sp, abort_after={"abort": 2})
    except Exception as e:                          # floor0 may be refused by RequestRows
        res["error"] = f"{type(e).__name__}: {e}"
    for _ in range(4):          # a finished request is dropped by the worker at the next step
        if rt is None or not rt.reqs:
            break
        eng.step()
    sched = eng.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    res["free_blocks"], res["num_blocks"] = pool.get_num_free_blocks(), pool.num_gpu_blocks
    if rt is not None and res["error"] is None:
        w = worker.current()
        res["leaks"] = {"runtime_reqs": len(rt.reqs), "rows": len(w.rows.req_to_block),
                        "blocks_bound": len(w.rows.block_to_req),
                        "indexer_rows_used": rt.ix.rows - len(rt.ix._free)}
        res["stats"] = {k: rt.stats_dict()[k] for k in ("prefix_hits", "turned_sparse")}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
