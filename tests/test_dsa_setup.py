"""Startup of a hisparse run on an MLA model with a DSA indexer (vllm/mla_setup.py through
setup_check.prepare_config) and the backend routing (plugin.route, the CUDA platform's wrapped
selection), without an engine: what is changed, what is refused (one line naming the setting and
the fix), and which class a CUSTOM layer gets."""
from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

DSA = {"indexer": "dsa", "top_k": 64, "device_buffer_size": 128, "dense_layers": [],
       "host_pool_gib": 0.01}


def mla_config(hs=None, **over):
    hf = SimpleNamespace(index_topk=64, kv_lora_rank=512, qk_rope_head_dim=64)
    mc = SimpleNamespace(use_mla=True, is_encoder_decoder=False, max_model_len=1024,
                         dtype=torch.bfloat16, hf_config=hf, get_num_layers=lambda pc: 4)
    cfg = SimpleNamespace(
        additional_config={"hisparse": dict(DSA, **(hs or {}))}, model_config=mc,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                        decode_context_parallel_size=1, world_size=1,
                                        local_world_size=1, data_parallel_size_local=1),
        cache_config=SimpleNamespace(block_size=None, user_specified_block_size=False,
                                     enable_prefix_caching=True, cache_dtype="auto"),
        attention_config=SimpleNamespace(sparse_mla_force_mqa=False),
        device_config=SimpleNamespace(device_type="cuda"), speculative_config=None,
        use_v2_model_runner=False, kv_transfer_config=None)
    for k, v in over.items():
        obj, attr = k.split("__")
        setattr(getattr(cfg, obj) if obj != "cfg" else cfg, attr, v)
    return cfg


@pytest.mark.parametrize("host_tier, policy, kv", [(True, "lru", "auto"), (False, "lru", "auto"),
                                                   (True, "crf", "auto"), (True, "lru", "fp8_ds_mla"),
                                                   (False, "lru", "fp8_ds_mla")])
def test_prepare_config_sets_what_the_dsa_path_needs(host_tier, policy, kv):
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = mla_config({"host_tier": host_tier, "policy": policy}, cache_config__cache_dtype=kv)
    prepare_config(cfg)                              # crf is served on the DSA path too
    assert cfg.cache_config.block_size == 64 and cfg.cache_config.user_specified_block_size
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.attention_config.sparse_mla_force_mqa is True
    ktc = cfg.kv_transfer_config
    assert (ktc.kv_connector, ktc.kv_connector_module_path, ktc.kv_role) == (
        "HiSparseConnector", "vllm_hisparse.vllm.connector", "kv_both")     # the one connector


def test_ngram_speculation_is_served_with_room_for_its_verify_rows():
    """ngram with k drafts: started when device_buffer_size >= (k + 1) x index_topk; the
    deployment carries k (admission of prompt + max_tokens + k, verify rows of k + 1 tokens)."""
    from vllm_hisparse.vllm.deployment import deployment_of
    from vllm_hisparse.vllm.mla_connector import admission_of
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = mla_config(cfg__speculative_config=SimpleNamespace(method="ngram",
                                                             num_speculative_tokens=1))
    prepare_config(cfg)
    assert deployment_of(cfg).limits.spec_tokens == 1
    req = SimpleNamespace(num_prompt_tokens=1000, max_tokens=10)
    assert admission_of(req, 1024, 1) == (1000, 11) and admission_of(req, 1024) == (1000, 10)
    assert admission_of(req, 1010, 3) == (1000, 10)         # within max_model_len
    assert deployment_of(mla_config()).limits.spec_tokens == 0


REFUSED = [
    ({"device_config__device_type": "cpu"}, None, "indexer='dsa' runs on CUDA only"),
    ({}, {"indexer": "quest", "top_k": 64, "device_buffer_size": 128}, 'set "indexer": "dsa"'),
    ({}, {"dense_layers": [0, 1]}, 'dense_layers=[0, 1] must be []'),
    ({}, {"top_k": 32, "device_buffer_size": 32}, "device_buffer_size=32 must be >= the model's "
                                                  "index_topk=64"),
    ({}, {"top_k": 128, "device_buffer_size": 256}, "top_k=128 differs from the model's "
                                                     'index_topk=64; with indexer \'dsa\''),
    ({"cache_config__cache_dtype": "fp8"}, None, "kv_cache_dtype='fp8' is not supported with "
                                                 "indexer 'dsa'"),
    ({"cache_config__cache_dtype": "fp8_ds_mla", "model_config__max_model_len": 1000}, None,
     "--max-model-len 1000 must be a multiple of 64 with kv_cache_dtype fp8_ds_mla"),
    ({"cache_config__cache_dtype": "fp8_ds_mla"}, {"device_buffer_size": 100},
     "device_buffer_size 100 must be a multiple of 64 with kv_cache_dtype fp8_ds_mla (the pool is "
     "read in 64-token blocks); set it to 128"),
    ({"cache_config__user_specified_block_size": True, "cache_config__block_size": 16}, None,
     "--block-size 16 must be 64"),
    ({"cfg__speculative_config": SimpleNamespace(method="mtp", num_speculative_tokens=1)}, None,
     "method='mtp' is not supported with indexer 'dsa'"),
    ({"cfg__speculative_config": SimpleNamespace(method="ngram", num_speculative_tokens=2)}, None,
     "device_buffer_size=128 must be >= (num_speculative_tokens + 1) x top_k = (2 + 1) x 64 = 192"
     " for DSA speculative decoding; set device_buffer_size=192"),
    ({"parallel_config__tensor_parallel_size": 2}, None, "tensor_parallel_size=2"),
    ({"parallel_config__prefill_context_parallel_size": 2}, None,
     "prefill_context_parallel_size=2 is not supported with indexer 'dsa' yet"),
    ({"model_config__hf_config": SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64)}, None,
     "no DSA indexer"),
    ({}, {"host_pool_gib": 0.001}, "host_pool_gib=0.001 cannot hold one request of "
                                   "max_model_len=1024"),
    ({}, {"policy": "fifo"}, "policy='fifo' is available in the simulator"),
    ({}, {"policy": "belady"}, "implements crf, lru); use \"lru\" (the default) or \"crf\""),
    ({}, {"trace_dir": "/tmp/t"}, "trace_dir='/tmp/t' are Quest"),
    ({"cfg__use_v2_model_runner": True}, None, "VLLM_USE_V2_MODEL_RUNNER=0"),
    ({"cfg__kv_transfer_config": SimpleNamespace(kv_connector="LMCacheConnectorV1")}, None,
     "brings its own KV connector"),
]


@pytest.mark.parametrize("over, hs, words", REFUSED)
def test_what_the_dsa_path_does_not_run_is_refused_in_one_line(over, hs, words):
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = mla_config(**over)
    if hs is not None:
        cfg.additional_config = {"hisparse": dict(DSA, **hs)}
    with pytest.raises(ValueError) as e:
        prepare_config(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_indexer_dsa_on_a_gqa_model_is_refused():
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = mla_config(model_config__use_mla=False)
    with pytest.raises(ValueError, match="needs an MLA model with a DSA indexer.*use \"quest\""):
        prepare_config(cfg)


def test_route_sends_sparse_mla_to_the_mla_backend_only():
    from vllm_hisparse.vllm.plugin import (BACKEND_PATH, MLA_BACKEND_PATH, MLA_FP8_BACKEND_PATH,
                                           route)

    assert route(use_mla=True, use_sparse=True) == MLA_BACKEND_PATH
    assert route(True, True, "fp8_ds_mla") == MLA_FP8_BACKEND_PATH
    for mla, sparse in ((True, False), (False, False), (False, True)):
        for dt in ("auto", "fp8_ds_mla"):
            assert route(mla, sparse, dt) == BACKEND_PATH   # the GQA backend validates (refuses MLA)


def _selector_config(**kw):
    from collections import namedtuple

    fields = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64,
                  use_mla=True, has_sink=False, use_sparse=True, use_mm_prefix=False,
                  use_per_head_quant_scales=False, attn_type="decoder")
    fields.update(kw)
    return namedtuple("Cfg", fields)(**fields)


@pytest.mark.parametrize("why", [[], ["compute capability not supported"]])
def test_cuda_selection_wrap_routes_custom_by_layer_kind(monkeypatch, why):
    """The wrap on a stand-in CUDA platform: CUSTOM + sparse MLA -> the MLA class path after the
    MLA backend's own validation (a stand-in module: the real one needs CUDA's flash attention);
    CUSTOM on a GQA layer and other backends -> the platform's own selection."""
    from vllm_hisparse.vllm import compat as c
    from vllm_hisparse.vllm import plugin

    plugin.register()
    seen = []

    class FakeCuda:
        device_name = "cuda"

        @classmethod
        def get_attn_backend_cls(cls, selected, cfg, num_heads=None):
            seen.append(selected)
            return "stock.path"

        @classmethod
        def get_device_capability(cls):
            return (9, 0)

    for mod, cls in (("mla_backend", "HiSparseMLASparseBackend"),
                     ("mla_fp8_backend", "HiSparseFlashMLASparseBackend")):
        fake = ModuleType(f"vllm_hisparse.vllm.{mod}")
        setattr(fake, cls, SimpleNamespace(
            validate_configuration=lambda device_capability, **kw: list(why)))
        monkeypatch.setitem(sys.modules, f"vllm_hisparse.vllm.{mod}", fake)
    plugin._wrap_cuda_selection(c, FakeCuda)
    custom = c.AttentionBackendEnum.CUSTOM
    if why:
        with pytest.raises(ValueError, match="cannot run this MLA model: compute capability"):
            FakeCuda.get_attn_backend_cls(custom, _selector_config())
        with pytest.raises(ValueError, match="cannot run this MLA model: compute capability"):
            FakeCuda.get_attn_backend_cls(custom, _selector_config(kv_cache_dtype="fp8_ds_mla"))
    else:
        assert FakeCuda.get_attn_backend_cls(custom, _selector_config()) == plugin.MLA_BACKEND_PATH
        assert FakeCuda.get_attn_backend_cls(custom, _selector_config(
            kv_cache_dtype="fp8_ds_mla")) == plugin.MLA_FP8_BACKEND_PATH
    assert FakeCuda.get_attn_backend_cls(custom, _selector_config(use_mla=False,
                                                                  use_sparse=False)) == "stock.path"
    other = c.AttentionBackendEnum.FLASH_ATTN_MLA_SPARSE
    assert FakeCuda.get_attn_backend_cls(other, _selector_config()) == "stock.path"
    assert seen == [custom, other]


def test_fp8_ds_mla_latent_rows_are_656_bytes_in_the_deployment():
    """The deployment sizes fp8_ds_mla latent rows at 656 B (ops/fp8_ds_mla.py), bf16 at 1152 B:
    the host pool's rows and the pool's row bytes follow."""
    from vllm_hisparse.vllm.deployment import deployment_of

    bf = deployment_of(mla_config())
    f8 = deployment_of(mla_config(cache_config__cache_dtype="fp8_ds_mla"))
    assert (bf.limits.latent_row_bytes, f8.limits.latent_row_bytes) == (1152, 656)
    assert (bf.latent.row_bytes, f8.latent.row_bytes) == (1152, 656)
    assert f8.latent.host_rows == int(0.01 * (1 << 30)) // (656 * 4)
    assert bf.latent.host_rows == int(0.01 * (1 << 30)) // (1152 * 4)
