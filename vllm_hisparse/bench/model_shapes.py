"""Model directories for GPU benchmarks with `load_format=dummy`: real layer shapes, random weights.

    python -m vllm_hisparse.bench.model_shapes llama3-8b OUT_DIR [MAX_POSITIONS]

MAX_POSITIONS (default 65536) is the config's max_position_embeddings: vLLM sizes its RoPE table
from it, so a server of a longer max_model_len needs it at least as large (128K in + 1K out:
262144; with VLLM_ALLOW_LONG_MAX_MODEL_LEN alone, positions past the table trip a device-side
assert, H100, 2026-12-07).

The KV footprint depends only on layers, KV heads and head_dim, so the benchmark model keeps the
Llama-3-8B attention/MLP shapes but uses the tiny model's locally trained 512-token tokenizer (no
model hub here); generated tokens stay decodable, and the embedding/LM head shrink by ~1 GB.

DeepSeek-V3.2 (MLA + DSA indexer): ``deepseek-v3.2`` has the real config (61 layers; for
``hisparse calc``, far too large to load on one GPU); ``deepseek-v3.2-l4`` / ``-l16`` keep every
attention and indexer dimension (so per-layer KV bytes are real) with 4 / 16 layers and 16 routed
experts, small enough for one 80 GB GPU with dummy or scaled_dummy weights (``CHANGES`` says what
differs from V3.2; the 16-layer one is the realistic depth of issue 46). vLLM picks the
``deepseek_v32`` tokenizer mode for this architecture: serve these folders with
``--tokenizer-mode hf`` (they carry the tiny tokenizer).
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

# DeepSeek-V3.2-Exp's config.json (attention, indexer, MoE, YaRN), less its fp8 quantization
# (dummy weights are bf16) and vocabulary (the tiny tokenizer's)
DEEPSEEK_V32 = dict(
    architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
    index_head_dim=128, index_topk=2048, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
    routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
    moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=163840, num_nextn_predict_layers=1, attention_bias=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
MLA_SHAPES = {
    "deepseek-v3.2": {},
    "deepseek-v3.2-l4": dict(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16,
                             n_group=4, topk_group=2),
    "deepseek-v3.2-l16": dict(num_hidden_layers=16, first_k_dense_replace=1, n_routed_experts=16,
                              n_group=4, topk_group=2),
}
# what each narrowed shape changes against DeepSeek-V3.2 (every attention, MLA and indexer
# dimension, the experts' width and the 8 experts a token are V3.2's)
CHANGES = {
    "deepseek-v3.2-l4": "4 of 61 layers, 1 dense layer of 3, 16 of 256 routed experts in 4 groups",
    "deepseek-v3.2-l16": "16 of 61 layers, 1 dense layer of 3, 16 of 256 routed experts in 4 groups "
                         "(~30 GB of bf16 weights: one H100 keeps ~30 GB for the KV at 0.85)",
}


def mla_config(name: str, vocab_size: int, max_len: int = 65536) -> dict:
    """The config.json dict of an MLA shape (MLA_SHAPES)."""
    return {**DEEPSEEK_V32, **MLA_SHAPES[name], "vocab_size": vocab_size,
            "max_position_embeddings": max(max_len, 4096)}


def build(name: str, out: str, max_len: int = 65536) -> str:
    if name not in SHAPES and name not in MLA_SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose one of "
                         f"{', '.join([*SHAPES, *MLA_SHAPES])}")
    from transformers import LlamaConfig

    from vllm_hisparse import tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tiny_model.build(tmp)
        os.makedirs(out, exist_ok=True)
        for f in os.listdir(tmp):
            if f.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(tmp, f), out)
        vocab = json.load(open(os.path.join(tmp, "config.json")))["vocab_size"]
    if name in MLA_SHAPES:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(mla_config(name, vocab, max_len), f, indent=2)
        return out
    LlamaConfig(vocab_size=vocab, max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False, torch_dtype="bfloat16", **SHAPES[name]).save_pretrained(out)
    return out


def main(argv: list[str]) -> str:
    """NAME OUT_DIR [MAX_POSITIONS] (the module docstring); the folder written."""
    if len(argv) not in (2, 3) or (len(argv) == 3 and not argv[2].isdigit()):
        raise SystemExit(__doc__)
    return build(argv[0], argv[1], *(int(a) for a in argv[2:]))


if __name__ == "__main__":
    print(main(sys.argv[1:]))
