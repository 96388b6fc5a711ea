"""`hisparse calc`: the per-request bytes from first principles, the bound, and the CLI's JSON."""
import json
import subprocess
import sys

import pytest

from vllm_hisparse.core import capacity as cap

LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "torch_dtype": "bfloat16"}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return tmp_path


def calc(*argv):
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", *map(str, argv)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_stock_matches_vllm_measured_concurrency(model_dir):
    # vLLM 0.26 FLASH_ATTN on the H200 at 0.9: 108.8 GiB KV -> 27 requests of 32K (measured 2026-11-29)
    out = json.loads(calc("--model", model_dir, "--context", 32768, "--gpu-kv-gib", 108.8,
                          "--host-gib", 100, "--json"))
    assert out["baseline"]["max_requests"] == 27 and out["baseline"]["bound_by"] == "gpu"


@pytest.mark.parametrize("context,B,page,dense", [(32768, 4096, 16, 2), (5000, 1024, 64, 0), (100, 4096, 16, 1)])
def test_bytes_from_first_principles(model_dir, context, B, page, dense):
    out = json.loads(calc("--model", model_dir, "--context", context, "--buffer", B, "--top-k", B // 2,
                          "--page-size", page, "--dense-layers", dense, "--gpu-kv-gib", 10,
                          "--host-gib", 20, "--json"))
    tok = 2 * 8 * 128 * 2                                         # K+V, 8 heads x 128, bf16
    pages = -(-context // page)
    full = pages * page * tok
    sparse = 32 - dense
    gpu = dense * full + sparse * (min(pages * page, B) * tok + pages * 2 * 8 * 128 * 2)
    assert out["baseline"]["gpu_bytes_per_request"] == 32 * (-(-context // page)) * page * tok
    h = out["hisparse"]
    assert h["gpu_bytes_per_request"] == gpu and h["host_bytes_per_request"] == sparse * full
    n_gpu, n_host = (10 << 30) // gpu, (20 << 30) // (sparse * full)
    assert h["max_requests"] == min(n_gpu, n_host)
    assert h["bound_by"] == ("gpu" if n_gpu <= n_host else "host")


def test_table_and_errors(model_dir):
    out = calc("--model", model_dir, "--context", 32768, "--gpu-kv-gib", 40, "--host-gib", 100)
    assert "baseline" in out and "hisparse" in out and "bound by" in out
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", str(model_dir),
                        "--context", "100", "--buffer", "1000", "--top-k", "2048", "--gpu-kv-gib", "1",
                        "--host-gib", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "device_buffer_size=1000 is invalid" in r.stderr


def test_mla_refused(tmp_path):
    with pytest.raises(ValueError, match="MLA"):
        cap.ModelShape.from_hf_config({**LLAMA3_8B, "kv_lora_rank": 512})
