"""Long prompts of real text for a real model, as token ids (JSON), built here where the texts are
(Debian's manuals and licences, vllm_hisparse/sim/texts.py) and carried to the GPU box.

    python scripts/long_prompts.py MODEL_DIR OUT.json --lengths 20000,24000,28000,32000 \
        [--question "..."]

Prompt i is a different document mix: the available sources in a rotated order, concatenated until
the length is reached, cut at a token boundary, then a fixed question (so each prompt asks the
model to continue or answer about its own long context). The same inputs give the same ids.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_hisparse.sim import texts  # noqa: E402

QUESTION = "\n\nSummarise the document above in five bullet points:\n-"


def build(tokenize, sources: list[str], lengths: list[int], question: str = QUESTION,
          load=texts.load_text) -> list[list[int]]:
    """One token-id list per length: sources rotated by the prompt's index, concatenated, cut to
    length - len(question) tokens, then the question's tokens."""
    if not sources:
        raise SystemExit("no text source available (vllm_hisparse/sim/texts.py lists them)")
    docs = {s: tokenize(load(s)) for s in sources}
    q = tokenize(question)
    out = []
    for i, n in enumerate(lengths):
        if n <= len(q):
            raise SystemExit(f"--lengths: {n} is shorter than the question ({len(q)} tokens)")
        order = sources[i % len(sources):] + sources[:i % len(sources)]
        ids: list[int] = []
        while len(ids) < n - len(q):
            for s in order:
                ids += docs[s]
        out.append(ids[:n - len(q)] + q)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a model folder with its tokenizer")
    p.add_argument("out")
    p.add_argument("--lengths", default="20000,24000,28000,32000")
    p.add_argument("--question", default=QUESTION)
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = build(lambda t: tok(t, add_special_tokens=False)["input_ids"], texts.available(),
                    lengths, a.question)
    with open(a.out, "w") as f:
        json.dump(prompts, f)
    print(f"{a.out}: {len(prompts)} prompts of {[len(x) for x in prompts]} tokens from "
          f"{texts.available()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
