"""HiSparseConfig: loading and one-line errors that name the field, the value and the fix."""
import dataclasses
import json
import typing

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


@pytest.mark.parametrize("src, words", [
    (5, "hisparse=5 is invalid: give an object of settings"),
    ("/nonexistent/hs.json", "'/nonexistent/hs.json' cannot be read (No such file or directory)"),
    ('{"top_k": 64,', "the JSON string '{\"top_k\": 64,' is not valid JSON (Expecting property"),
])
def test_load_errors_are_one_config_line(src, words):
    """What used to be a bare TypeError, FileNotFoundError or JSONDecodeError."""
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig.load(src)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_policy_error_offers_what_vllm_serves():
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig(policy="mru")
    assert ('use "lru" (what vLLM serves; also served: crf); belady, fifo, random, vanilla run '
            'only in') in str(e.value)


def test_tiny_pools_name_a_size_that_fits():
    """A tiny pool used to say "needs 0.00 GiB"; the fix now names a value that holds the request
    (63 pages of 16 tokens x 512 bytes x 3 layers = 1548288 bytes = 0.001442 GiB)."""
    c = HiSparseConfig(top_k=16, device_buffer_size=16, host_pool_gib=0.0001, dense_pool_gib=0.0001,
                       dense_layers=(0,))
    with pytest.raises(HiSparseConfigError) as e:
        c.check_host_pool(max_model_len=1000, bytes_per_token_per_layer=512, num_sparse_layers=3)
    assert str(e.value).endswith("needs 1.5 MiB; set host_pool_gib to at least 0.00145 or lower "
                                 "max_model_len")
    HiSparseConfig(host_pool_gib=0.00145).check_host_pool(1000, 512, 3)
    with pytest.raises(HiSparseConfigError):
        HiSparseConfig(host_pool_gib=0.00144).check_host_pool(1000, 512, 3)
    with pytest.raises(HiSparseConfigError, match=r"needs 0.5 MiB for its 1 dense layers; set "
                                                  r"dense_pool_gib to at least 0.000481, "):
        c.check_dense_pool(max_model_len=1000, bytes_per_token_per_layer=512)


@pytest.mark.parametrize("nbytes", [1, 1000, 1 << 20, (1 << 30) + 1, 3 * (1 << 30), 123456789012])
def test_gib_at_least_holds_the_bytes(nbytes):
    """Three significant digits, rounded up: holds nbytes, and one step less would not."""
    from vllm_hisparse.config import GIB, gib_at_least

    g = gib_at_least(nbytes)
    assert float(f"{g:.3g}") == g and int(g * GIB) >= nbytes
    digits = f"{g:.2e}"                         # e.g. 1.45e-03: one step = 0.01e-03
    step = float("1e" + str(int(digits.split("e")[1]) - 2))
    assert int((g - step) * GIB) < nbytes


def _numeric_fields() -> list[str]:
    """Every field whose type admits an int or a float (bool excluded), read from the dataclass."""
    hints = typing.get_type_hints(HiSparseConfig)
    return [f.name for f in dataclasses.fields(HiSparseConfig)
            if {int, float} & set(typing.get_args(hints[f.name]) or (hints[f.name],))]


def test_numeric_fields_are_found():
    assert {"top_k", "host_pool_gib", "dense_pool_gib", "min_context"} <= set(_numeric_fields())
    assert "prefetch" not in _numeric_fields() and "full_decode_graphs" not in _numeric_fields()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=repr)
@pytest.mark.parametrize("field", _numeric_fields())
def test_non_finite_numbers_are_one_line_naming_the_field(field, value):
    """Python's JSON reads NaN / Infinity / -Infinity (issue 44): refused in every numeric field,
    through the loader's JSON string path, as one line naming the field and the fix."""
    text = json.dumps({field: value})                   # e.g. {"host_pool_gib": NaN}
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig.load(text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"hisparse config: {field}={value!r} is invalid: ")
    assert "NaN and Infinity are not numbers here; give a finite number" in msg


def test_non_finite_dense_layer_is_refused():
    with pytest.raises(HiSparseConfigError, match=r"dense_layers=\[0, nan\] is invalid: NaN and "
                                                  r"Infinity .*e.g. the default \[0, 1\]$"):
        HiSparseConfig.load('{"dense_layers": [0, NaN]}')
