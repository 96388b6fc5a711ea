"""The quality benches' model side (transformers, no vLLM): the Quest config they mirror, loading
SmolLM2-135M or an HF folder with the quality attention, and the dense prefill / decode / crop of
a model's KV cache. bench/quality.py (teacher-forced), bench/quality_greedy.py and
bench/quality_needle.py all use these; they live here so that none of those imports another's
entry point."""
from __future__ import annotations

import inspect
import os

import torch

from vllm_hisparse.config import HiSparseConfig

from . import quality_attention as qa


def quest_config(top_k: int, page_size: int = 16, dense_layers=(0, 1)) -> HiSparseConfig:
    """The serving config the bench mirrors: every request sparse (min_context 0), B = top_k."""
    b = -(-top_k // page_size) * page_size
    return HiSparseConfig(top_k=top_k, device_buffer_size=b, page_size=page_size,
                          dense_layers=tuple(dense_layers), min_context=0)


def load_smollm2():
    """(tokenizer, model) of SmolLM2-135M-Instruct as sim/record.py loads it, fp32, with the
    quality attention function."""
    from vllm_hisparse import smollm2

    return smollm2.load(qa.register())


def load_folder(path: str):
    """(tokenizer, model) of an HF model folder, fp32, with the quality attention function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(f"--model {path}: no HF model folder (config.json) there")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=qa.register())
    return AutoTokenizer.from_pretrained(path), model.eval()


def _forward(model, ids, cache, **kw):
    """model(ids) continuing ``cache`` (transformers renamed past_key_values to cache in 5.x)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, use_cache=True, **{name: cache}, **kw)
    return out.logits, getattr(out, "cache", None) or out.past_key_values


PREFILL_CHUNK = 4096   # prompt tokens per dense prefill pass: sdpa's fp32 path materialises the
                       # (heads, chunk, context) scores (46 GiB for a 32K prompt in one pass)


def _prefill(model, ids, chunk: int = PREFILL_CHUNK):
    """Dense prefill of ids (1, N) in passes of ``chunk`` tokens (one pass up to ``chunk``, as
    before); returns the last position's logits (1, 1, vocab) and the cache."""
    cache, logits = None, None
    for s in range(0, ids.shape[1], chunk):
        logits, cache = _forward(model, ids[:, s:s + chunk], cache, logits_to_keep=1)
    return logits, cache


def _crop(cache, length: int) -> None:
    cache.crop(length - cache.get_seq_length())        # negative: tokens to drop (every version)
    if cache.get_seq_length() != length:
        raise RuntimeError(f"KV cache crop to {length} left {cache.get_seq_length()} tokens")
