"""Greedy decoding with the quality bench's Quest attention (transformers, no vLLM).

The serving path's decode, step by step: the prompt is prefilled once with dense attention (as the
runtime prefills), its last position gives the first token, and every later token comes from a
decode step whose sparse layers attend the runtime's Quest selection (bench/quality_attention.py).
The needle bench uses it to sweep top_k cheaply and to check the vLLM engine against it.
"""
from __future__ import annotations

import torch

from . import quality_attention as qa
from .quality_model import _crop, _forward, _prefill


@torch.no_grad()
def greedy(model, prompt_ids: list[int], cfgs, max_tokens: int) -> list[list[int]]:
    """Greedy token ids (max_tokens each, EOS not special) per entry of cfgs (HiSparseConfig or
    None = dense), all from one dense prefill of prompt_ids."""
    n = len(prompt_ids)
    dev = model.device
    logits, cache = _prefill(model, torch.tensor([prompt_ids], device=dev))
    first = int(logits[0, -1].argmax())
    outs = []
    for cfg in cfgs:
        _crop(cache, n)
        toks = [first]
        for _ in range(max_tokens - 1):
            with qa.Probe(cfg):
                logits, cache = _forward(model, torch.tensor([[toks[-1]]], device=dev), cache)
            toks.append(int(logits[0, -1].argmax()))
        outs.append(toks)
    _crop(cache, n)
    return outs
