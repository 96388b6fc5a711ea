"""When a finished request's GPU blocks go back (vllm/connector.py ``request_finished``), with
vLLM's real AsyncScheduler (async scheduling, two batches in flight) and the connector in both
roles: the worker side is the real one (its ``bind_connector_metadata`` and ``get_finished``
feed vLLM's ``finished_sending``); only the model is faked (one sampled token per decoding row).

* A request that never can be sparse (prompt + max_tokens below min_context) frees its blocks in
  the step it finishes, as in stock vLLM; an engine whose max_model_len is below min_context is
  stock vLLM (vLLM's backend, no connector: setup_check.serve_as_stock) and runs step for step as
  stock does, free blocks included.
* A request that may be sparse (host pages, indexer row) keeps its blocks and its reservation
  until the worker has dropped it and reported it in ``finished_sending``; one admitted host-less
  (the indexer rows were full: no host page, no row) frees them at once, as one never sparse,
  unless it moved into the host tier before it finished (then it holds pages and a row).
* No request freed at once is ever reported (vLLM asserts each reported id is still a request
  and would free its blocks twice), neither after a normal finish nor after an abort.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 16
CFG = {"top_k": 48, "device_buffer_size": 64, "page_size": PAGE, "dense_layers": [0],
       "host_pool_gib": 0.05, "dense_pool_gib": 0.01, "quest_rows": 3,
       "hostless": "dense"}      # min_context 128
SEQS, BATCHED = 8, 256
# engine -> (max_model_len, GPU blocks, requests: id -> (prompt, max_tokens), aborts: id -> step)
ENGINES = {
    # no request can be sparse (max_model_len < min_context); 12 x (40 + 40) tokens need ~60
    # blocks: vLLM preempts, and finished requests' blocks admit the waiting ones
    "never": (96, 40, {f"n{i}": (40, 30 + 2 * i) for i in range(12)}, {"n3": 6, "n9": 9}),
    # sparse from the first token (p*), turning sparse while decoding (g0: 40 + 100 >= 128), and
    # never sparse (s*: prompt + max_tokens < 128) side by side; quest_rows=3: p3 and g0 find the
    # rows full and run host-less; g0 (100 tokens) moves into the host tier once p* finish
    "mixed": (512, 160, {**{f"p{i}": (150, 12 + 3 * i) for i in range(4)}, "g0": (40, 100),
                         **{f"s{i}": (30, 10 + 4 * i) for i in range(6)}},
              {"s4": 5, "p1": 8}),
}


def scheduler(model: str, backend: str, mml: int, blocks: int, seqs: int = SEQS):
    """(vllm_config, vLLM's AsyncScheduler) over a KV cache of ``blocks`` blocks, async
    scheduling on; hisparse: our spec and connector (also tests/test_async_preempt.py's)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    kw = {}
    if backend == "hisparse":
        from vllm_hisparse.vllm.plugin import register

        register()
        kw = {"attention_backend": "hisparse", "additional_config": {"hisparse": CFG}}
    vc = EngineArgs(model=model, dtype="float32", max_model_len=mml, max_num_seqs=seqs,
                    block_size=PAGE, max_num_batched_tokens=BATCHED, enforce_eager=True,
                    enable_prefix_caching=False, num_gpu_blocks_override=blocks,
                    **kw).create_engine_config()
    vc.cache_config.num_gpu_blocks = blocks
    vc.scheduler_config.async_scheduling = True      # the GPU's default; the CPU platform's off
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    if vc.kv_transfer_config is not None:     # hisparse serves (not an engine stock vLLM serves)
        from vllm_hisparse.vllm.deployment import deployment_of
        from vllm_hisparse.vllm.spec import HiSparseSpec

        fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
        spec = HiSparseSpec(**fields, deployment=deployment_of(vc))
    kvc = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)])
    return vc, AsyncScheduler(vc, kvc, StructuredOutputManager(vc), block_size=PAGE,
                              log_stats=True)


def worker_connector(vc):
    """The connector's worker role, in this process (rank 0 of one: no process group here)."""
    from vllm_hisparse.vllm import connector
    from vllm_hisparse.vllm.compat import KVConnectorRole

    connector.get_tensor_model_parallel_rank = lambda: 0
    return connector.HiSparseConnector(vc, KVConnectorRole.WORKER)


def probe(model: str, backend: str, engine: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    mml, blocks, reqs, aborts = ENGINES[engine]
    vc, s = scheduler(model, backend, mml, blocks)
    work = worker_connector(vc) if vc.kv_transfer_config is not None else None
    conn = s.connector
    for i, (rid, (prompt, max_tokens)) in enumerate(reqs.items()):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        s.add_request(Request(rid, [3 + (7 * i + j) % 500 for j in range(prompt)], sp, None,
                              arrival_time=float(i)))
    held = {}                     # req -> (reserved host pages, holds an indexer row), at admission
    hostless = set()              # admitted host-less
    finished, gone, released, reported, steps = {}, {}, {}, collections.Counter(), []
    inflight, n = collections.deque(), 0

    def observe() -> None:
        for rid in reqs:
            if conn is not None and rid not in held and rid in conn._reserved:
                held[rid] = (conn._reserved[rid], rid in conn._rows_held)
            if conn is not None and rid in getattr(conn, "_hostless", ()):
                hostless.add(rid)
            if rid in finished and rid not in gone and rid not in s.requests:
                gone[rid] = n
            if (conn is not None and rid in held and rid not in released
                    and rid not in conn._reserved):
                released[rid] = n
        steps.append([len(s.running), len(s.waiting),
                      s.kv_cache_manager.block_pool.get_num_free_blocks(), sorted(finished)])

    while s.has_requests() or inflight:
        if s.has_requests() and len(inflight) < 2:       # EngineCore's batch queue, depth 2
            so = s.schedule()
            observe()
            sample = {r: not s.requests[r].is_prefill_chunk for r in so.num_scheduled_tokens}
            kv_out = KVConnectorOutput()
            if work is not None:                         # the worker runs the step in order
                work.bind_connector_metadata(so.kv_connector_metadata)
                kv_out.finished_sending, _ = work.get_finished(so.finished_req_ids)
                work.clear_connector_metadata()
            inflight.append((so, sample, kv_out))
            if len(inflight) < 2 and so.total_num_scheduled_tokens > 0:
                continue
        if not inflight:
            continue
        so, sample, kv_out = inflight.popleft()
        for rid in kv_out.finished_sending or ():
            reported[rid] += 1
            assert rid in s.requests and rid in finished, rid     # vLLM asserts the first too
        ids = list(so.num_scheduled_tokens)
        res = s.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if sample[r] else [] for r in ids],
            kv_connector_output=kv_out))
        n += 1
        for v in res.values():
            for o in v.outputs:
                if o.finish_reason is not None:
                    finished.setdefault(o.request_id, n)
        for rid, at in aborts.items():                   # between steps, as a client's abort
            if at == n and rid in s.requests and rid not in finished:
                finished[rid] = n
                s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        observe()
    leaked = None                 # what the worker and the scheduler side still hold at the end
    if work is not None:
        leaked = [sorted(work.worker.runtime.reqs), sorted(work.worker.rows.req_to_block),
                  sorted(conn._reserved), sorted(conn._rows_held), sorted(conn._sent),
                  sorted(conn._hostless)]
    with open(out, "w") as f:
        json.dump({"finished": finished, "gone": gone, "released": released,
                   "reported": dict(reported), "held": held, "steps": steps, "leaked": leaked,
                   "hostless": sorted(hostless),
                   "sparse_possible": conn is not None and conn.capacity > 0,
                   "stock": [vc.attention_config.backend is None, vc.kv_transfer_config is None]},
                  f)


def run_probes(d, script: str, cases: list[tuple]) -> dict:
    """The tiny model made in d, then ``script MODEL *case OUT`` in a process of its own for each
    case (vLLM's scheduler state is per process), side by side (tests/engine_jobs.py); {case: the
    JSON it wrote}."""
    model = str(d / "tiny-llama")
    subprocess.run([PY, os.path.join(ROOT, "scripts", "make_tiny_model.py"), model], check=True,
                   capture_output=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from engine_jobs import run_all

    outs = {case: str(d / ("-".join(case) + ".json")) for case in cases}
    done = run_all({case: ([PY, script, model, *case, outs[case]], env) for case in cases})
    res = {}
    for case in cases:
        assert done[case].returncode == 0, done[case].stderr[-3000:]
        with open(outs[case]) as f:
            res[case] = json.load(f)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = [("stock", "never"), ("hisparse", "never"), ("hisparse", "mixed")]
    res = run_probes(tmp_path_factory.mktemp("finish_free"), __file__, cases)
    return {(engine, backend): r for (backend, engine), r in res.items()}


def test_never_sparse_engine_frees_blocks_as_stock_vllm(runs):
    stock, hs = runs["never", "stock"], runs["never", "hisparse"]
    reqs = ENGINES["never"][2]
    # no request can be sparse: vLLM's own backend, no connector (setup_check.serve_as_stock)
    assert hs["stock"] == [True, True] and not hs["sparse_possible"] and hs["held"] == {}
    assert sorted(stock["finished"]) == sorted(hs["finished"]) == sorted(reqs)
    assert hs["gone"] == hs["finished"] == stock["gone"] == stock["finished"]
    assert hs["reported"] == {} and hs["leaked"] is None and hs["hostless"] == []
    waited = [w for _, w, _, _ in stock["steps"]]
    assert max(waited) > 0, "requests must wait for finished requests' blocks"
    # (running, waiting, free blocks, finished) after every schedule and every update
    assert hs["steps"] == stock["steps"]


def test_mixed_engine_delays_only_requests_that_may_be_sparse(runs):
    hs = runs["mixed", "hisparse"]
    reqs, aborts = ENGINES["mixed"][2], ENGINES["mixed"][3]
    assert hs["sparse_possible"]
    assert sorted(hs["finished"]) == sorted(reqs)
    may = {r for r, (p, m) in reqs.items() if p + m >= 128}
    assert may == {"p0", "p1", "p2", "p3", "g0"}
    backed = {r for r, (_, row) in hs["held"].items() if row}         # an indexer row each
    assert set(hs["hostless"]) == {"p3", "g0"} and "g0" in backed     # g0 moved to the host
    assert backed - {"p3", "g0"} == {"p0", "p1", "p2"}
    assert all(hs["held"][r][0] > 0 for r in backed)                   # and host pages
    for rid in reqs:
        fin, gone = hs["finished"][rid], hs["gone"][rid]
        if rid in backed:
            # blocks and reservation kept until the worker's report, released with it
            assert gone > fin, rid
            assert hs["reported"].get(rid) == 1, rid
            assert hs["released"][rid] == gone, rid
        else:
            assert gone == fin, rid                    # back in the pool in the step it finished
            assert rid not in hs["reported"], rid
            assert hs["held"].get(rid, [0, False]) == [0, False], rid
    assert {r for r in aborts if r not in backed} and {r for r in aborts if r in backed}
    assert hs["leaked"] == [[]] * 6


if __name__ == "__main__":
    probe(*sys.argv[1:5])
