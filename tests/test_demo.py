"""`hisparse demo --model smollm2|DIR` sizes its pools from the model (it used to keep the tiny
model's 0.1 GiB host pool, too small for one SmolLM2 request of the demo's max_model_len)."""
import json

import pytest

from vllm_hisparse import demo
from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError

# SmolLM2-135M's shape (config.json of the folder vllm_hisparse.smollm2 writes)
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576, "torch_dtype": "float32"}
TINY = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 128, "torch_dtype": "float32"}


def _fits(cfg: HiSparseConfig, shape: dict, requests: int) -> bool:
    """The startup checks (setup_check.py) for `requests` requests of the demo's max_model_len."""
    tok = 2 * shape["num_key_value_heads"] * shape["hidden_size"] // shape["num_attention_heads"] * 4
    try:
        cfg.check_host_pool(requests * demo.MAX_MODEL_LEN, tok,
                            len(cfg.host_pool_layers(shape["num_hidden_layers"])))
        cfg.check_dense_pool(requests * demo.MAX_MODEL_LEN, tok)
    except HiSparseConfigError:
        return False
    return True


@pytest.mark.parametrize("shape", [SMOLLM2, TINY], ids=["smollm2", "tiny"])
def test_pools_hold_two_requests_of_the_model(tmp_path, shape):
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = HiSparseConfig.load(demo.sized_config(str(tmp_path)))
    assert _fits(cfg, shape, demo.POOL_REQUESTS)
    assert cfg.host_pool_gib >= demo.SERVE_CONFIG["host_pool_gib"]


def test_the_fixed_pool_was_too_small_for_smollm2():
    assert not _fits(HiSparseConfig.load(demo.SERVE_CONFIG), SMOLLM2, 1)


def test_model_argument_must_be_a_folder_or_smollm2(tmp_path):
    with pytest.raises(SystemExit, match="not an HF model folder"):
        demo._model_dir(str(tmp_path))


def test_bad_config_is_one_line_and_exit_2(capsys):
    from vllm_hisparse import cli

    assert cli.main(["demo", "--core", "--config", '{"top_k": 0}']) == 2
    assert capsys.readouterr().err == ("hisparse demo: hisparse config: top_k=0 is invalid: use a "
                                       "positive token count such as 2048\n")


# The worker's stats file after `make demo` (the default config: resident_first on, one request of
# 2726 prompt tokens, 48 generated; CPU), host times left out.
DEFAULT_RUN = {"steps": 49, "decode_rows": 47, "dense_decode_rows": 0, "finished": 1,
               "dense_pool_pages_handed": 174, "full_steps": 47, "turned_sparse": 0,
               "resident_rows": 47, "spills": 0, "shrinks": 0, "partial_rows": 0,
               "steady_steps": 43, "hits": 0, "misses": 0, "resident_units": 423,
               "resolved_units": 0, "hit_rate": None, "miss_rate": 0.0, "inserts": 0,
               "policy": "lru", "host_pages_used": 0, "dense_pool_pages_used": 0,
               "live_requests": 0, "resident_requests": 0, "partial_requests": 0,
               "floor_requests": 0, "resident_pages": {}}


def test_default_demo_reports_a_resident_request_without_a_hot_buffer():
    cfg = HiSparseConfig.load(demo.SERVE_CONFIG)
    assert cfg.resident_first                   # the default the demo runs
    text = "\n".join(demo.report(DEFAULT_RUN, cfg))
    for false in ("hot pages", "hit rate", "pages resolved"):   # none was resolved: no hot buffer
        assert false not in text, text
    assert "sparse decode steps 47: 47 resident" in text
    assert "0 partial" in text and "0 host-backed" in text and "spills 0" in text
    assert "no page went through a hot buffer" in text
    assert "selected pages read from the request's own GPU blocks 423" in text


def test_demo_without_resident_first_reports_the_hot_buffer():
    """The same request with resident_first off (a run of `hisparse demo --config`): every step
    host-backed, hits and misses through the hot buffer, and only then its size."""
    cfg = HiSparseConfig.load(dict(demo.SERVE_CONFIG, resident_first=False))
    run = dict(DEFAULT_RUN, resident_rows=0, hits=132, misses=291, resident_units=0,
               resolved_units=423, hit_rate=132 / 423, miss_rate=291 / 423)
    text = "\n".join(demo.report(run, cfg))
    assert "0 resident" in text and "47 host-backed" in text and "resident_first off" in text
    assert "hits 132, misses fetched from host 291, hit rate 31.2%" in text
    assert f"GPU keeps {cfg.num_slots} hot pages" in text
    assert "no page went through a hot buffer" not in text and "spills 0" not in text
