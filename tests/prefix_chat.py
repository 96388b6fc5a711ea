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
no floor copy-on-write: F = 0). With the host tier and prefix caching on (step 2a, MODES_HOST):
host (every request host-backed, at its floor after its prompt: misses), hostless (a host pool of
one request: the others run host-less), elastic (resident_first on a small GPU pool: spills),
nodonate (host, the donation of hashed hot slots off), nohostfill (host with publishing off, so
every page private: the first step of a hit fills its Quest row but not its host pages). Step 2b
(host pages shared by block hash, core/host_pages.py): nopublish (host, nothing published: every
host page private), poisonshared (host, the first step of a hit overwrites the shared host pages
it must not write). Writes {outputs, hits, error, leaks, host page counts...} as JSON.
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
HOST = dict(CFG, host_tier=True, resident_first=False, host_pool_gib=0.05)
# mode -> (hisparse config, max_model_len, num_gpu_blocks_override) of the host-tier engines.
# hostless: the smallest host pool max_model_len allows holds one request's life (11 pages of
# 32 KiB: the tiny model's 4 layers x 2 KV heads x 32 x fp32), so the others run host-less.
# elastic: 169 usable blocks, the spill reserve R = 2048 / 16 + 8 + 1: spills from the first turn.
MODES_HOST = {"host": (HOST, MML, None),
              "hostless": (dict(HOST, host_pool_gib=11 * 32 / 2**20), 176, None),
              "elastic": (dict(HOST, resident_first=True), MML, 150),
              "nodonate": (HOST, MML, None), "nohostfill": (HOST, MML, None),
              "nopublish": (HOST, MML, None), "poisonshared": (HOST, MML, None)}
POISON = 1.0e4       # poisonshared: what the shared pages of a hit are overwritten with


def engine(model: str, mode: str):
    from vllm import LLM

    cfg, mml, blocks = MODES_HOST.get(mode, (CFG, MML, None))
    kw = dict(dtype="float32", max_model_len=mml, max_num_seqs=SEQS, block_size=PAGE,
              max_num_batched_tokens=BATCHED, enforce_eager=True, seed=0,
              enable_prefix_caching=mode != "off", num_gpu_blocks_override=blocks)
    if mode == "stock":
        return LLM(model, **kw)
    from vllm_hisparse.vllm.plugin import register
    from vllm_hisparse.vllm.spec import HiSparseManager

    register()
    if mode == "floor0":                          # (engine_jobs puts both back after the job)
        HiSparseManager.floor_blocks = 0
    if mode == "nodonate":
        HiSparseManager.donate = False
    return LLM(model, attention_backend="hisparse", additional_config={"hisparse": cfg}, **kw)


def run(eng, batch: dict, sp, abort_after: dict | None = None,
        preempt_after: dict | None = None, each_step=None) -> dict:
    """Serve {rid: prompt ids} to completion; abort_after / preempt_after {rid: steps};
    each_step() after every step. Returns {rid: output}."""
    for rid, ids in batch.items():
        eng.add_request(rid, {"prompt_token_ids": ids}, sp)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if each_step is not None:
            each_step()
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


FIRED = {"pages": 0}   # the host pages a copy control poisoned (written to the result: it fired)


def no_host_fill():
    """nohostfill: the first step of a hit copies its prefix into its Quest row only (every
    request of the driver is sparse from its prompt, so every indexing switch is a hit's); the
    private host pages it skips are POISON, not whatever they held (a page freed by the same
    conversation's last turn may hold the very bytes the copy would write, and prove nothing).
    Returns the undo."""
    from dataclasses import replace

    from vllm_hisparse.core import step_requests

    copy = step_requests.copy_context

    def copy_context(rt, switches, block_table):
        copy(rt, [replace(s, host_pages=None) if s.index else s for s in switches], block_table)
        for s in switches:
            if s.index and s.host_pages is not None:
                skipped = list(s.host_pages[s.shared_upto:-(-s.start // rt.P)])
                rt.pool.data[:, skipped] = POISON
                FIRED["pages"] += len(skipped)
    step_requests.copy_context = copy_context
    return lambda: setattr(step_requests, "copy_context", copy)


def poison_shared():
    """poisonshared: after each hit's first-step copy, its shared host pages (read-only, others
    read them) are overwritten, as a rewrite by a request that must not write them would.
    Returns the undo."""
    from vllm_hisparse.core import step_requests

    copy = step_requests.copy_context

    def copy_context(rt, switches, block_table):
        copy(rt, switches, block_table)
        for s in switches:
            if s.host_pages is not None and s.shared_upto:
                rt.pool.data[:, s.host_pages[:s.shared_upto]] = POISON
                FIRED["pages"] += s.shared_upto
    step_requests.copy_context = copy_context
    return lambda: setattr(step_requests, "copy_context", copy)


def main(mode: str, model: str, out: str) -> None:
    undo = {"nohostfill": no_host_fill, "poisonshared": poison_shared}.get(mode, lambda: None)()
    try:
        _main(mode, model, out)
    finally:
        if undo is not None:
            undo()


def _main(mode: str, model: str, out: str) -> None:
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
    res = {"outputs": [], "hits": 0, "error": None, "resumed": [], "hostless_max": 0}
    sched = eng.engine_core.engine_core.scheduler
    record_resumed_hits(sched, res["resumed"])
    cs = getattr(sched.connector, "connector_scheduler", None) if mode != "stock" else None
    if mode in ("nopublish", "nohostfill"):
        cs.host_pages.publish_enabled = False
    res["host"] = {"live_max": 0, "lives_max": 0, "saved_max": 0, "shared_max": 0}

    def each_step():
        if cs is not None:
            res["hostless_max"] = max(res["hostless_max"], len(cs._hostless))
            hp, h = cs.host_pages, res["host"]
            live = hp.used - hp.evictable           # pages live requests hold
            lives = sum(len(p) for p in cs._pages.values())    # as if each held its own
            h["live_max"] = max(h["live_max"], live)
            h["lives_max"] = max(h["lives_max"], lives)
            h["saved_max"] = max(h["saved_max"], lives - live)
            h["shared_max"] = max(h["shared_max"], sum(cs._shared_upto.values()))
    try:
        for t in range(TURNS):
            batch = {f"c{c}t{t}": hist[c] + users[c][t] for c in range(CONVS)}
            done = run(eng, batch, sp, preempt_after=dict([PREEMPT]) if PREEMPT[0] in batch
                       else None, each_step=each_step)
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
    pool = sched.kv_cache_manager.block_pool
    res["free_blocks"], res["num_blocks"] = pool.get_num_free_blocks(), pool.num_gpu_blocks
    if rt is not None and res["error"] is None:
        w = worker.current()
        res["leaks"] = {"runtime_reqs": len(rt.reqs), "rows": len(w.rows.req_to_block),
                        "blocks_bound": len(w.rows.block_to_req),
                        "indexer_rows_used": rt.ix.rows - len(rt.ix._free),
                        "host_pages_used": rt.host_pages_used}
        res["stats"] = {k: rt.stats_dict()[k] for k in ("prefix_hits", "turned_sparse",
                                                        "spills", "misses")}
        [mgr] = sched.kv_cache_manager.coordinator.single_type_managers
        res["donation"] = dict(mgr.donation)
        if cs is not None and cs.cfg.host_tier:
            hp = cs.host_pages
            res["leaks"]["sched_host_pages_used"] = hp.used
            res["leaks"]["sched_host_pages_indexed"] = len(hp.index)
            res["leaks"]["sched_host_pages_held"] = sum(hp.ref) - len(hp.index)
            res["reset"] = llm.reset_prefix_cache(reset_connector=True)
            res["leaks"]["sched_host_pages_after_reset"] = hp.used
    res["fired"] = FIRED["pages"]
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
