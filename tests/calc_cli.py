"""What the `hisparse calc` tests share: the model's shape, the CLI's runners and an admission
loop written independently of core/capacity.py (tests/test_calc.py, tests/test_calc_servers.py)."""
import json
import subprocess
import sys

import pytest

LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "torch_dtype": "bfloat16"}
GIB, MIB = 1 << 30, 1 << 20
TOK = 2 * 8 * 128 * 2                # K+V of one token of one layer: 8 KV heads x 128, bf16
L = 32


def cdiv(a, b):
    return -(-a // b)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return tmp_path


def admitted(blocks, floor, peak, seqs, sparse=True, batched=8192, resident_first=True,
             watermark=0.0, page=16):
    """Requests at once on the GPU, by admitting them one by one: a new one needs its peak free
    besides vLLM's watermark (+1, the connector's admission_blocks, with resident_first); those
    already running sit at their floor (R, the KV manager's spill target, gates nothing). Block 0
    is vLLM's null block."""
    wm = int(watermark * blocks)
    spills = resident_first and sparse
    n, free = 0, blocks - 1
    while free - peak - wm - spills >= 0:           # the next one fits: admit it, then it shrinks
        n, free = n + 1, free - floor
    return n


def calc(*argv):
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", *map(str, argv)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def calc_json(model_dir, *argv):
    return json.loads(calc("--model", model_dir, *argv, "--json"))
