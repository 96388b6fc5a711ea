"""`hisparse calc`: the per-request bytes from first principles, the bounds, and the CLI's JSON.
(tests/test_calc_servers.py: the serving configs; tests/test_calc_engine.py checks the same figures
against a real vLLM engine.)"""
import json
import random
import subprocess
import sys

import pytest
from calc_cli import (GIB, L, LLAMA3_8B, MIB, TOK, admitted, calc, calc_json, cdiv,  # noqa: F401
                      model_dir)

from vllm_hisparse.core import capacity as cap

# the sizes of a config that sets them, as before auto sizing: no dense pool, quest_rows unset
# (0: --max-num-seqs, else the most that fit); auto sizes: tests/test_auto_size.py
GIVEN = ("--dense-pool-gib", 0, "--quest-rows", 0)


def test_stock_matches_vllm_measured_concurrency(model_dir):
    # vLLM 0.26 FLASH_ATTN on the H200 at 0.9: 108.8 GiB KV -> 27 requests of 32K (measured 2026-11-29)
    out = json.loads(calc("--model", model_dir, "--context", 32768, "--gpu-kv-gib", 108.8,
                          "--host-gib", 100, "--json"))
    assert out["baseline"]["max_requests"] == 27 and out["baseline"]["bound_by"] == "gpu"


def test_hisparse_lines_match_h200_log(model_dir):
    """docs/gpu-results.md, H200, Llama-3-8B shape, 32K, B = 1024, page 16: vLLM logged 897,312
    tokens / 27.38x (resident mode = stock sizing) and 28,272,230 tokens / 862.80x (hisparse), i.e.
    56,082 blocks of 2 MiB. That run allocated its 32 Quest rows after sizing the KV cache, so the
    stock budget there was the KV cache itself; today it would be the KV cache + the rows."""
    blocks, rows = 56082, 32
    row = 30 * 2 * 2048 * 8 * 128 * 2
    kv = blocks * 16 * TOK * L
    out = calc_json(model_dir, "--context", 32768, "--top-k", 512, "--buffer", 1024,
                    "--gpu-kv-gib", repr((kv + (rows + 1) * row) / GIB), "--host-gib", 16,
                    "--max-num-seqs", rows, *GIVEN)
    h = out["hisparse"]
    assert (h["num_blocks"], h["kv_cache_bytes"], h["quest_meta_bytes"]) == (blocks, kv, (rows + 1) * row)
    assert h["vllm_kv_cache_tokens"] == 28_272_230 and f"{h['vllm_max_concurrency']:.2f}" == "862.80"
    b = calc_json(model_dir, "--context", 32768, "--gpu-kv-gib", repr(kv / GIB), "--host-gib", 16)
    assert b["baseline"]["vllm_kv_cache_tokens"] == 897_312
    assert f"{b['baseline']['vllm_max_concurrency']:.2f}" == "27.38"
    # the 16 GiB host pool of that run holds 4 requests of 32K (all 32 layers, 4 GiB each)
    assert (h["max_requests"], h["bound_by"]) == (4, "host")


@pytest.mark.parametrize("context,B,page,dense,seqs,host_gib,mml", [
    (32768, 4096, 16, 2, 64, 100, None),     # host-bound: 4 GiB of host per request
    (32768, 1024, 16, 2, 256, 2000, None),   # 256 Quest rows eat 60 GiB of the 100
    (5000, 1024, 64, 0, 8, 20, 8192),        # max-num-seqs-bound; rows sized for max_model_len
    (100, 4096, 16, 1, 64, 20, None),        # shorter than B: all pages stay
    (32768, 1024, 16, 2, 420, 2000, None),   # 420 rows leave less than one 32K prefill: no start
])
def test_bytes_from_first_principles(model_dir, context, B, page, dense, seqs, host_gib, mml):
    G = 100
    extra = ("--max-model-len", mml) if mml else ()
    out = calc_json(model_dir, "--context", context, "--buffer", B, "--top-k", B // 2,
                    "--page-size", page, "--dense-layers", dense, "--gpu-kv-gib", G,
                    "--host-gib", host_gib, "--max-num-seqs", seqs, "--min-context", 0, *extra,
                    *GIVEN)
    mml = mml or context
    pages, block = cdiv(context, page), page * TOK * L          # a block / host page, all layers
    # stock: every page in every layer
    b = out["baseline"]
    assert b["gpu_bytes_per_request"] == pages * block and b["host_bytes_per_request"] == 0
    b_blocks = (G * GIB) // (page * TOK) // L
    assert b["num_blocks"] == b_blocks
    assert b["max_requests"] == min((b_blocks - 1) // pages, seqs)
    assert b["vllm_max_concurrency"] == b_blocks / cdiv(mml, page)
    # hisparse: S+1 blocks in every layer, every page of every layer on the host, Quest rows
    h = out["hisparse"]
    S = B // page
    assert h["gpu_bytes_per_request"] == min(pages, S + 1) * block
    assert h["host_bytes_per_request"] == pages * block
    row = (L - dense) * 2 * cdiv(mml, page) * 8 * 128 * 2
    # max_num_seqs rows + the runtime's scratch row (decode-graph padding)
    assert h["quest_meta_bytes_per_request"] == row and h["quest_meta_bytes"] == (seqs + 1) * row
    kv = G * GIB - (seqs + 1) * row
    h_blocks = kv // (page * TOK) // L
    assert (h["kv_cache_bytes"], h["num_blocks"]) == (kv, h_blocks)
    fits_prefill = h_blocks - 1 >= cdiv(mml, page) + 1
    assert h["prefill_fits"] == fits_prefill
    n_gpu = admitted(h_blocks, min(pages, S + 1), pages, seqs, page=page) if fits_prefill else 0
    n_host = (int(host_gib * GIB) // block) // pages
    assert h["host_pool_pages"] == int(host_gib * GIB) // block
    n = min(n_gpu, n_host, seqs)
    assert h["max_requests"] == n
    assert h["bound_by"] == ("gpu" if n == n_gpu else "host" if n == n_host else "max_num_seqs")
    conc = h_blocks / min(cdiv(mml, page), S + 1)
    assert h["vllm_max_concurrency"] == conc and h["vllm_kv_cache_tokens"] == int(conc * mml)


def test_auto_max_num_seqs_is_the_fixed_point(model_dir):
    """Without --max-num-seqs: the largest N such that N requests fit next to N Quest rows."""
    def run(**kw):
        args = {"context": 32768, "buffer": 1024, "top_k": 512, "gpu_kv_gib": 100, "host_gib": 10000,
                "dense_pool_gib": 0, "quest_rows": 0}
        args.update(kw)
        return calc_json(model_dir, *[x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", v)])

    h = run()["hisparse"]
    n = h["max_num_seqs"]
    assert h["max_requests"] == n and h["bound_by"] == "gpu" and n > 27
    row = 30 * 2 * 2048 * 8 * 128 * 2

    def fit(rows):                      # requests that fit with `rows` Quest rows = max_num_seqs
        blocks = (100 * GIB - (rows + 1) * row) // (16 * TOK) // L
        return admitted(blocks, 65, 2048, rows) if blocks - 1 >= 2049 else 0
    assert fit(n) >= n and fit(n + 1) < n + 1
    assert run(max_num_seqs=n)["hisparse"]["max_requests"] == n
    assert run(max_num_seqs=n + 1)["hisparse"]["max_requests"] < n + 1
    # host-bound: as many rows as the host pool admits requests (4 GiB each at 32K)
    h = run(host_gib=40)["hisparse"]
    assert (h["max_requests"], h["max_num_seqs"], h["bound_by"]) == (10, 10, "host")


def test_min_context_keeps_short_requests_resident(model_dir):
    out = calc_json(model_dir, "--context", 4096, "--buffer", 1024, "--top-k", 512,
                    "--min-context", 8192, "--gpu-kv-gib", 40, "--host-gib", 100, "--max-num-seqs", 8)
    h, b = out["hisparse"], out["baseline"]
    assert h["gpu_bytes_per_request"] == b["gpu_bytes_per_request"] == 256 * 16 * TOK * L
    assert h["host_bytes_per_request"] == 0
    # max_model_len (= context) < min_context: no request can be sparse, so vLLM's own backend
    # serves (setup_check.serve_as_stock): every page counted, no Quest row, stock's blocks
    assert h["vllm_max_concurrency"] == h["num_blocks"] / 256
    assert h["quest_rows"] == 0 and h["quest_meta_bytes"] == 0
    assert h["num_blocks"] == b["num_blocks"]


def test_capacity_helpers():
    m = cap.ModelShape(32, 8, 128, 2)
    assert m.block_bytes(16) == 16 * TOK * L
    assert cap.hisparse_blocks(32768, 16, 64) == 65 and cap.hisparse_blocks(100, 16, 64) == 7
    assert cap.hisparse_blocks(32768, 16, 64, sparse=False) == 2048
    assert cap.indexer_row_bytes("quest", m, 32768, 16, 2) == 240 * MIB
    assert cap.max_requests({"gpu": 5, "host": None, "max_num_seqs": 5}) == (5, "gpu")
    assert cap.max_requests({"gpu": 5, "host": 3, "max_num_seqs": None}) == (3, "host")


def test_table_and_errors(model_dir):
    out = calc("--model", model_dir, "--context", 32768, "--gpu-kv-gib", 40, "--host-gib", 100)
    assert "baseline" in out and "hisparse" in out and "bound by" in out
    assert "Quest bounds" in out and "Maximum concurrency for 32,768 tokens per request" in out
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", str(model_dir),
                        "--context", "100", "--buffer", "1000", "--top-k", "2048", "--gpu-kv-gib", "1",
                        "--host-gib", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "device_buffer_size=1000 is invalid" in r.stderr
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", str(model_dir),
                        "--context", "5000", "--max-model-len", "4096", "--gpu-kv-gib", "1",
                        "--host-gib", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "exceeds --max-model-len" in r.stderr


def test_mla_refused(tmp_path):
    with pytest.raises(ValueError, match="MLA"):
        cap.ModelShape.from_hf_config({**LLAMA3_8B, "kv_lora_rank": 512})


@pytest.mark.parametrize("pool_gib,host_gib", [(10, 52), (1, 200)])
def test_dense_pool(model_dir, pool_gib, host_gib):
    """--dense-pool-gib: a GPU reservation out of the KV budget, at most what the max_num_seqs Quest
    rows' requests can fill (core/gpu_pools.py); each request takes its dense layers' pages there;
    the request count is bound by the smaller pool."""
    ctx, dense, seqs, G = 32768, 2, 8, 27
    out = calc_json(model_dir, "--context", ctx, "--gpu-kv-gib", G, "--host-gib", host_gib,
                    "--dense-layers", dense, "--dense-pool-gib", pool_gib, "--max-num-seqs", seqs)
    h = out["hisparse"]
    pages = ctx // 16
    pool_pages = min(pool_gib * GIB // (16 * TOK * dense), seqs * pages)
    pool_bytes = pool_pages * 16 * TOK * dense
    assert (h["dense_pool_bytes"], h["dense_pool_pages"]) == (pool_bytes, pool_pages)
    assert h["dense_pool_bytes_per_request"] == dense * pages * 16 * TOK
    row = (L - dense) * 2 * pages * 8 * 128 * 2
    kv = G * GIB - pool_bytes - (seqs + 1) * row
    assert h["kv_cache_bytes"] == kv
    n_host = (host_gib * GIB // (16 * TOK * (L - dense))) // pages    # host: sparse layers only
    assert h["host_bytes_per_request"] == (L - dense) * pages * 16 * TOK
    n_gpu = admitted(kv // (16 * TOK) // L, 257, pages, seqs)
    limits = {"gpu": n_gpu, "host": n_host, "dense_pool": pool_pages // pages, "max_num_seqs": seqs}
    by = min(limits, key=limits.get)
    assert (h["max_requests"], h["bound_by"]) == (limits[by], by)


def test_quest_rows(model_dir):
    """--quest-rows sizes the Quest reservation and bounds the long requests, whatever
    --max-num-seqs says (the runtime's config quest_rows)."""
    out = calc_json(model_dir, "--context", 32768, "--gpu-kv-gib", 40, "--host-gib", 400,
                    "--max-num-seqs", 1024, "--quest-rows", 10, "--dense-layers", 2,
                    "--dense-pool-gib", 0)
    h = out["hisparse"]
    row = 30 * 2 * 2048 * 8 * 128 * 2
    assert (h["quest_rows"], h["quest_meta_bytes"]) == (10, 11 * row)
    assert h["kv_cache_bytes"] == 40 * GIB - 11 * row
    n_gpu = admitted(h["num_blocks"], 257, 2048, 1024)
    assert (h["max_requests"], h["bound_by"]) == ((10, "quest_rows") if n_gpu > 10 else (n_gpu, "gpu"))


def test_default_min_context_keeps_short_requests_resident(model_dir):
    """min_context defaults to 2 x B: a context below it is stock-like on the GPU (every page, no
    host bytes, no Quest row); at 2 x B it is sparse."""
    B = random.choice([1024, 2048, 4096])
    args = ("--buffer", B, "--top-k", B // 2, "--gpu-kv-gib", 100, "--host-gib", 50,
            "--max-num-seqs", 8, "--max-model-len", 4 * B, *GIVEN)
    short = calc_json(model_dir, "--context", 2 * B - 16, *args)["hisparse"]
    long_ = calc_json(model_dir, "--context", 2 * B, *args)["hisparse"]
    pages, block = cdiv(2 * B - 16, 16), 16 * TOK * L
    assert (short["gpu_bytes_per_request"], short["host_bytes_per_request"]) == (pages * block, 0)
    assert long_["host_bytes_per_request"] == cdiv(2 * B, 16) * block
    assert long_["gpu_bytes_per_request"] == (B // 16 + 1) * block


def test_short_prompt_with_long_output_is_sparse(model_dir):
    """core/residency.py's length rule: a 1K prompt generating 16K turns sparse when its context
    reaches min_context (2 x B), so calc counts it as the connector admits it: host pages for its
    whole context, a Quest row, S + 1 blocks once sparse; before that it holds every page up to
    min_context (its peak). A 1K prompt with 1K of output never gets there: resident."""
    B = 4096
    args = ("--buffer", B, "--gpu-kv-gib", 40, "--host-gib", 100, "--max-num-seqs", 8, *GIVEN)
    grow = calc_json(model_dir, "--context", 17408, "--prompt", 1024, *args)
    h = grow["hisparse"]
    block = 16 * TOK * L
    assert grow["min_context"] == 2 * B and h["sparse"]
    assert h["host_bytes_per_request"] == cdiv(17408, 16) * block
    assert h["gpu_bytes_per_request"] == (B // 16 + 1) * block
    assert h["peak_blocks_per_request"] == 2 * B // 16            # its pages at the switch
    long_prompt = calc_json(model_dir, "--context", 17408, *args)["hisparse"]
    assert long_prompt["peak_blocks_per_request"] == cdiv(17408, 16)      # its prefill
    differ = ("peak_blocks_per_request", "gpu_bound", "max_requests", "bound_by")
    assert {k: v for k, v in h.items() if k not in differ} == \
        {k: v for k, v in long_prompt.items() if k not in differ}
    # the GPU bound counts the last one admitted at its peak: the 1K prompt's 512 blocks at
    # min_context, the long prompt's 1088 during its prefill
    for r, peak in ((h, 2 * B // 16), (long_prompt, cdiv(17408, 16))):
        assert r["gpu_bound"]["requests"] == admitted(r["num_blocks"], B // 16 + 1, peak, 8)
    short = calc_json(model_dir, "--context", 2048, "--prompt", 1024, *args)["hisparse"]
    assert not short["sparse"] and short["host_bytes_per_request"] == 0
    assert short["peak_blocks_per_request"] == 2048 // 16
    text = calc("--model", model_dir, "--context", 17408, "--prompt", 1024, *args)
    assert "1024-token prompt with 16384 output tokens holds up to 512 blocks" in text
    # sent together they all hold 512 blocks before any turns sparse: a count of requests
    # placed one by one until the next would not fit (the null block kept out)
    g = h["gpu_bound"]
    n, used = 0, 1
    while used + 2 * B // 16 <= g["num_blocks"]:
        n, used = n + 1, used + 2 * B // 16
    assert g["peak_together_requests"] == n < g["requests"]
    assert f"sent together, such requests reach that peak together: {n} fit at once" in text
    # a long prompt's peak is its prefill (one at a time): no such figure, no such line
    assert long_prompt["gpu_bound"]["peak_together_requests"] is None
    text = calc("--model", model_dir, "--context", 17408, "--prompt", 12000, *args)
    assert "sent together" not in text and "12000-token prompt" in text


def test_hostless_counts_whole_lives_beyond_the_host_tier(model_dir):
    """Beyond the host-backed requests (here bound by a 40-request host pool), requests run
    host-less while the usable blocks hold every host-backed floor (S+1 = 257), the spill reserve
    R (cdiv(8192, 16) + max_num_seqs) and their whole lives (2048 blocks at 32K)
    (core/residency.hostless_room, the connector's rule): "sparse" (the default) needs an idle
    Quest row for each, "dense" none; "wait" counts none."""
    args = ("--context", 32768, "--gpu-kv-gib", 60, "--host-gib", 40 * 4, "--max-num-seqs", 64,
            "--dense-layers", 0, "--dense-pool-gib", 0)

    def at(rows, mode=None):
        h = calc_json(model_dir, *args, "--quest-rows", rows,
                      *(("--hostless", mode) if mode else ()))["hisparse"]
        assert (h["max_requests"], h["bound_by"]) == (40, "host")      # 4 GiB per request
        return h, (h["num_blocks"] - 1 - 40 * 257 - (8192 // 16 + 64)) // 2048

    assert at(64, "wait")[0]["hostless_requests"] == 0
    dense, fit = at(64, "dense")
    assert dense["hostless_requests"] == min(fit, 64 - 40) > 0
    sparse, fit = at(64)                                   # 24 idle rows: not the bound here
    n = sparse["hostless_requests"]
    assert n == min(fit, 24) > 0
    # the rows never used are those neither kind takes ("wait" counts all 24)
    w = sparse["quest_rows_warning"]
    assert (w["unused_rows"], w["set_quest_rows"]) == (24 - n, 40 + n) and "run host-less" in w["text"]
    assert at(64, "wait")[0]["quest_rows_warning"]["unused_rows"] == 24
    sparse, fit = at(42)                                   # 2 idle rows: they bound it
    assert fit > 2 and sparse["hostless_requests"] == 2 and sparse["quest_rows_warning"] is None
    dense, fit = at(42, "dense")
    assert dense["hostless_requests"] == min(fit, 64 - 40) > 2
    # a GPU too small for one more whole life: none
    small = calc_json(model_dir, *args[:2], "--gpu-kv-gib", 12, *args[4:], "--quest-rows", 64,
                      "--hostless", "dense")["hisparse"]
    assert small["hostless_requests"] == 0
