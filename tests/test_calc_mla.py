"""`hisparse calc` for an MLA + DSA model (DeepSeek-V3.2 shape, bench/model_shapes.py) against a
hand computation here: per token per layer 576 bf16 latent values (1152 B) and 128 fp8 indexer
values + one fp32 scale (132 B); stock keeps both in one KV-cache group of 64-token blocks;
the docs/dsa.md design keeps the indexer K (+ a 16 B stub) in vLLM's blocks and the latent in
a plugin pool: (B + newest) rows per request (+ RESOLVE's tables) + full-length prefill regions.
With --kv-cache-dtype fp8_ds_mla the latent row is FLASHMLA_SPARSE's 656 B (512 fp8 + 4 fp32
scales + 64 bf16 rope) in both backends' tiers."""
import json
import subprocess
import sys

import pytest

from vllm_hisparse.bench.model_shapes import mla_config
from vllm_hisparse.core import capacity_mla as mla
from vllm_hisparse.ops import fp8_ds_mla

GIB = 1 << 30
L = 61
LATENT, INDEX, STUB = (512 + 64) * 2, 128 + 4, 16
FP8_DS_MLA = 512 + 4 * 4 + 64 * 2          # FLASHMLA_SPARSE's "FP8 with scale" row: 656 B


def cdiv(a, b):
    return -(-a // b)


@pytest.fixture
def v32_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(mla_config("deepseek-v3.2", 512)))
    return tmp_path


def calc_json(model_dir, *argv):
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", model_dir,
                        *map(str, argv), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_shape_from_config():
    m = mla.MLAShape.from_hf_config(mla_config("deepseek-v3.2", 512))
    assert (m.num_layers, m.latent_bytes, m.index_bytes) == (L, 1152, 132)
    assert mla.MLAShape.from_hf_config(mla_config("deepseek-v3.2-l4", 512)).num_layers == 4
    with pytest.raises(ValueError, match="no index_topk"):
        mla.MLAShape.from_hf_config({"kv_lora_rank": 512, "num_hidden_layers": 2})
    f = mla.MLAShape.from_hf_config(mla_config("deepseek-v3.2", 512), kv_cache_dtype="fp8_ds_mla")
    assert (f.latent_bytes, f.index_bytes) == (FP8_DS_MLA, 132)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        mla.MLAShape.from_hf_config(mla_config("deepseek-v3.2", 512), kv_cache_dtype="fp8")
    assert FP8_DS_MLA == fp8_ds_mla.ROW_BYTES                  # calc and the pool's rows agree


@pytest.mark.parametrize("name", ["deepseek-v3.2-l4", "deepseek-v3.2-l16"])
def test_narrowed_shapes_keep_v32_attention_and_route_consistently(name):
    """A narrowed shape changes only depth and experts (CHANGES says how), so its per-layer KV and
    its attention, MLA and indexer dims are V3.2's; its router can pick 8 experts a token."""
    from vllm_hisparse.bench import model_shapes

    full, cfg = mla_config("deepseek-v3.2", 512), mla_config(name, 512)
    changed = {k for k in cfg if cfg[k] != full.get(k)}
    assert changed <= {"num_hidden_layers", "first_k_dense_replace", "n_routed_experts",
                       "n_group", "topk_group"} and name in model_shapes.CHANGES
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0
    assert cfg["num_experts_per_tok"] <= cfg["topk_group"] * cfg["n_routed_experts"] // cfg["n_group"]
    m = mla.MLAShape.from_hf_config(cfg)
    assert m.num_layers == cfg["num_hidden_layers"] and m.latent_bytes == 1152


@pytest.mark.parametrize("kvd", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("context,B,newest,slots,gpu_gib,host_gib,mml,seqs", [
    (32768, 4096, 0, 1, 100, 800, None, None),
    (32768, 2048, 64, 2, 100, 200, 65536, None),
    (131072, 4096, 0, 1, 110, 1500, None, 8),
    (8000, 4096, 0, 1, 60, 400, 32768, 30),
])
def test_calc_against_a_hand_computation(v32_dir, context, B, newest, slots, gpu_gib, host_gib,
                                         mml, seqs, kvd):
    argv = ["--context", context, "--buffer", B, "--top-k", 2048, "--gpu-kv-gib", gpu_gib,
            "--host-gib", host_gib, "--newest-rows", newest, "--prefill-slots", slots,
            "--kv-cache-dtype", kvd]
    LATENT = FP8_DS_MLA if kvd == "fp8_ds_mla" else globals()["LATENT"]
    argv += ["--max-model-len", mml] if mml else []
    argv += ["--max-num-seqs", seqs] if seqs else []
    r = calc_json(v32_dir, *argv)
    assert (r["kv_cache_dtype"], r["latent_bytes_per_token_layer"]) == (kvd, LATENT)
    mml = mml or context
    gpu, page = int(gpu_gib * GIB), 16
    # stock: 64-token blocks of latent + indexer K, every layer
    blk = L * 64 * (LATENT + INDEX)
    b = r["baseline"]
    assert b["gpu_bytes_per_request"] == cdiv(context, 64) * 64 * L * (LATENT + INDEX)
    assert b["num_blocks"] == gpu // blk
    n_stock = (gpu // blk - 1) // cdiv(context, 64)
    assert b["max_requests"] == (min(n_stock, seqs) if seqs else n_stock)
    assert b["vllm_max_concurrency"] == pytest.approx((gpu // blk) / cdiv(mml, 64))
    # hisparse: per request indexer K blocks + (B + newest) latent rows; host: every latent row
    h = r["hisparse"]
    # a row set: the latent rows + RESOLVE's int32 tables (token->slot per layer, slot->token and
    # LRU order per layer, token->host row once)
    row_set = L * (B + newest) * LATENT + 4 * (L * mml + L * 2 * (B + newest) + mml)
    region = slots * L * mml * LATENT
    assert h["gpu_bytes_per_request"] == cdiv(context, 64) * 64 * L * (INDEX + STUB) + row_set
    assert h["host_bytes_per_request"] == cdiv(context, page) * page * L * LATENT
    n_host = int(host_gib * GIB) // h["host_bytes_per_request"]

    def fits(n):            # n requests: their row sets reserved, their indexer K in the rest
        kv = gpu - region - n * row_set
        return kv >= 0 and (kv // (L * 64 * (INDEX + STUB)) - 1) // cdiv(context, 64) >= n

    if seqs:
        kv = gpu - region - seqs * row_set
        n_gpu = (kv // (L * 64 * (INDEX + STUB)) - 1) // cdiv(context, 64)
        assert h["max_requests"] == min(n_gpu, n_host, seqs)
    else:
        n = max(x for x in range(0, 100000) if fits(x) and x <= n_host) if fits(1) else 0
        assert h["max_requests"] == h["latent_row_sets"] == n
        kv = gpu - region - n * row_set
    assert h["kv_cache_bytes"] == kv and h["num_blocks"] == kv // (L * 64 * (INDEX + STUB))
    assert h["prefill_region_bytes"] == region


def test_table_prints_the_ratio(v32_dir):
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", v32_dir,
                        "--context", "32768", "--gpu-kv-gib", "100", "--host-gib", "800"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "1152 B" in r.stdout and "132 B" in r.stdout and "the requests of stock" in r.stdout


def test_fp8_ds_mla_table_and_refusals(v32_dir, tmp_path):
    """fp8_ds_mla fits more stock and hisparse requests than bf16 at one budget; it is refused for
    a GQA model and fp8 is refused for the MLA model, each in one line naming the value."""
    base = ["--context", 32768, "--gpu-kv-gib", 100, "--host-gib", 800]
    bf, f8 = calc_json(v32_dir, *base), calc_json(v32_dir, *base, "--kv-cache-dtype", "fp8_ds_mla")
    for side in ("baseline", "hisparse"):
        assert f8[side]["max_requests"] > bf[side]["max_requests"]
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", v32_dir,
                        *map(str, base), "--kv-cache-dtype", "fp8_ds_mla"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "656 B" in r.stdout and "not served yet" in r.stdout
    for model, kvd, msg in ((v32_dir, "fp8", "fp8_ds_mla (656 B rows)"),
                            ("llama3-8b", "fp8_ds_mla", "for a GQA/MHA model pass fp8")):
        if model == "llama3-8b":
            model = tmp_path / "gqa"
            subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.model_shapes", "llama3-8b",
                            str(model)], check=True, capture_output=True, timeout=120)
        r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", model,
                            *map(str, base), "--kv-cache-dtype", kvd],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and msg in r.stderr, r.stderr
