"""Record selection traces from a random model at a trained model's scale: the Llama-3-8B shape's
attention (32 query heads, 8 KV heads, head size 128, hidden 4096, its MLP), fewer layers,
initialised as ``load_format=scaled_dummy`` initialises a served engine (``vllm/scaled_weights``:
norms 1, the rest N(0, 0.02^2)), over random-token prompts: the GPU's "attention-matters" weights'
initialisation, on a CPU. Its selection churns more than the served engine's (teacher-forced over
random tokens, few layers; docs/cache-policies.md compares them).

    python -m vllm_hisparse.bench.scaled_trace --layers 6 --context 6144 --steps 512 --out DIR

Decoding is teacher-forced over random tokens (``sim/record.record_ids``: one causal pass; step s
is the query at position context + s); the served runs decode greedily, so their queries come from
the model's own tokens. Writes DIR/llama3-8b-scaled-L<layers>-<context>.{topk,quest}.npz in the
trace format of ``sim/trace.py`` and prints the proof that attention matters in this model:
the share of 64 positions' greedy tokens that change when the 2,048 tokens before them (or the
whole context, if shorter) are shuffled.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from vllm_hisparse.sim import record
from vllm_hisparse.vllm import scaled_weights

from .model_shapes import SHAPES


def build(layers: int, vocab: int, std: float = scaled_weights.STD,
          seed: int = scaled_weights.SEED, shape: str = "llama3-8b"):
    """A LlamaForCausalLM of ``shape`` with ``layers`` layers, fp32, the recorder's attention,
    scaled_dummy's initialisation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**SHAPES[shape], "num_hidden_layers": layers}, vocab_size=vocab,
                      max_position_embeddings=32768, tie_word_embeddings=False)
    cfg._attn_implementation = record.register_attention()
    model = LlamaForCausalLM(cfg).float().eval()
    scaled_weights.init_parameters(model.named_parameters(), std, seed)
    return model


@torch.no_grad()
def shuffle_changes(model, ids: torch.Tensor, rows: int, seed: int) -> float:
    """Share of ``rows`` decode positions whose greedy token changes when the context before them is
    shuffled (the last token kept): 0 would mean attention does not reach the logits."""
    g = torch.Generator().manual_seed(seed + 1)
    n = ids.shape[1]
    base = model(ids, logits_to_keep=rows).logits[0].argmax(-1)
    perm = torch.randperm(n - rows, generator=g)
    shuf = torch.cat([ids[:, :n - rows][:, perm], ids[:, n - rows:]], 1)
    other = model(shuf, logits_to_keep=rows).logits[0].argmax(-1)
    return float((base != other).float().mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_hisparse.bench.scaled_trace",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6, help="model layers (default 6)")
    p.add_argument("--context", type=int, default=6144, help="prompt tokens (default 6144)")
    p.add_argument("--steps", type=int, default=512, help="decode steps (default 512)")
    p.add_argument("--k", type=int, default=256, help="k_max of the token trace (default 256)")
    p.add_argument("--quest-pages", type=int, default=128, help="k_max of the Quest trace, pages")
    p.add_argument("--page", type=int, default=16, help="Quest page size in tokens (default 16)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--seed", type=int, default=scaled_weights.SEED, help="weights and prompt seed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/traces")
    a = p.parse_args(argv)
    for flag, v in (("--layers", a.layers), ("--context", a.context), ("--steps", a.steps),
                    ("--k", a.k), ("--quest-pages", a.quest_pages), ("--page", a.page)):
        if v < 1:
            raise SystemExit(f"{flag} {v}: give a positive integer")
    if a.quest_pages * a.page > a.context:
        raise SystemExit(f"--quest-pages {a.quest_pages} x --page {a.page} exceeds --context "
                         f"{a.context}: the trace would select every page")
    torch.set_num_threads(a.threads)
    from tqdm import tqdm
    model = build(a.layers, a.vocab, seed=a.seed)
    ids = torch.randint(a.vocab, (1, a.context + a.steps),
                        generator=torch.Generator().manual_seed(a.seed))
    bar = tqdm(total=a.layers, desc="record", unit="layer")
    t0 = time.time()
    rec, _ = record.record_ids(model, ids, a.steps, a.k, a.quest_pages, a.page, bar)
    bar.close()
    changed = shuffle_changes(model, ids[:, :min(a.context, 2048) + 64], 64, a.seed)
    base = dict(model=f"Llama-3-8B shape, {a.layers} layers, vocab {a.vocab}, scaled_dummy init "
                      f"(std {scaled_weights.STD}, seed {a.seed}), fp32",
                text=f"random tokens (seed {a.seed})", context=a.context, steps=a.steps,
                decode="teacher-forced over random tokens",
                shuffled_context_changes=round(changed, 3), seconds=round(time.time() - t0, 1))
    paths = rec.save(a.out, f"llama3-8b-scaled-L{a.layers}-{a.context}", a.context, base,
                     ("topk", "quest")).values()
    print(f"attention matters: shuffling the context changes {100 * changed:.0f}% of 64 greedy "
          f"tokens (0% would mean attention does not reach the logits)")
    print(f"wrote {', '.join(paths)} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
