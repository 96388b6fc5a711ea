"""Build a tiny random Llama (and a locally trained BPE tokenizer) into an HF model folder, offline.

    python scripts/make_tiny_model.py [OUT_DIR]      # default: models/tiny-llama (git-ignored)
    python -m vllm_hisparse.tiny_model [OUT_DIR]     # the same

Idempotent (a folder with a matching ``hisparse_tiny.json`` stamp is left alone) and fast (~2 s).
Weights are random with a fixed seed and a larger-than-usual init range so attention is peaked:
a wrong KV row changes the logits visibly, which is what the exactness tests need.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from vllm_hisparse.model_dir import build_once

SPEC = {"version": 2, "vocab": 512, "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2,
        "ffn": 256, "max_pos": 4096, "init_range": 0.1, "seed": 0}
DEFAULT_OUT = os.path.join(os.getcwd(), "models", "tiny-llama")


def corpus() -> list[str]:
    """Local English text to train the tokenizer on (license texts ship with every Debian)."""
    files = sorted(glob.glob("/usr/share/common-licenses/*"))[:8]
    texts = []
    for f in files:
        try:
            with open(f, errors="ignore") as fh:
                texts.append(fh.read())
        except (IsADirectoryError, PermissionError):
            continue
    if not texts:   # any machine: a fixed fallback so the script never depends on the OS
        texts = ["the quick brown fox jumps over the lazy dog " * 200]
    return texts


def _ready(out: str) -> bool:
    stamp = os.path.join(out, "hisparse_tiny.json")
    if not os.path.exists(stamp):
        return False
    with open(stamp) as f:
        return json.load(f) == SPEC


def build(out: str) -> str:
    """The tiny model in out (built once, whole: model_dir.build_once)."""
    return build_once(out, _ready, _make)


def _make(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SPEC["vocab"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                     eos_token="</s>")
    hf_tok.save_pretrained(out)

    torch.manual_seed(SPEC["seed"])
    cfg = LlamaConfig(vocab_size=SPEC["vocab"], hidden_size=SPEC["hidden"],
                      intermediate_size=SPEC["ffn"], num_hidden_layers=SPEC["layers"],
                      num_attention_heads=SPEC["heads"], num_key_value_heads=SPEC["kv_heads"],
                      max_position_embeddings=SPEC["max_pos"], initializer_range=SPEC["init_range"],
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    with open(os.path.join(out, "hisparse_tiny.json"), "w") as f:
        json.dump(SPEC, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=DEFAULT_OUT)
    print(build(p.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
