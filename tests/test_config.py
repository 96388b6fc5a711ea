"""HiSparseConfig: loading and one-line errors that name the field, the value and the fix."""
import json

import pytest

from vllm_hisparse import HiSparseConfig, HiSparseConfigError


def test_defaults_and_roundtrip(tmp_path):
    c = HiSparseConfig()
    assert c.device_buffer_size >= c.top_k and c.policy == "lru" and c.host_tier
    p = tmp_path / "c.json"
    p.write_text(json.dumps(c.to_dict()))
    assert HiSparseConfig.from_json(p) == c
    assert HiSparseConfig.load(str(p)) == c
    assert HiSparseConfig.load(json.dumps(c.to_dict())) == c
    assert HiSparseConfig.load(None) == c


def test_frozen():
    with pytest.raises(Exception):
        HiSparseConfig().top_k = 1


def test_derived():
    c = HiSparseConfig(top_k=100, device_buffer_size=256, page_size=16)
    assert (c.unit_tokens, c.top_k_units, c.num_slots) == (16, 7, 16)
    d = HiSparseConfig(top_k=100, device_buffer_size=200, page_size=64, indexer="dsa")
    assert (d.unit_tokens, d.top_k_units, d.num_slots) == (1, 100, 200)


@pytest.mark.parametrize("bad, field, hint", [
    ({"top_kk": 5}, "top_kk", "known keys"),
    ({"top_k": "2048"}, "top_k", "expected int"),
    ({"top_k": True}, "top_k", "expected int"),
    ({"prefetch": 1}, "prefetch", "expected bool"),
    ({"split_dense_decode": "yes"}, "split_dense_decode", "expected bool or NoneType"),
    ({"dense_layers": [0, "1"]}, "dense_layers", "list of int"),
    ({"dense_layers": [1, 1]}, "dense_layers", "distinct"),
    ({"top_k": 2048, "device_buffer_size": 1024}, "device_buffer_size", "2*top_k=4096"),
    ({"top_k": 64, "device_buffer_size": 100, "page_size": 16}, "device_buffer_size", "try 112"),
    ({"page_size": 12}, "page_size", "power of two"),
    ({"policy": "mru"}, "policy", "lru"),
    ({"indexer": "nsa2"}, "indexer", "quest"),
    ({"io_chunk_bytes": 24}, "io_chunk_bytes", "power of two"),
    ({"host_pool_gib": 0}, "host_pool_gib", "positive"),
    ({"min_context": -1}, "min_context", "0"),
])
def test_errors_name_field_value_fix(bad, field, hint):
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig.from_dict(bad)
    msg = str(e.value)
    assert "\n" not in msg and field in msg and hint in msg
    if field in HiSparseConfig.__dataclass_fields__:
        assert repr(bad[field]) in msg


def test_pool_too_small_for_one_request():
    c = HiSparseConfig(host_pool_gib=1.0)
    c.check_host_pool(max_model_len=4096, bytes_per_token_per_layer=4096, num_sparse_layers=32)  # 0.5 GiB
    with pytest.raises(HiSparseConfigError, match=r"host_pool_gib=1.0 .*needs 2.00 GiB"):
        c.check_host_pool(max_model_len=16384, bytes_per_token_per_layer=4096, num_sparse_layers=32)


def test_dense_layers_beyond_model():
    with pytest.raises(HiSparseConfigError, match=r"dense_layers=\[0, 40\].*drop \[40\]"):
        HiSparseConfig(dense_layers=(0, 40)).check_layers(32)


def test_bad_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("{top_k: 1}")
    with pytest.raises(HiSparseConfigError, match="not valid JSON"):
        HiSparseConfig.from_json(p)
    with pytest.raises(HiSparseConfigError, match="JSON object"):
        HiSparseConfig.from_dict([1])
