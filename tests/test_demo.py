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
