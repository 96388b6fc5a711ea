"""GPU check of the DSA path (docs/dsa.md): the 4-layer DeepSeek-V3.2-shaped model (real attention
and indexer dimensions, random weights whose attention matters: load_format scaled_dummy,
vllm/scaled_weights.py; DSA_WEIGHTS=dummy for vLLM's inert ones) in three offline engines on the
same concurrent prompts, greedy, with logprobs, vLLM's CUDA graphs (FULL for uniform decode steps):

    python scripts/gpu_dsa.py run stock MODEL_DIR OUT_DIR      # FLASH_ATTN_MLA_SPARSE
    python scripts/gpu_dsa.py run hisparse MODEL_DIR OUT_DIR   # the latent pool, row sets, host
    python scripts/gpu_dsa.py run resident MODEL_DIR OUT_DIR   # the latent pool, all resident
    python scripts/gpu_dsa.py run resident2 MODEL_DIR OUT_DIR  # the reference again (must equal
                                                               # resident, else every verdict VOID)
    python scripts/gpu_dsa.py run crf MODEL_DIR OUT_DIR        # hisparse under policy crf
    python scripts/gpu_dsa.py run control MODEL_DIR OUT_DIR    # hisparse, every fetch corrupted
    python scripts/gpu_dsa.py compare OUT_DIR                  # tokens + logprobs identical to
                                                               # resident? (exact_verdict.py:
                                                               # EXACT, MISMATCH or VOID)
    python scripts/gpu_dsa.py cap stock|hisparse MODEL_DIR OUT_DIR   # capacity at one GPU budget

``cap`` (issue 17's capacity goal): both engines get the same GPU KV budget, DSA_CAP_KV_GIB
(default 2): stock all of it as vLLM's KV cache (``kv_cache_memory_bytes``), hisparse the latent
pool plus vLLM's indexer-K cache in the same bytes (``hisparse calc``'s split, its --json). Each
runs as many 32K prompts as calc says it holds (stock: its blocks; hisparse: its row sets, bound by
the DSA_CAP_HOST_GIB host pool, default 6), DSA_CAP_OUT (256) greedy outputs each, all sent at once
(with 64 a request finished before the prompts queued behind hisparse's one prefill region came in),
and writes OUT_DIR/cap-MODE.json: requests, output tok/s, vLLM's lines, and for hisparse the most
requests its pool held at once (``max_live_requests``).

    DSA_PROMPTS=8000,20000,12000,16000 DSA_MAX_TOKENS=48 DSA_B=2560 DSA_SPLITS=0 ...
    DSA_INDEXER=dsa_sorted ...   # hisparse / resident with each token's selection sorted by position
                                 # (core/indexers/dsa/sorted.py): is the reference reproducible then?
    DSA_INDEXER=dsa_stable ...   # that, and ties at the k-th score broken by position (vLLM's top-k
                                 # kernels replaced, ops/stable_topk.py, which writes each set in
                                 # position order; the stock engine of this script gets them too:
                                 # it runs in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0)

Every engine uses ``sparse_mla_force_mqa`` (hisparse sets it itself: its prefill attends through
the pool), so stock's prefill chunks take the same MQA path. hisparse gets one prefill region and
one row set per prompt (admission does not bind), so the three runs schedule the same batches and
FA3's num_splits heuristic (``mla_num_splits`` 0, stock's) sees the same shapes (docs/dsa.md,
"Exactness"). Each run writes OUT_DIR/MODE.json (tokens, logprobs, the runtime's hits and misses)
and prints vLLM's KV-capacity lines and the plugin's pool line from its log. DSA_DETERMINISTIC=1 runs
every engine with TORCHINDUCTOR_DETERMINISTIC=1 (Inductor picks no reduction config by timing).
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_verdict  # noqa: E402

LOAD = {"scaled": "scaled_dummy", "dummy": "dummy"}[os.environ.get("DSA_WEIGHTS", "scaled")]
CONTROL_ENV = "HISPARSE_TEST_CORRUPT_FETCH"
SHADOW_ENV = "HISPARSE_TEST_SHADOW"

PROMPTS = [int(x) for x in os.environ.get("DSA_PROMPTS", "8000,20000,12000,16000").split(",")]
MAX_TOKENS = int(os.environ.get("DSA_MAX_TOKENS", "48"))
MAX_LEN = int(os.environ.get("DSA_MAX_LEN", "24576"))
UTIL = float(os.environ.get("DSA_UTIL", "0.85"))
CFG = {"indexer": os.environ.get("DSA_INDEXER", "dsa"), "top_k": 2048, "device_buffer_size": int(os.environ.get("DSA_B", "2560")),
       "dense_layers": [], "host_pool_gib": 8, "quest_rows": len(PROMPTS),
       "prefill_slots": len(PROMPTS), "mla_num_splits": int(os.environ.get("DSA_SPLITS", "0")),
       # a region a prompt: resident_first would lend each its region for life (no RESOLVE, no
       # misses); off, every decode token goes through its row set. DSA_ELASTIC=1: lent
       "resident_first": os.environ.get("DSA_ELASTIC", "0") == "1"}
KV = os.environ.get("DSA_KV", "auto")            # fp8_ds_mla: FLASHMLA_SPARSE's 656 B rows
SPEC = int(os.environ.get("DSA_SPEC", "0"))     # ngram drafts a step (0 = none); B >= (k+1) x 2048
MODES = ("stock", "hisparse", "resident")      # each compared with resident (and crf when it ran)
LINES = re.compile(r"(GPU KV cache size.*|Maximum concurrency.*|hisparse dsa: .*|"
                   r"Using .* backend.*|cudagraph_mode.*?[,}]|Error.*|error.*)")


def backend(mode: str, cfg: dict) -> dict:
    """LLM kwargs of a mode: stock FLASH_ATTN_MLA_SPARSE (MQA prefill, as hisparse's), else the
    plugin with the hisparse config ``cfg``."""
    if mode == "stock":
        if cfg["indexer"] == "dsa_stable":   # stock's engine in this process: the same stand-ins
            from vllm_hisparse.core import indexers
            from vllm_hisparse.vllm import topk_swap

            topk_swap.install_for(indexers.get("dsa_stable"))
        return {"attention_config": {"backend": "FLASHMLA_SPARSE" if KV == "fp8_ds_mla" else
                                     "FLASH_ATTN_MLA_SPARSE", "sparse_mla_force_mqa": True}}
    from vllm_hisparse.vllm.plugin import register

    register()
    return {"attention_backend": "hisparse", "additional_config": {"hisparse": cfg}}


def save(res: dict, path: str, line: str) -> int:
    """Add the runtime's stats (hisparse, resident), write ``res`` to ``path``, print ``line``."""
    if res["mode"] != "stock":
        from vllm_hisparse.vllm import worker_state

        res["stats"] = worker_state.get_runtime().stats()
    with open(path, "w") as f:
        json.dump(res, f)
    print(f"{line}; stats {json.dumps(res.get('stats', {}))}", flush=True)
    return 0


def requests(outs) -> list[dict]:
    return [{"prompt_len": len(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
             "logprobs": [sorted([k, v.logprob] for k, v in d.items()) for d in o.outputs[0].logprobs]}
            for o in outs]


def compilation() -> dict:
    """The engines' compilation config; DSA_COMPILE=0: no torch.compile (no Inductor kernels, whose
    per-config compilation can pick other kernels), FULL graphs for decode steps only."""
    cc: dict = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    if os.environ.get("DSA_COMPILE") == "0":
        cc.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    return cc


def run(mode: str, model: str, out: str) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the runtime's stats in-process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.environ.get("DSA_DETERMINISTIC", "0") == "1":      # before torch._inductor reads it
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    if mode in ("control", "shadowctl"):
        os.environ[CONTROL_ENV] = "1"
    else:
        os.environ.pop(CONTROL_ENV, None)
    if mode in ("shadow", "shadowctl"):     # the in-engine check: a resident twin (latent_shadow.py)
        os.environ[SHADOW_ENV] = "1"
    else:
        os.environ.pop(SHADOW_ENV, None)
    from vllm import LLM, SamplingParams

    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    rng = random.Random(0)
    ids = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPTS]
    if SPEC:                  # a 256-token block repeated, one-token lookups: ngram drafts often
        from vllm_hisparse.bench.prompts import repeated

        ids = [repeated(p[:256], len(p)) for p in ids]
    prompts = [{"prompt_token_ids": p} for p in ids]
    kw = dict(model=model, tokenizer_mode="hf", skip_tokenizer_init=True, load_format=LOAD,
              dtype="bfloat16", seed=0, max_model_len=MAX_LEN, max_num_seqs=8,
              max_num_batched_tokens=8192, gpu_memory_utilization=UTIL,
              compilation_config=compilation(), kv_cache_dtype=KV)
    if SPEC:
        kw.update(speculative_config={"method": "ngram", "num_speculative_tokens": SPEC,
                                      "prompt_lookup_max": 4, "prompt_lookup_min": 1},
                  disable_log_stats=False)
    cfg = dict(CFG, host_tier=mode in ("hisparse", "crf", "control", "shadow", "shadowctl"),
               policy="crf" if mode == "crf" else "lru")
    llm = LLM(**kw, **backend(mode, cfg))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True,
                        detokenize=False)
    t0 = time.time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res = {"mode": mode, "elapsed_s": time.time() - t0, "config": cfg, "load_format": LOAD,
           "requests": requests(outs)}
    if SPEC:                                 # acceptance: drafts and accepted tokens
        res["spec"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                       if "spec_decode" in m.name and hasattr(m, "value")}
    if mode == "resident":                  # the proof that attention matters, after the batch
        res["shuffled"] = requests(llm.generate(
            [{"prompt_token_ids": exact_verdict.shuffle_context(p, i)} for i, p in enumerate(ids)],
            sp, use_tqdm=False))
    return save(res, os.path.join(out, f"{mode}.json"),
                f"== {mode}: {len(outs)} requests in {res['elapsed_s']:.1f} s")


def cap(mode: str, model: str, out: str) -> int:
    import subprocess

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kv_gib = float(os.environ.get("DSA_CAP_KV_GIB", "2"))
    host_gib = float(os.environ.get("DSA_CAP_HOST_GIB", "6"))
    n_out, prompt = int(os.environ.get("DSA_CAP_OUT", "256")), 32768
    mml = prompt + n_out
    calc = json.loads(subprocess.run(
        [sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", model, "--context", str(mml),
         "--buffer", str(CFG["device_buffer_size"]), "--top-k", str(CFG["top_k"]),
         "--gpu-kv-gib", str(kv_gib), "--host-gib", str(host_gib), "--json"],
        check=True, capture_output=True, text=True).stdout)
    side = calc["baseline" if mode == "stock" else "hisparse"]
    n = side["max_requests"]
    from vllm import LLM, SamplingParams

    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt)]}
               for _ in range(n)]
    kw = dict(model=model, tokenizer_mode="hf", skip_tokenizer_init=True, load_format=LOAD,
              dtype="bfloat16", seed=0, max_model_len=mml, max_num_seqs=n,
              max_num_batched_tokens=8192, gpu_memory_utilization=UTIL,
              kv_cache_memory_bytes=side["kv_cache_bytes"])
    llm = LLM(**kw, **backend(mode, dict(CFG, host_pool_gib=host_gib, quest_rows=n,
                                         prefill_slots=1)))
    sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False)
    t0 = time.time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.time() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"mode": mode, "kv_budget_gib": kv_gib, "host_pool_gib": host_gib, "requests": n,
           "prompt": prompt, "outputs": n_out, "elapsed_s": dt, "output_tok_s": toks / dt,
           "calc": side}
    return save(res, os.path.join(out, f"cap-{mode}.json"),
                f"== cap {mode}: {n} requests of {prompt} + {n_out} in {dt:.1f} s, "
                f"{toks / dt:.1f} output tok/s")


def show_log(path: str) -> None:
    """vLLM's KV capacity lines, our pool line and errors of an engine's log."""
    seen = set()
    with open(path, errors="replace") as f:
        for m in LINES.findall(f.read()):
            if m not in seen:
                seen.add(m)
                print("  ", m[:220])


def shadow_verdict(st: dict | None, ctl: dict | None) -> tuple[int, str] | None:
    """The in-engine check (HISPARSE_TEST_SHADOW: every decode token's rows against a resident
    twin's, in one engine): EXACT when it compared tokens with misses and found none differing,
    and its negative control (the same with every host fetch wrong) ran and found some."""
    if not st or "shadow_tokens" not in st:
        return None
    n, bad, miss = st["shadow_tokens"], st["shadow_mismatch"], st.get("misses", 0)
    line = (f"in-engine check: {n} decode tokens x layers compared with the resident twin, {bad} "
            f"differ; {miss} misses")
    if ctl and "shadow_tokens" in ctl:
        line += (f"; control: {ctl['shadow_mismatch']} of {ctl['shadow_tokens']} differ "
                 f"({ctl.get('misses', 0)} misses)")
    if bad:
        return exact_verdict.MISMATCH, line + "\nin-engine verdict: MISMATCH"
    if n == 0 or miss == 0 or not ctl or ctl.get("shadow_mismatch", 0) == 0:
        return exact_verdict.VOID, (line + "\nin-engine verdict: VOID (nothing compared, no misses, "
                                    "or no control caught)")
    return exact_verdict.EXACT, line + "\nin-engine verdict: EXACT"


def compare(out: str) -> int:
    """hisparse, stock (and crf, when it ran) against resident, the shuffled-context proof and the
    negative control (exact_verdict.py: EXACT 0, MISMATCH 1, VOID 3)."""
    got = {m: json.load(open(os.path.join(out, f"{m}.json")))
           for m in MODES + ("crf", "control", "resident2", "shadow", "shadowctl")
           if os.path.exists(os.path.join(out, f"{m}.json"))}
    shadow = shadow_verdict(got.get("shadow", {}).get("stats"), got.get("shadowctl", {}).get("stats"))
    if shadow is not None:
        print(shadow[1])
    if "resident" not in got and shadow is not None:
        return shadow[0]
    if "resident" not in got:
        print("resident.json missing: nothing to compare\nVOID")
        return exact_verdict.VOID
    ref, ctl = got["resident"], got.get("control")
    code, lines = exact_verdict.verdict(
        ref["requests"], {m: got[m]["requests"] for m in ("hisparse", "stock", "crf") if m in got},
        None if ctl is None else ctl["requests"], ref.get("shuffled"),
        None if ctl is None else ctl.get("stats", {}).get("misses"),
        got["resident2"]["requests"] if "resident2" in got else [])
    for m in ("hisparse", "resident", "crf", "control"):
        if m in got:
            print(f"{m} stats: {json.dumps(got[m].get('stats'))}")
    for m in ("hisparse", "resident", "resident2", "stock"):
        if "spec" in got.get(m, {}):
            print(f"{m} ngram: {json.dumps(got[m]['spec'])}")
    print(f"weights: {ref.get('load_format', 'dummy')}")
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    if sys.argv[1] == "run":
        sys.exit(run(sys.argv[2], sys.argv[3], sys.argv[4]))
    if sys.argv[1] == "cap":
        sys.exit(cap(sys.argv[2], sys.argv[3], sys.argv[4]))
    if sys.argv[1] == "log":
        show_log(sys.argv[2])
        sys.exit(0)
    sys.exit(compare(sys.argv[2]))
