"""bench/model_shapes.py: the benchmark model's max_position_embeddings follows MAX_POSITIONS (vLLM
sizes its RoPE table from it: a 128K server on the 65536 default died of a device-side assert)."""
import json

import pytest

from vllm_hisparse.bench import model_shapes


def test_max_positions_reaches_the_config(tmp_path):
    for args, want in (([], 65536), (["262144"], 262144)):
        out = tmp_path / f"m{len(args)}"
        assert model_shapes.main(["llama3-8b", str(out), *args]) == str(out)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["max_position_embeddings"] == want and cfg["num_key_value_heads"] == 8


def test_a_bad_max_positions_prints_the_usage(tmp_path):
    with pytest.raises(SystemExit, match="MAX_POSITIONS"):
        model_shapes.main(["llama3-8b", str(tmp_path / "m"), "128k"])
    assert not (tmp_path / "m").exists()
