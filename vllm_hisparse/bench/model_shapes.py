"""Model directories for GPU benchmarks with `load_format=dummy`: real layer shapes, random weights.

    python -m vllm_hisparse.bench.model_shapes llama3-8b OUT_DIR

The KV footprint depends only on layers, KV heads and head_dim, so the benchmark model keeps the
Llama-3-8B attention/MLP shapes but uses the tiny model's locally trained 512-token tokenizer (no
model hub here); generated tokens stay decodable, and the embedding/LM head shrink by ~1 GB.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      rms_norm_eps=1e-5),
}


def build(name: str, out: str, max_len: int = 65536) -> str:
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    from transformers import LlamaConfig

    from vllm_hisparse import tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tiny_model.build(tmp)
        os.makedirs(out, exist_ok=True)
        for f in os.listdir(tmp):
            if f.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(tmp, f), out)
        vocab = json.load(open(os.path.join(tmp, "config.json")))["vocab_size"]
    LlamaConfig(vocab_size=vocab, max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False, torch_dtype="bfloat16", **SHAPES[name]).save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(build(sys.argv[1], sys.argv[2]))
