"""fp8 KV (``--kv-cache-dtype fp8``) counted at its own width (issue 45): every KV tier's pages
(GPU blocks, host pool, dense pool) at 1 byte a value, the Quest bounds at the model dtype's; in
core/deployment.resolve, the auto sizes (core/auto_size.py), the vLLM adapter's limits
(vllm/deployment.py) and `hisparse calc`. Llama-3-8B shape, bf16 model; expected figures from the
byte math here, not read back from the code."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from calc_cli import GIB, LLAMA3_8B, L, TOK, calc, calc_json, model_dir  # noqa: F401

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.auto_size import Machine, host_rank_room
from vllm_hisparse.core.deployment import EngineLimits, resolve

MML, PAGE, SPARSE = 32768, 16, L - 2            # the default config: 2 dense layers
PER = MML // PAGE                               # pages of a request of max_model_len
LIM = dict(num_layers=L, max_model_len=MML, max_num_seqs=64, num_kv_heads=8, head_dim=128,
           dtype_bytes=2)
ROW = SPARSE * 2 * PER * 8 * 128 * 2            # Quest min + max, bf16 whatever the KV: 240 MiB
KV = {"bf16": 2, "fp8": 1}


def page(kv: int) -> int:
    """One page of one layer, K and V, at ``kv`` bytes a value (TOK is bf16's token)."""
    return PAGE * TOK // 2 * kv


def deploy(kv: int, machine=None, **cfg):
    return resolve(HiSparseConfig(**cfg), EngineLimits(**LIM, kv_dtype_bytes=kv, machine=machine))


def test_kv_bytes_default_to_the_model_dtype():
    assert EngineLimits(**LIM).kv_dtype_bytes == 2
    assert EngineLimits(**LIM, kv_dtype_bytes=1).kv_dtype_bytes == 1
    assert EngineLimits(**LIM) == EngineLimits(**LIM, kv_dtype_bytes=2)
    with pytest.raises(ValueError, match="kv_dtype_bytes=-1 must be >= 0"):
        EngineLimits(**LIM, kv_dtype_bytes=-1)


def test_given_pools_hold_twice_the_fp8_pages_and_the_bounds_keep_their_bytes():
    given = dict(host_pool_gib=60, dense_pool_gib=4, quest_rows=64)
    d = {k: deploy(kv, **given) for k, kv in KV.items()}
    for k, kv in KV.items():
        assert d[k].page_bytes == page(kv)
        assert d[k].host_pages == 60 * GIB // (page(kv) * SPARSE)      # the sparse layers
        assert d[k].dense_pool_pages == 4 * GIB // (page(kv) * 2)       # the 2 dense layers
        assert d[k].indexer_row_bytes == ROW
    assert d["fp8"].host_pages == 2 * d["bf16"].host_pages
    assert d["fp8"].dense_pool_pages == 2 * d["bf16"].dense_pool_pages
    tiers = {k: d[k].tier_requests() for k in KV}
    assert tiers["fp8"]["host_pool"] == 2 * tiers["bf16"]["host_pool"] == 2 * (60 * GIB // (
        page(2) * SPARSE * PER))


def test_the_auto_host_pool_pins_its_share_of_ram_at_fp8_width():
    """118 GiB of RAM: the auto pool takes 80% of 110 GiB in whole requests of max_model_len; an
    fp8 request takes half the bytes, so the same RAM holds twice the requests (the GPU, 54 GiB
    of KV, is no bound for either here)."""
    m = Machine(118 * GIB, 1, 54 * GIB, False, "test")
    room = host_rank_room(m)
    for kv in KV.values():
        dep = deploy(kv, m)
        request = PER * page(kv) * SPARSE                  # a request's host pages, sparse layers
        held = room // request
        assert dep.host_pages == held * PER and dep.cfg.host_pool_bytes == held * request
        assert room - request < dep.cfg.host_pool_bytes <= room    # its share, not half of it
        assert dep.tier_requests()["host_pool"] == held and dep.indexer_row_bytes == ROW
    assert deploy(1, m).host_pages >= 2 * deploy(2, m).host_pages


class _Model(SimpleNamespace):              # what the adapter reads of vLLM's ModelConfig
    def get_num_layers(self, pc):
        return L

    def get_num_kv_heads(self, pc):
        return 8

    def get_head_size(self):
        return 128


@pytest.mark.parametrize("cache_dtype, kv", [("auto", 2), ("fp8", 1), ("fp8_e4m3", 1), (None, 2)])
def test_the_adapter_takes_the_kv_bytes_from_the_cache_dtype(cache_dtype, kv):
    from vllm_hisparse.vllm.deployment import limits_of

    vc = SimpleNamespace(model_config=_Model(max_model_len=MML, dtype=torch.bfloat16),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1),
                         scheduler_config=SimpleNamespace(max_num_seqs=64),
                         cache_config=SimpleNamespace(cache_dtype=cache_dtype))
    lim = limits_of(vc)
    assert (lim.dtype_bytes, lim.kv_dtype_bytes) == (2, kv)


SERVER = ("--context", MML, "--gpu-kv-gib", 54, "--host-ram-gib", 118, "--max-num-seqs", 64)


def test_calc_fp8_doubles_stock_and_the_host_backed_requests(model_dir):
    r = {k: calc_json(model_dir, *SERVER, "--kv-cache-dtype", "auto" if k == "bf16" else k)
         for k in KV}
    room = host_rank_room(Machine(118 * GIB, 1, 54 * GIB, False, ""))
    for k, kv in KV.items():
        b, h = r[k]["baseline"], r[k]["hisparse"]
        assert (r[k]["kv_dtype_bytes"], r[k]["dtype_bytes"]) == (kv, 2)
        # stock: 54 GiB of blocks of every layer; N - 1 whole requests + the last one admitted
        blocks = 54 * GIB // (page(kv) * L)
        assert b["num_blocks"] == blocks and b["gpu_bytes_per_request"] == PER * page(kv) * L
        assert b["max_requests"] == 1 + (blocks - 1 - PER) // PER
        # hisparse: the host pool's share of the RAM in whole requests of the sparse layers
        request = PER * page(kv) * SPARSE
        assert h["host_bytes_per_request"] == request
        assert (h["max_requests"], h["bound_by"]) == (room // request, "host")
        assert h["host_pool_pages"] == room // request * PER
        assert f"{h['host_pool_pages']} pages = {room // request} requests" in h["startup_line"]
        assert h["quest_meta_bytes_per_request"] == ROW          # bounds in the model dtype
    assert r["fp8"]["baseline"]["max_requests"] == 2 * r["bf16"]["baseline"]["max_requests"]
    assert r["fp8"]["hisparse"]["max_requests"] == 2 * r["bf16"]["hisparse"]["max_requests"]


def test_calc_names_the_kv_dtype_and_refuses_dtype_fp8(model_dir):
    first = calc("--model", model_dir, *SERVER, "--kv-cache-dtype", "fp8").splitlines()[0]
    assert first.endswith(", KV fp8 (1 B/value; Quest bounds 2 B)")
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model",
                        str(model_dir), *map(str, SERVER), "--dtype", "fp8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "pass --kv-cache-dtype fp8" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_sweep_passes_the_kv_dtype(model_dir):
    from vllm_hisparse.bench import calc_sweep

    p = calc_sweep.point(str(model_dir), MML, 54.0, 118.0, 64, "fp8")
    ref = calc_json(model_dir, *SERVER, "--kv-cache-dtype", "fp8", "--hostless", "dense")
    assert (p["stock"], p["hisparse"]) == (ref["baseline"]["max_requests"],
                                           ref["hisparse"]["max_requests"])
