"""vLLM's real AsyncScheduler (async scheduling, two batches in flight, as on the GPU) with the
hisparse KV spec and connector, and no request that turns sparse (each request's prompt + max_tokens
below min_context, in an engine whose max_model_len reaches it, so hisparse serves: below it,
vLLM's own backend would, setup_check.serve_as_stock): under block pressure it preempts exactly as
stock vLLM does, one request per missing block.

With a *consumer* KV connector vLLM defers the free of a preempted request's blocks until its
in-flight step is processed (Scheduler.defer_block_free), so the preemption loop freed nothing
and preempted every running request after the one asking: on the H200 (4K prompts, 64 at once)
53 -> 18 running in one step, 0.57x stock's throughput. The worker is faked (it samples one token
per decoding request and reports the connector's delayed-free requests, none here: no request
can be sparse, so every finished one frees its blocks at once, as in stock vLLM).
"""
from __future__ import annotations

import collections
import json
import sys

import pytest

pytestmark = pytest.mark.vllm

# the hisparse config, page size and batch budget: tests/test_finish_free.py's (min_context 128)
MML, SEQS, BLOCKS = 128, 16, 50      # 16 x (40 + 50 tokens) need ~96 blocks
N_REQ, PROMPT, OUT = 16, 40, 50


def scheduler(model: str, backend: str):
    from test_finish_free import scheduler as make      # run as a script: tests/ is on the path

    return make(model, backend, MML, BLOCKS, SEQS)[1]


def probe(model: str, backend: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    s = scheduler(model, backend)
    sp = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    for i in range(N_REQ):
        s.add_request(Request(str(i), [3 + (7 * i + j) % 500 for j in range(PROMPT)], sp, None,
                              arrival_time=float(i)))
    preempted = [0]
    orig = s._preempt_request

    def count(req, ts):
        preempted[0] += 1
        return orig(req, ts)

    s._preempt_request = count
    inflight, known, steps, finished, first_finish = collections.deque(), set(), [], 0, None
    while s.has_requests() or inflight:
        if s.has_requests() and len(inflight) < 2:       # EngineCore's batch queue, depth 2
            preempted[0] = 0
            so = s.schedule()
            sample = {r: not s.requests[r].is_prefill_chunk for r in so.num_scheduled_tokens}
            md, drop = so.kv_connector_metadata, set()
            if md is not None:                           # the worker: bind_connector_metadata
                drop = set(md.finished) & known
                known.difference_update(drop | set(md.freed))     # freed: never reported
                known.update(md.new)
            inflight.append((so, sample, drop))
            steps.append([len(s.running), preempted[0]])
            if len(inflight) < 2 and so.total_num_scheduled_tokens > 0:
                continue
        if not inflight:
            continue
        so, sample, drop = inflight.popleft()
        drop |= so.finished_req_ids & known              # the worker: get_finished
        known.difference_update(drop)
        ids = list(so.num_scheduled_tokens)
        res = s.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if sample[r] else [] for r in ids],
            kv_connector_output=KVConnectorOutput(finished_sending=drop or None)))
        finished += sum(o.finish_reason is not None for v in res.values() for o in v.outputs)
        if finished and first_finish is None:
            first_finish = len(steps)                    # the steps scheduled before it
    with open(out, "w") as f:
        json.dump({"defer_block_free": s.defer_block_free, "finished": finished,
                   "connector": type(s.connector).__name__ if s.connector else None,
                   "first_finish": first_finish, "steps": steps}, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_finish_free import run_probes

    res = run_probes(tmp_path_factory.mktemp("async_preempt"), __file__,
                     [("stock",), ("hisparse",)])
    return {backend: r for (backend,), r in res.items()}


def test_preemptions_as_in_stock_vllm(runs):
    stock, hs = runs["stock"], runs["hisparse"]
    assert stock["finished"] == hs["finished"] == N_REQ
    pre = lambda r: [p for _, p in r["steps"]]                          # noqa: E731
    assert sum(pre(stock)) > 0, "the schedule must run out of blocks"
    assert max(pre(stock)) <= 2                                         # one per missing block
    assert (sum(pre(hs)), max(pre(hs))) == (sum(pre(stock)), max(pre(stock)))
    assert hs["connector"] == "HiSparseConnector" and stock["connector"] is None
    assert hs["defer_block_free"] is False
    # the same running requests step by step, also after the first finish: a request that can
    # never be sparse frees its blocks when it finishes, as in stock vLLM
    # (tests/test_finish_free.py)
    assert stock["first_finish"] == hs["first_finish"] > 20
    assert hs["steps"] == stock["steps"]


if __name__ == "__main__":
    probe(*sys.argv[1:4])
