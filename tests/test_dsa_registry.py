"""The served DSA path finds its indexer in the registry of core/indexers, as the Quest path does
(issue 44 item 3): an MLA indexer is one file plus one registry line. A test-only one,
``ProbeIndexer`` (its selection: every query token attends position 0 only), registered under a
new name for one test (the registry is restored after it), is accepted by the MLA startup check,
kept by the worker object, and asked by the MLA impl's ``forward_mqa`` for each layer's
selection: its selection, not vLLM's top-k buffer, reaches FA3 (a stand-in on the CPU)."""
from __future__ import annotations

import importlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.core.indexers.dsa.indexer import DSAIndexer
from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK, LATENT_ROW

pytestmark = pytest.mark.vllm

BF = torch.bfloat16
LAYERS, MML, K, B, BUDGET = 2, 160, 16, 32, 32
HS = {"indexer": "probe", "top_k": K, "device_buffer_size": B, "dense_layers": [],
      "host_pool_gib": 0.002, "quest_rows": 3}


class ProbeIndexer(DSAIndexer):
    name = "probe"
    calls: list = []

    @classmethod
    def mla_selection(cls, topk_buffer, num_tokens, layer):
        cls.calls.append((layer, num_tokens))
        sel = torch.full((num_tokens, topk_buffer.shape[1]), -1, dtype=torch.int32)
        sel[:, 0] = 0
        return sel


@pytest.fixture
def probe(monkeypatch):
    """The one registry line (``indexers.register("probe", ..., unit="token")``), undone after."""
    from vllm_hisparse import config
    from vllm_hisparse.core import indexers

    monkeypatch.setitem(indexers._PATHS, "probe", f"{__name__}:ProbeIndexer")
    monkeypatch.setitem(config.INDEXERS, "probe", "token")
    ProbeIndexer.calls = []
    return ProbeIndexer


def vconfig(**hs):
    hf = SimpleNamespace(index_topk=K, kv_lora_rank=KV_LORA_RANK,
                         qk_rope_head_dim=LATENT_ROW - KV_LORA_RANK)
    mc = SimpleNamespace(use_mla=True, max_model_len=MML, hf_config=hf, dtype=BF,
                         get_num_layers=lambda pc: LAYERS)
    return SimpleNamespace(
        additional_config={"hisparse": {**HS, **hs}}, model_config=mc,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                        decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=BUDGET),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9, cache_dtype="auto",
                                     block_size=None, user_specified_block_size=False),
        device_config=SimpleNamespace(device_type="cuda"), speculative_config=None,
        use_v2_model_runner=False,
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=0,
                                           static_forward_context={}))


def test_the_startup_check_asks_the_registry(probe):
    from vllm_hisparse.vllm.deployment import config_of
    from vllm_hisparse.vllm.mla_setup import check_mla

    vc = vconfig()
    check_mla(config_of(vc), vc)                     # a registered MLA indexer is accepted
    vc = vconfig(indexer="quest")
    with pytest.raises(ValueError, match='indexer=\'quest\' cannot select.*"dsa" or "dsa_sorted" '
                                         'or "dsa_stable" or "probe"'):
        check_mla(config_of(vc), vc)


def test_the_worker_keeps_the_registered_class(probe):
    from vllm_hisparse.vllm.mla_worker import LatentWorker

    assert LatentWorker.start(vconfig(), LATENT_ROW, K, BF).indexer is ProbeIndexer
    assert LatentWorker.start(vconfig(indexer="dsa"), LATENT_ROW, K, BF).indexer is DSAIndexer
    with pytest.raises(ValueError, match="indexer='quest' does not serve MLA models"):
        LatentWorker.start(vconfig(indexer="quest"), LATENT_ROW, K, BF)


def test_forward_mqa_attends_the_registered_indexers_selection(probe, monkeypatch):
    """One prefill step of 5 tokens in layer 1 of 2: vLLM's buffer selects nothing (-1), the probe
    position 0; FA3 gets one valid row per token, the region row of position 0."""
    from vllm_hisparse.vllm.mla_worker import LatentWorker

    seen = {}

    def fake_fa3(q, k, v, q_v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, block_table,
                 softmax_scale, causal, num_splits, fa_version):
        seen["valid"], seen["rows"] = seqused_k.clone(), block_table.clone()
        return torch.zeros(q.shape[0], q.shape[1], KV_LORA_RANK, dtype=q.dtype)

    fa = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    fa.flash_attn_varlen_func = fake_fa3
    pkg = types.ModuleType("vllm.vllm_flash_attn")
    pkg.__path__, pkg.flash_attn_interface = [], fa
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", fa)
    for name in ("vllm.v1.attention.backends.mla.flashattn_mla_sparse",
                 "vllm_hisparse.vllm.mla_backend"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    mb = importlib.import_module("vllm_hisparse.vllm.mla_backend")

    w = LatentWorker.start(vconfig(), LATENT_ROW, K, BF)
    rt = w.runtime
    rt.apply([("admit", "a", 30, 6)])
    w.rows.bind("a", 7)
    n = 5
    w.note([0, n], [n], [7])
    w.plan()
    impl = object.__new__(mb.HiSparseMLASparseImpl)          # what __init__ leaves, on the CPU
    impl.hisparse_worker, impl._layer = w, None
    impl.kv_lora_rank, impl.qk_rope_head_dim = KV_LORA_RANK, LATENT_ROW - KV_LORA_RANK
    impl.scale, impl.num_splits = LATENT_ROW ** -0.5, 0
    impl.topk_indices_buffer = torch.full((BUDGET, K), -1, dtype=torch.int32)
    layer = SimpleNamespace(impl=impl)
    impl._static = {"model.layers.1.self_attn.mla_attn": layer}
    lat = torch.randn(n, LATENT_ROW).to(BF)
    impl.do_kv_cache_update(lat[:, :KV_LORA_RANK], lat[:, None, KV_LORA_RANK:], None, None,
                            "auto", None)
    q = torch.randn(n, 2, LATENT_ROW).to(BF)
    impl.forward_mqa((q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]), None, None, layer)
    assert ProbeIndexer.calls == [(1, n)]
    assert seen["valid"].tolist() == [1] * n                # vLLM's buffer would give 0
    first = seen["rows"][:, 0]
    assert (first >= 0).all() and (first == first[0]).all()  # every token: position 0's row
    assert torch.equal(rt.pool.rows[1][first[0]], lat[0])


def test_the_worker_of_dsa_stable_installs_the_stable_topk():
    """``dsa_stable``: the worker's start puts ops/stable_topk.py in place of vLLM's top-k kernels
    (vllm/topk_swap.py, tests/test_stable_topk.py); ``dsa`` leaves them."""
    from vllm import _custom_ops as ops

    from vllm_hisparse.ops import stable_topk
    from vllm_hisparse.vllm import topk_swap
    from vllm_hisparse.vllm.mla_worker import LatentWorker

    was = ops.top_k_per_row_prefill
    try:
        LatentWorker.start(vconfig(indexer="dsa"), LATENT_ROW, K, BF)
        assert ops.top_k_per_row_prefill is was
        LatentWorker.start(vconfig(indexer="dsa_stable"), LATENT_ROW, K, BF)
        assert ops.top_k_per_row_prefill is stable_topk.top_k_per_row_prefill
        assert torch.ops._C.persistent_topk is stable_topk.persistent_topk
    finally:
        topk_swap.uninstall()
    assert ops.top_k_per_row_prefill is was
