"""core/deployment.py: one function sizes every pool, and it gives what the sizing functions it
replaced gave; vllm/deployment.py: the hisparse settings of a vLLM config are parsed once."""
from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError
from vllm_hisparse.core import capacity, gpu_pools
from vllm_hisparse.core.deployment import EngineLimits, resolve
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.latent_runtime import host_pages_for

# (config, limits): long and short servers, dense pool or not, quest_rows, TP, resident mode
CASES = [
    (dict(), EngineLimits(32, 32768, 256, 8, 128, 2)),
    (dict(dense_pool_gib=4), EngineLimits(32, 32768, 256, 8, 128, 2)),
    (dict(dense_pool_gib=0.5, quest_rows=7), EngineLimits(32, 131072, 64, 8, 128, 2)),
    (dict(host_pool_gib=90), EngineLimits(32, 32768, 22, 4, 128, 2, tensor_parallel_size=2)),
    (dict(dense_pool_gib=4), EngineLimits(32, 4096, 256, 8, 128, 2)),        # never sparse
    (dict(min_context=0, dense_layers=()), EngineLimits(4, 256, 64, 2, 32, 4)),
    (dict(top_k=48, device_buffer_size=64, dense_layers=(0,), host_pool_gib=0.05,
          host_tier=False), EngineLimits(4, 512, 16, 2, 32, 4)),
    (dict(page_size=64, top_k=100, device_buffer_size=256), EngineLimits(28, 8192, 8, 2, 64, 2)),
]


def _old(cfg: HiSparseConfig, lim: EngineLimits) -> dict:
    """The sizes as the connector, worker_state and SparseRuntime computed them before."""
    dtype = {2: torch.bfloat16, 4: torch.float32}[lim.dtype_bytes]
    pb = HostKVPool.page_bytes(cfg.page_size, lim.num_kv_heads, lim.head_dim, dtype)
    host = 0
    if gpu_pools.sparse_possible(cfg, lim.max_model_len):
        share = capacity.host_pool_rank_bytes(cfg.host_pool_bytes, lim.tensor_parallel_size)
        host = share // (pb * len(cfg.host_pool_layers(lim.num_layers)))
    dense = gpu_pools.dense_pool_pages(cfg, pb, lim.max_num_seqs, lim.max_model_len)
    ndense = sum(1 for i in range(lim.num_layers) if i in cfg.dense_layers)
    model = capacity.ModelShape(lim.num_layers, lim.num_kv_heads, lim.head_dim, lim.dtype_bytes)
    return {"num_slots": cfg.num_slots, "top_k_units": cfg.top_k_units,
            "min_context": cfg.min_context_tokens,
            "sparse_possible": gpu_pools.sparse_possible(cfg, lim.max_model_len),
            "indexer_rows": gpu_pools.quest_rows(cfg, lim.max_num_seqs, lim.max_model_len),
            "indexer_row_bytes": capacity.indexer_row_bytes(cfg.indexer, model, lim.max_model_len,
                                                            cfg.page_size, ndense),
            "page_bytes": pb, "host_pages": host, "dense_pool_pages": dense,
            "dense_pool_bytes": gpu_pools.dense_pool_bytes(cfg, pb, lim.max_num_seqs,
                                                           lim.max_model_len),
            "admit_pages": host if dense is None else min(host, dense)}


@pytest.mark.parametrize("over, lim", CASES)
def test_sizes_are_the_old_functions(over, lim):
    dep = resolve(HiSparseConfig(**over), lim)
    cfg = dep.cfg              # without a machine, the auto sizes are the fixed ones of before
    assert not cfg.auto_fields and dep.auto == ()
    old = _old(cfg, lim)
    assert {k: getattr(dep, k) for k in old} == old
    assert dep.unit_tokens == cfg.page_size and dep.latent is None
    assert dep.host_layers == tuple(cfg.host_pool_layers(lim.num_layers))


def test_the_dsa_latent_pool_is_the_old_sizing():
    """Row sets, regions and host rows of the MLA path (dsa_state.sizes before), per token unit."""
    for over in (dict(), dict(quest_rows=5, prefill_slots=2), dict(host_tier=False)):
        cfg = HiSparseConfig(indexer="dsa", top_k=64, device_buffer_size=128, dense_layers=(),
                             host_pool_gib=0.5, **over)
        dep = resolve(cfg, EngineLimits(4, 1024, 16, latent_row=576, dtype_bytes=2))
        s = dep.latent
        n = cfg.quest_rows or 16
        assert (s.row_bytes, s.row_sets, s.resident) == (1152, n, not cfg.host_tier)
        assert s.regions == (cfg.prefill_slots if cfg.host_tier else n)
        assert s.host_rows == (host_pages_for(cfg.host_pool_bytes, 4, 1152) if cfg.host_tier
                               else 0)
        assert (dep.unit_tokens, dep.num_slots, dep.top_k_units) == (1, 128, 64)


def test_room_line_counts_the_smaller_tier():
    dep = resolve(HiSparseConfig(host_pool_gib=16), EngineLimits(32, 32768, 256, 8, 128, 2))
    assert dep.room() == (4, "quest_rows=256; host pool 16.00 GiB: 8192 pages = 4 requests of "
                             "2048")
    assert dep.room_line().startswith("hisparse: room for 4 requests of max_model_len=32768 ")
    assert "252 rows serve only shorter requests" in dep.idle_rows_note()
    assert dep.tier_requests() == {"indexer_rows": 256, "host_pool": 4, "dense_pool": None}
    dense = resolve(HiSparseConfig(dense_pool_gib=1), EngineLimits(32, 32768, 2, 8, 128, 2))
    assert dense.tier_requests() == {"indexer_rows": 2, "host_pool": 4, "dense_pool": 2}
    # the host pool holds the 30 sparse layers (16 GiB / 30 x 64 KiB); the dense pool is capped
    # at what the 2 rows fill: 2 x 2048 pages x 2 layers x 64 KiB = 0.5 GiB
    assert dense.room() == (2, "quest_rows=2; host pool 16.00 GiB: 8738 pages = 4 requests of "
                               "2048; GPU dense pool 0.50 GiB: 4096 pages = 2 requests")
    short = resolve(HiSparseConfig(), EngineLimits(32, 4096, 64, 8, 128, 2))
    assert short.room()[0] == 64 and "no request can turn sparse" in short.room()[1]
    assert (short.indexer_rows, short.host_pages, short.idle_rows_note()) == (0, 0, None)


@pytest.mark.parametrize("field, kw", [("num_layers", dict(num_layers=0)),
                                       ("max_model_len", dict(max_model_len=0)),
                                       ("max_num_seqs", dict(max_num_seqs=-1))])
def test_bad_limits_fail_in_one_line_naming_the_field(field, kw):
    base = dict(num_layers=4, max_model_len=256, max_num_seqs=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError) as e:
        EngineLimits(**{**base, **kw})
    assert f"{field}=" in str(e.value) and "\n" not in str(e.value)


class FakeModel(SimpleNamespace):          # what the adapter reads of vLLM's ModelConfig
    def get_num_layers(self, pc):
        return 4

    def get_num_kv_heads(self, pc):
        return 2

    def get_head_size(self):
        return 32


def _vc(hs, mml=1024, seqs=8):
    mc = FakeModel(max_model_len=mml, dtype=torch.float32)
    return SimpleNamespace(additional_config={"hisparse": hs}, model_config=mc,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           scheduler_config=SimpleNamespace(max_num_seqs=seqs))


@pytest.fixture
def parses(monkeypatch):
    n = []
    post_init = HiSparseConfig.__post_init__

    def counted(self):
        n.append(1)
        post_init(self)

    monkeypatch.setattr(HiSparseConfig, "__post_init__", counted)
    return n


def test_a_vllm_config_is_parsed_once(parses, tmp_path):
    from vllm_hisparse.vllm.deployment import config_of, deployment_of

    path = tmp_path / "hs.json"
    path.write_text(json.dumps({"top_k": 32, "device_buffer_size": 64, "host_pool_gib": 0.01}))
    vc = _vc(str(path))
    dep = deployment_of(vc)
    assert len(parses) == 1 and dep.num_slots == 4
    path.write_text("not JSON any more")                  # the file is read once
    assert deployment_of(vc) is dep and config_of(vc) is dep.cfg
    # the engine core and the workers get the config pickled, the deployment with it
    again = pickle.loads(pickle.dumps(vc))
    assert deployment_of(again) == dep and len(parses) == 1
    vc.scheduler_config.max_num_seqs = 3                  # new limits: resolved again, not parsed
    assert deployment_of(vc).indexer_rows == 3 and len(parses) == 1
    vc.additional_config["hisparse"] = {"top_k": 16, "device_buffer_size": 32}   # new settings
    assert deployment_of(vc).num_slots == 2 and len(parses) == 2


def test_a_bad_setting_fails_in_one_line_naming_the_field():
    from vllm_hisparse.vllm.deployment import deployment_of

    with pytest.raises(HiSparseConfigError) as e:
        deployment_of(_vc({"device_buffer_size": 1000, "top_k": 2048}))
    msg = str(e.value)
    assert msg.startswith("hisparse config: device_buffer_size=1000 is invalid") and "\n" not in msg


def test_the_machine_is_measured_once(monkeypatch):
    """The RAM the auto host pool is sized from is measured with the parse and travels with the
    config: the engine core re-checks the config after the workers pinned their pools, when less
    RAM is left (re-measured there, this 9 GiB host would refuse the pool it already holds)."""
    from vllm_hisparse.core import host_pool
    from vllm_hisparse.vllm.deployment import deployment_of

    monkeypatch.setattr(host_pool, "host_memory", lambda: {"available": 9 << 30})
    vc = _vc({"top_k": 32, "device_buffer_size": 64})
    dep = deployment_of(vc)
    assert dep.auto == ("host_pool_gib", "quest_rows", "dense_pool_gib")
    # no GPU figure here: max_num_seqs rows (8); the host pool holds what they fill, 64 pages of
    # the 2 sparse layers (8 KiB each, fp32) per request
    assert (dep.indexer_rows, dep.host_pages) == (8, 8 * 64)
    assert dep.cfg.host_pool_bytes == 8 * 64 * 2 * 8192
    monkeypatch.setattr(host_pool, "host_memory", lambda: {"available": 8 << 30})
    again = pickle.loads(pickle.dumps(vc))
    again.scheduler_config.max_num_seqs = 3                 # resolved again, on the same machine
    d2 = deployment_of(again)
    assert d2.limits.machine == dep.limits.machine and d2.indexer_rows == 3
