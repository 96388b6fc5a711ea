"""GPU check of the vLLM integration: a Llama-3-8B-shaped model with random weights whose attention
matters (load_format=scaled_dummy, vllm/scaled_weights.py; bf16), or a real model, max_model_len
32K, gpu_memory_utilization 0.9, vLLM's CUDA graphs (FULL for uniform decode steps, PIECEWISE for
the others).

    python scripts/gpu_exactness.py run resident OUT_DIR     # one engine per call (fits 10 min)
    python scripts/gpu_exactness.py run resident2 OUT_DIR    # the reference again: must equal
                                                             # resident, or every verdict is VOID
    python scripts/gpu_exactness.py run hisparse OUT_DIR
    python scripts/gpu_exactness.py run elastic OUT_DIR      # hisparse + resident_first (issue 15)
    python scripts/gpu_exactness.py run crf OUT_DIR          # hisparse with the crf policy
    python scripts/gpu_exactness.py run elastic_crf OUT_DIR  # elastic with the crf policy
    python scripts/gpu_exactness.py run control OUT_DIR      # hisparse, every fetch corrupted
                                                             # (the negative control)
    python scripts/gpu_exactness.py compare OUT_DIR [MODE..] # identical tokens + logprobs to
                                                             # resident? (default: hisparse;
                                                             # scripts/exact_verdict.py: EXACT,
                                                             # MISMATCH or VOID)
    EXACT_DETERMINISTIC=1 ...                                # TORCHINDUCTOR_DETERMINISTIC=1 (no
                                                             # timed choice of reduction configs;
                                                             # Qwen2.5 fails to compile with it)
    EXACT_COMPILE=0 ...                                      # no torch.compile: no per-config
                                                             # Inductor kernels (FULL decode
                                                             # graphs only)
    EXACT_WEIGHTS=dummy ...                                  # vLLM's dummy weights (inert
                                                             # attention: every verdict VOID)
    EXACT_MODEL=DIR EXACT_PROMPTS_FILE=P.json ...            # a real model (its own weights) and
                                                             # its prompts (lists of token ids)
    HISPARSE_EXTRA='{"dense_pool_gib": 4}' python scripts/gpu_exactness.py ...
                                                             # merged into both modes' config
    EXACT_PROMPTS=6000,20000,12000,9000 ...                  # other prompt lengths (tokens)
    EXACT_PROMPTS=1200,5000 EXACT_MAX_TOKENS=1500 ...        # a short prompt turning sparse at
                                                             # min_context (2 x B = 2048) mid-decode
    EXACT_MAX_LEN=8192 ...                                   # max_model_len (default 32768; the
                                                             # KV cache must hold one such prompt:
                                                             # 4 GiB at 32K, 1 GiB at 8K)
    EXACT_KV_DTYPE=fp8 ...                                   # every mode with an fp8 (e4m3) KV
                                                             # cache (vLLM's --kv-cache-dtype)
    EXACT_KV_GIB=6 EXACT_UTIL=0.15 ...                       # a fixed KV cache, no profiling: engines
                                                             # side by side on one GPU (elastic with
                                                             # less KV than its prompts: spills)
    HISPARSE_TP=2 [HISPARSE_EXECUTOR=ray] python scripts/gpu_exactness.py ...
                                                             # tensor parallel (scripts/gpu_tp.sh)
    EXACT_SPEC=3 ...                                         # every mode with ngram speculation,
                                                             # 3 drafts a step (SPEC_CONFIG); each
                                                             # prompt a 256-token block repeated
                                                             # (REPEAT_BLOCK: the prompt gives the
                                                             # ngram matches) unless
                                                             # EXACT_PROMPTS_FILE; the verdict also
                                                             # needs equal acceptance counters and
                                                             # some accepted draft (issue 47;
                                                             # EXACT_SPEC_MIN=1: one-token
                                                             # matches, prompt_lookup_min 1)

Each run writes OUT_DIR/MODE.json (tokens, logprobs, runtime stats) and OUT_DIR/MODE.log, and
prints vLLM's KV-capacity lines (KV memory, KV tokens, maximum concurrency at max_model_len). The
resident run also generates every prompt with its context shuffled (a second batch, after the
first: the first batch schedules as in every other mode), the proof that attention matters.
"""
from __future__ import annotations

import json
import os
import shutil
import random
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_verdict  # noqa: E402

WEIGHTS = os.environ.get("EXACT_WEIGHTS", "scaled")        # scaled (attention matters) / dummy
CFG = {"top_k": 512, "device_buffer_size": 1024, "page_size": 16, "dense_layers": [0, 1],
       "host_pool_gib": 16}
PROMPT_LENS = tuple(int(x) for x in os.environ.get("EXACT_PROMPTS", "5000,2100,3500,1200").split(","))
MAX_TOKENS = int(os.environ.get("EXACT_MAX_TOKENS", "64"))
MAX_LEN = int(os.environ.get("EXACT_MAX_LEN", "32768"))   # a KV cache holds one such prompt
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, torch_dtype="bfloat16")
MODES = {"resident": {"host_tier": False}, "resident2": {"host_tier": False}, "hisparse": {"host_tier": True, "resident_first": False},
         "elastic": {"host_tier": True, "resident_first": True},
         "crf": {"host_tier": True, "resident_first": False, "policy": "crf"},
         "elastic_crf": {"host_tier": True, "resident_first": True, "policy": "crf"},
         "control": {"host_tier": True, "resident_first": False}}
CONTROL_ENV = "HISPARSE_TEST_CORRUPT_FETCH"
SPEC = int(os.environ.get("EXACT_SPEC") or 0)              # ngram drafts a step (0: none)
REPEAT_BLOCK = 256        # EXACT_SPEC's prompts: a random block repeated (random weights copy no
                          # text: the prompt itself must hold the ngram matches)
CAPACITY = re.compile(r"(Available KV cache memory.*|GPU KV cache size.*|Maximum concurrency.*|"
                      r"cudagraph_mode.*?[,}]|Capturing CUDA graphs.*)")


def model_dir() -> str:
    if os.environ.get("EXACT_MODEL"):
        return os.environ["EXACT_MODEL"]
    d = os.path.join(ROOT, "models", "llama3-8b-shape")
    if not os.path.exists(os.path.join(d, "config.json")):
        from transformers import LlamaConfig

        tmp = f"{d}.tmp{os.getpid()}"   # engines start side by side: write once, rename
        LlamaConfig(**LLAMA3_8B).save_pretrained(tmp)
        try:
            os.rename(tmp, d)
        except OSError:                 # another engine's rename won: same config
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def spec_config(k: int) -> dict:
    """vLLM's speculative_config of an EXACT_SPEC=k run: ngram, k drafts, 2- to 4-token matches
    (EXACT_SPEC_MIN=1: one-token matches, more drafts where random weights copy little: gpu_dsa's
    DSA_SPEC run accepted 2 of 83 drafts with them, 2026-12-07)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": int(os.environ.get("EXACT_SPEC_MIN") or 2)}


def run(mode: str, out: str) -> int:
    os.makedirs(out, exist_ok=True)
    if mode not in MODES:
        raise SystemExit(f"mode: one of {', '.join(MODES)}, got {mode!r}")
    prompts = os.path.join(out, "prompts.json")
    if os.environ.get("EXACT_PROMPTS_FILE"):
        with open(os.environ["EXACT_PROMPTS_FILE"]) as f:
            ids = json.load(f)
    else:
        rng = random.Random(0)
        ids = [[rng.randrange(1000, 120000) for _ in range(n)] for n in PROMPT_LENS]
        if SPEC:
            from vllm_hisparse.bench.prompts import repeated

            ids = [repeated(p[:REPEAT_BLOCK], len(p)) for p in ids]
    with open(prompts, "w") as f:
        json.dump(ids, f)
    batches = ["--prompts", prompts]
    if mode == "resident":                  # the proof that attention matters: a second batch
        shuffled = os.path.join(out, "shuffled.json")
        with open(shuffled, "w") as f:
            json.dump([exact_verdict.shuffle_context(p, i) for i, p in enumerate(ids)], f)
        batches += ["--prompts", shuffled]
    # one Quest row per prompt (the default, max_num_seqs rows of 32K, is more than a small
    # EXACT_UTIL allows: the startup check refuses it)
    cfg = {**CFG, "quest_rows": len(ids), **json.loads(os.environ.get("HISPARSE_EXTRA", "{}")),
           **MODES[mode]}
    load = ("auto" if os.environ.get("EXACT_MODEL") else
            {"scaled": "scaled_dummy", "dummy": "dummy"}[WEIGHTS])
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "hisparse_generate.py"), "--model",
           model_dir(), "--config", json.dumps(cfg), *batches, "--max-tokens", str(MAX_TOKENS),
           "--dtype", "bfloat16", "--load-format", load, "--skip-tokenizer", "--cuda-graphs",
           "--max-model-len", str(MAX_LEN), "--max-num-seqs", "32",
           "--max-num-batched-tokens", "2048",
           "--gpu-memory-utilization", os.environ.get("EXACT_UTIL", "0.9"),
           "--out", os.path.join(out, f"{mode}.json"),
           "--tensor-parallel-size", os.environ.get("HISPARSE_TP", "1")]
    if os.environ.get("EXACT_COMPILE"):      # 0: no torch.compile (FULL decode graphs only)
        cmd += ["--compile-mode", os.environ["EXACT_COMPILE"]]
    if os.environ.get("EXACT_KV_GIB"):
        cmd += ["--kv-cache-gib", os.environ["EXACT_KV_GIB"]]
    if SPEC:
        cmd += ["--speculative-config", json.dumps(spec_config(SPEC))]
    if os.environ.get("EXACT_KV_DTYPE"):     # fp8: every mode's KV in fp8 e4m3 (ops/fp8.py)
        cmd += ["--kv-cache-dtype", os.environ["EXACT_KV_DTYPE"]]
    if os.environ.get("HISPARSE_EXECUTOR"):
        cmd += ["--distributed-executor-backend", os.environ["HISPARSE_EXECUTOR"]]
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0")
    if os.environ.get("EXACT_DETERMINISTIC", "0") == "1":
        # Inductor without timed choices of reduction configs. Off by default: vLLM 0.26 compiling
        # Qwen2.5-1.5B fails in that mode ("In the deterministic mode of Inductor, we will avoid
        # those benchmarkings", H100, 2026-12-06), and it did not make the 8B shape's modes agree
        env["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    env.pop(CONTROL_ENV, None)
    if mode == "control":
        env[CONTROL_ENV] = "1"
    with open(os.path.join(out, f"{mode}.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    with open(os.path.join(out, f"{mode}.log")) as f:
        text = f.read()
    print(f"== {mode}: rc={rc}")
    for m in CAPACITY.findall(text):
        print("  ", m[:200])
    if rc:
        print(text[-4000:])
    return rc


def _schedule(res: dict):
    """The first batch's recorded schedule (scripts/hisparse_generate.py), or None."""
    info = res.get("batch_info") or [{}]
    return info[0].get("schedule")


def _spec(res: dict):
    """The first batch's acceptance counters (a --speculative-config run), or None."""
    info = res.get("batch_info") or [{}]
    return info[0].get("spec")


def compare(out: str, modes=("hisparse",)) -> int:
    """Each mode against resident (tokens + logprobs), the reference run twice (OUT/resident2.json,
    required), the batches each engine ran, the shuffled-context proof and the negative control
    (OUT/control.json):
    scripts/exact_verdict.py's EXACT (0), MISMATCH (1) or VOID (3)."""
    a = json.load(open(os.path.join(out, "resident.json")))
    again = os.path.join(out, "resident2.json")
    again = json.load(open(again))["batches"][0] if os.path.exists(again) else []
    got = {m: json.load(open(os.path.join(out, f"{m}.json"))) for m in modes}
    ctl = os.path.join(out, "control.json")
    ctl = json.load(open(ctl)) if os.path.exists(ctl) else None
    # a speculative reference (EXACT_SPEC): every mode's acceptance counters too
    spec = None if _spec(a) is None and not SPEC else {
        "reference": _spec(a), **{m: _spec(b) for m, b in got.items()}}
    code, lines = exact_verdict.verdict(
        a["batches"][0], {m: b["batches"][0] for m, b in got.items()},
        None if ctl is None else ctl["batches"][0], a["batches"][1] if len(a["batches"]) > 1 else None,
        None if ctl is None else ctl["stats"].get("misses"), again,
        {"reference": _schedule(a), **{m: _schedule(b) for m, b in got.items()},
         **({} if ctl is None else {"control": _schedule(ctl)})}, spec)
    for mode, b in got.items():
        st = b["stats"]
        print(f"{mode} miss rate {st.get('miss_rate', float('nan')):.4f} ({st.get('misses')} misses "
              f"of {st.get('resolved_units')} selected units, policy {st.get('policy')}, spills "
              f"{st.get('spills')})")
        print(f"{mode} stats:", json.dumps(b["stats"]), "peak decode blocks",
              b["peak_decode_blocks"], "vs resident", a["peak_decode_blocks"],
              "preemptions", b.get("preemptions"), "vs resident", a.get("preemptions"))
        for rank, s in enumerate(b.get("rank_stats", [])[1:], 1):
            print(f"{mode} rank {rank} stats:", json.dumps(s))
        print(f"elapsed s: resident {a['elapsed_s']:.1f} {mode} {b['elapsed_s']:.1f}")
    if spec is not None and ctl is not None:
        print(f"control acceptance: {json.dumps(_spec(ctl))}")
    print(f"weights: {os.environ.get('EXACT_MODEL') or WEIGHTS}")
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    if sys.argv[1] == "run":
        sys.exit(run(sys.argv[2], sys.argv[3]))
    sys.exit(compare(sys.argv[2], tuple(sys.argv[3:]) or ("hisparse",)))
