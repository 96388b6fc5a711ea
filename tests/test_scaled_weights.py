"""load_format "scaled_dummy" (vllm/scaled_weights.py): norms 1, biases 0, everything else N(0, 0.02^2)
seeded by name and rank, through vLLM's model-loader registry. The proof that attention then
matters runs in the GPU harnesses (scripts/exact_verdict.py); here, the scheme and the loader."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.vllm import scaled_weights as sw

NAMES = {  # vLLM parameter names of the Llama-3-8B and DeepSeek-V3.2 shapes -> kind
    "model.embed_tokens.weight": "normal", "model.layers.0.self_attn.qkv_proj.weight": "normal",
    "model.layers.0.input_layernorm.weight": "one", "model.norm.weight": "one",
    "model.layers.1.self_attn.kv_a_layernorm.weight": "one",
    "model.layers.1.self_attn.indexer.k_norm.weight": "one",
    "model.layers.1.self_attn.indexer.k_norm.bias": "zero",
    "model.layers.1.mlp.gate.e_score_correction_bias": "zero",
    "model.layers.1.mlp.experts.w13_weight": "normal", "lm_head.weight": "normal",
    "model.layers.0.self_attn.qkv_proj.weight_scale": "keep",
}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {n: (64,) if k in ("one", "zero", "keep") else (4, 64, 32) if "experts" in n
              else (96, 64) for n, k in NAMES.items()}
    return {n: torch.rand(s, generator=g) for n, s in shapes.items()}


def test_each_parameter_gets_its_kind():
    p = _params()
    before = {n: t.clone() for n, t in p.items()}
    counts = sw.init_parameters(p.items())
    assert counts == {k: list(NAMES.values()).count(k) for k in ("one", "zero", "normal", "keep")}
    for n, kind in NAMES.items():
        t = p[n]
        if kind == "one":
            assert (t == 1).all(), n
        elif kind == "zero":
            assert (t == 0).all(), n
        elif kind == "keep":
            assert torch.equal(t, before[n]), n
        else:
            assert abs(t.mean().item()) < 0.003 and 0.018 < t.std().item() < 0.022, n
    assert sw.kind("x.weight", torch.zeros(3, dtype=torch.int32)) == "keep"


def test_seeded_by_name_rank_and_seed():
    a, b, c, r1 = _params(0), _params(1), _params(0), _params(0)
    sw.init_parameters(a.items())
    sw.init_parameters(b.items())               # other starting values: the same weights
    sw.init_parameters(c.items(), seed=7)
    sw.init_parameters(r1.items(), rank=1)
    n, m = "lm_head.weight", "model.embed_tokens.weight"
    assert torch.equal(a[n], b[n])
    assert not torch.equal(a[n], a[m][:96])     # same shape, other name: other weights
    assert not torch.equal(a[n], c[n]) and not torch.equal(a[n], r1[n])


def test_registered_with_vllm_and_refuses_bad_extra_config():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from vllm_hisparse.vllm.plugin import register

    register()
    loader = get_model_loader(LoadConfig(load_format=sw.LOAD_FORMAT,
                                         model_loader_extra_config={"std": 0.05, "seed": 3}))
    assert (loader.std, loader.seed) == (0.05, 3)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sdt'\].*known: std, seed"):
        get_model_loader(LoadConfig(load_format=sw.LOAD_FORMAT,
                                    model_loader_extra_config={"sdt": 0.05}))
    with pytest.raises(ValueError, match="std=0.0 is invalid"):
        get_model_loader(LoadConfig(load_format=sw.LOAD_FORMAT,
                                    model_loader_extra_config={"std": 0}))
