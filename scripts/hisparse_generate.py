"""Greedy generation through the real vLLM engine with the hisparse backend; JSON out.

    python scripts/hisparse_generate.py --model DIR --config '{"top_k": 48, ...}' \
        --prompts prompts.json [--prompts single.json ...] --max-tokens 32 --out result.json

Each ``--prompts`` file is a list of prompts (token-id lists or strings) generated as one batch,
in order, by one engine, or ``{"prompts": [...], "max_tokens": N}`` for a batch with its own
output length. Runs the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that, after each
batch, it can drain the delayed frees and report the worker runtime's statistics (hit rate, host
pages still used), the peak GPU blocks any request held after its prefill, and after it turned
sparse (core/residency.py: its context at min_context or more).
With ``--tensor-parallel-size N`` (N > 1) the workers are N processes (vLLM's mp executor): their
statistics come back through ``LLM.collective_rpc``, one dict per rank ("rank_stats"; "stats" is
rank 0's).
The output: {"batches": [[{"tokens": [...], "logprobs": [[[id, lp], ...], ...]}, ...]], "stats":
{...}, "peak_decode_blocks": int, "batch_info": [{"stats": {...}, "peak_decode_blocks": int,
"peak_sparse_blocks": int, "schedule": [[[request, tokens], ...], ...]}, ...] (per batch: the
runtime's statistics after it, peaks during it, the tokens each step scheduled per request)}.
With ``--speculative-config JSON`` (vLLM's speculative_config, e.g. ngram) each batch's info also
holds "spec": vLLM's acceptance counters over that batch (SPEC_COUNTERS: drafts, draft tokens,
accepted tokens, from ``LLM.get_metrics()``), and the output "spec" their totals.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from vllm_hisparse.bench.serving_spec import SPEC_METRICS

SPEC_COUNTERS = tuple(SPEC_METRICS.values())


def speculative(text: str | None) -> dict:
    """LLM kwargs for ``--speculative-config``: none without it; with it the config and vLLM's
    stats on (``LLM.get_metrics()`` reports the acceptance counters only with them)."""
    if not text:
        return {}
    return {"speculative_config": json.loads(text), "disable_log_stats": False}


def spec_counters(llm) -> dict:
    """vLLM's acceptance counters so far (SPEC_COUNTERS; 0 where not reported yet)."""
    got = dict.fromkeys(SPEC_COUNTERS, 0)
    for m in llm.get_metrics():               # one sample per engine: summed
        if m.name in got:
            got[m.name] += int(m.value)
    return got


def compilation(cuda_graphs: bool, mode: int | None) -> dict:
    """LLM kwargs for vLLM's compilation: none eager; with graphs the capture sizes, and with
    ``mode`` 0 no torch.compile (so no Inductor kernels), FULL graphs for decode steps only."""
    if not cuda_graphs:
        return {}
    cc: dict = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    if mode is not None:
        cc["mode"] = mode
        if mode == 0:                     # piecewise graphs need the compiled graph's pieces
            cc["cudagraph_mode"] = "FULL_DECODE_ONLY"
    return {"compilation_config": cc}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config", default="{}", help="hisparse config (JSON object or file)")
    p.add_argument("--prompts", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--logprobs", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (GPU runs)")
    p.add_argument("--skip-tokenizer", action="store_true", help="model folder has no tokenizer")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="override the number of KV blocks (small: forces preemption)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache size (vLLM's kv_cache_memory_bytes: no memory profiling, so "
                        "several engines can start side by side on one GPU)")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (fp8: e4m3)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="no --enforce-eager: vLLM's piecewise CUDA graphs around attention")
    p.add_argument("--compile-mode", type=int, default=None,
                   help="vLLM's compilation mode (0: no torch.compile, FULL decode graphs only; "
                        "the exactness bisection of per-config compiled graphs)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative_config (e.g. {\"method\": \"ngram\", ...}); each "
                        "batch's acceptance counters are recorded (batch_info[i].spec)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--distributed-executor-backend", default=None, help="mp or ray (TP > 1)")
    p.add_argument("--heartbeat", type=float, default=0,
                   help="every S seconds (one engine in this process), a line on stderr: elapsed, "
                        "preemptions, the runtime's steps, decode rows, spills, shrinks and live "
                        "requests; a run that stalls or thrashes shows which (0: off)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from vllm import LLM, SamplingParams

    from vllm_hisparse.config import HiSparseConfig
    from vllm_hisparse.core.residency import freed_pages
    from vllm_hisparse.vllm.plugin import register

    register()                     # also where the package is not pip-installed (no entry point)
    from vllm_hisparse.vllm import worker_state
    from vllm_hisparse.vllm.spec import HiSparseManager

    cfg = HiSparseConfig.load(a.config)
    peak = {"blocks": 0, "batch_blocks": 0, "sparse_blocks": 0}
    orig = HiSparseManager.remove_skipped_blocks
    sparse_cfg = cfg if cfg.host_tier else HiSparseConfig.from_dict(dict(cfg.to_dict(),
                                                                         host_tier=True))

    def spy(self, request_id, processed, num_prompt_tokens=None):
        orig(self, request_id, processed, num_prompt_tokens)
        if num_prompt_tokens is not None and processed > num_prompt_tokens:
            real = sum(not b.is_null for b in self.req_to_blocks.get(request_id, ()))
            peak["blocks"] = max(peak["blocks"], real)
            peak["batch_blocks"] = max(peak["batch_blocks"], real)
            lo, hi = freed_pages(sparse_cfg, processed, num_prompt_tokens)
            if hi > lo:                       # past its switch (resident mode: would be)
                peak["sparse_blocks"] = max(peak["sparse_blocks"], real)

    HiSparseManager.remove_skipped_blocks = spy
    from vllm.v1.core.sched.scheduler import Scheduler

    preempt = {"n": 0}
    orig_preempt = Scheduler._preempt_request

    def count_preempt(self, request, timestamp):
        preempt["n"] += 1
        return orig_preempt(self, request, timestamp)

    Scheduler._preempt_request = count_preempt
    # the batches vLLM ran: per step, [request ordinal, tokens scheduled] (vLLM is not
    # batch-invariant: engines compare only where these are equal; scripts/exact_verdict.py)
    order: dict[str, int] = {}
    schedule: list[list[list[int]]] = []
    orig_schedule = Scheduler.schedule

    def record_schedule(self, *args, **kw):
        out = orig_schedule(self, *args, **kw)
        n = out.num_scheduled_tokens
        if n:
            schedule.append(sorted([order.setdefault(r, len(order)), int(t)] for r, t in n.items()))
        return out

    Scheduler.schedule = record_schedule
    # prefix caching off in every mode: resident mode keeps vLLM's (on by default) while the host
    # tier turns it off, so hits would give the reference other schedules than the engines it checks
    llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              enable_prefix_caching=False,
              kv_cache_dtype=a.kv_cache_dtype,
              max_num_batched_tokens=a.max_num_batched_tokens, enforce_eager=not a.cuda_graphs,
              seed=0, attention_backend="hisparse", additional_config={"hisparse": cfg.to_dict()},
              load_format=a.load_format, skip_tokenizer_init=a.skip_tokenizer,
              gpu_memory_utilization=a.gpu_memory_utilization, num_gpu_blocks_override=a.num_blocks,
              tensor_parallel_size=a.tensor_parallel_size,
              **({"kv_cache_memory_bytes": int(a.kv_cache_gib * 2**30)} if a.kv_cache_gib else {}),
              distributed_executor_backend=a.distributed_executor_backend,
              **compilation(a.cuda_graphs, a.compile_mode), **speculative(a.speculative_config))
    if a.tensor_parallel_size == 1:
        rank_stats = lambda: [_runtime_stats(worker_state.get_runtime())]  # noqa: E731
    else:                                     # the runtimes live in the worker processes
        rank_stats = lambda: llm.collective_rpc(_worker_stats)  # noqa: E731

    def drained() -> list[dict]:
        for _ in range(20):                   # delayed frees complete on the following steps
            stats = rank_stats()
            if all(s["live_requests"] == 0 for s in stats):
                break
            llm.llm_engine.step()
        return stats

    batches, info = [], []
    spec_seen = spec_counters(llm) if a.speculative_config else None
    t0 = time.time()
    if a.heartbeat > 0 and a.tensor_parallel_size == 1:
        _start_heartbeat(a.heartbeat, t0, preempt, worker_state)
    for path in a.prompts:
        with open(path) as f:
            spec = json.load(f)
        if isinstance(spec, list):
            spec = {"prompts": spec}
        sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", a.max_tokens),
                            logprobs=a.logprobs, ignore_eos=True, detokenize=not a.skip_tokenizer)
        prompts = [{"prompt_token_ids": x} if isinstance(x, list) else x for x in spec["prompts"]]
        peak["batch_blocks"] = peak["sparse_blocks"] = 0
        schedule.clear()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        batch_schedule = list(schedule)
        batches.append([{"tokens": list(o.outputs[0].token_ids),
                         "logprobs": [sorted([k, v.logprob] for k, v in d.items())
                                      for d in o.outputs[0].logprobs],
                         "prompt_len": len(o.prompt_token_ids)} for o in outs])
        stats = drained()
        info.append({"stats": stats[0], "peak_decode_blocks": peak["batch_blocks"],
                     "peak_sparse_blocks": peak["sparse_blocks"], "schedule": batch_schedule})
        if spec_seen is not None:             # this batch's drafts and accepted tokens
            now = spec_counters(llm)
            info[-1]["spec"] = {k: now[k] - spec_seen[k] for k in SPEC_COUNTERS}
            spec_seen = now
    res = {"batches": batches, "stats": stats[0], "rank_stats": stats, "batch_info": info,
           "peak_decode_blocks": peak["blocks"], "config": cfg.to_dict(),
           "elapsed_s": time.time() - t0, "preemptions": preempt["n"]}
    if spec_seen is not None:
        res["spec"] = spec_seen
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(json.dumps(res["stats"]))
    return 0


def _start_heartbeat(every: float, t0: float, preempt: dict, worker_state) -> None:
    """A daemon thread printing the run's progress every ``every`` seconds (reads only: counters
    of the in-process runtime and the scheduler's preemptions)."""
    import threading

    def beat():
        while True:
            time.sleep(every)
            try:
                rt = worker_state.get_runtime()
            except RuntimeError:              # not configured yet
                rt = None
            st = rt.stats if rt is not None else {}
            print(json.dumps({"heartbeat_s": round(time.time() - t0, 1), "preemptions": preempt["n"],
                              **{k: st.get(k) for k in ("steps", "full_steps", "decode_rows",
                                                        "spills", "shrinks")},
                              "live_requests": len(rt.reqs) if rt is not None else None}),
                  file=sys.stderr, flush=True)

    threading.Thread(target=beat, daemon=True, name="hisparse-heartbeat").start()


def _runtime_stats(rt) -> dict:
    """The runtime's statistics and the size of its host pool (pages, bytes)."""
    pool = rt.pool
    return dict(rt.stats_dict(), host_pool_pages=pool.num_pages if pool is not None else 0,
                host_pool_bytes=pool.data.numel() * pool.data.element_size() if pool else 0)


def _worker_stats(worker) -> dict:
    """Runs in each worker process (LLM.collective_rpc): that rank's runtime statistics."""
    from vllm_hisparse.vllm import worker_state

    return _runtime_stats(worker_state.get_runtime())


if __name__ == "__main__":
    sys.exit(main())
