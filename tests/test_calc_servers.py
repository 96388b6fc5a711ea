"""`hisparse calc` for the serving configs: a short server gets stock's KV, a long one keeps its
pools, the GPU bound simulated as admission, the auto buffer, the Quest rows' warning and the stock
bound (the helpers: tests/calc_cli.py)."""
import pytest
from calc_cli import GIB, L, TOK, admitted, calc, calc_json, cdiv, model_dir  # noqa: F401


SERVING = ("--buffer", 4096, "--top-k", 2048, "--dense-pool-gib", 6, "--host-gib", 84,
           "--quest-rows", 22, "--dense-layers", 2)     # bench/serving.py's hisparse config


@pytest.mark.parametrize("input_len,seqs", [(4096, 64), (4096, 256), (2048, 128)])
def test_short_server_gets_stock_kv(model_dir, input_len, seqs):
    """issue 14 item 5: a server whose max_model_len is below min_context (2 x B = 8192) can hold
    no sparse request, so vLLM's own attention backend serves it (setup_check.serve_as_stock): no
    Quest row (not even the scratch one), no dense pool, stock's KV cache and as many requests as
    stock. Hand computation: H200 run's stock KV budget, Llama-3-8B, max_model_len =
    input + 512 + 16 (bench/serving.py)."""
    G, mml = 27.4, input_len + 512 + 16
    out = calc_json(model_dir, "--context", mml, "--max-model-len", mml, "--gpu-kv-gib", G,
                    "--max-num-seqs", seqs, *SERVING)
    b, h = out["baseline"], out["hisparse"]
    pages = cdiv(mml, 16)
    block = 16 * TOK * L
    assert (h["dense_pool_bytes"], h["quest_rows"], h["quest_meta_bytes"]) == (0, 0, 0)
    stock_blocks = int(G * GIB) // block
    assert b["num_blocks"] == h["num_blocks"] == stock_blocks
    assert "vLLM's own attention backend serves every layer" in h["startup_line"]
    assert h["max_requests"] == b["max_requests"] == min((stock_blocks - 1) // pages, seqs)
    assert h["vllm_max_concurrency"] == h["num_blocks"] / pages      # every page, as stock


def test_long_server_keeps_its_pools(model_dir):
    """The same config at 32K (max_model_len 33,296): 22 Quest rows + the scratch row, and the 6 GiB
    dense pool, which 22 requests of 2,081 pages x 2 dense layers (5.59 GiB) cannot fill, sized to
    that: the admission (22 at once, as the 32K / 512 run of docs/gpu-results.md) is today's."""
    G, mml = 27.4, 32768 + 512 + 16
    out = calc_json(model_dir, "--context", mml, "--gpu-kv-gib", G, "--max-num-seqs", 64, *SERVING)
    h = out["hisparse"]
    pages = cdiv(mml, 16)
    row = 30 * 2 * pages * 8 * 128 * 2
    dense_pages = min(6 * GIB // (16 * TOK * 2), 22 * pages)
    assert dense_pages == 22 * pages
    assert (h["quest_rows"], h["quest_meta_bytes"]) == (22, 23 * row)
    assert (h["dense_pool_pages"], h["dense_pool_bytes"]) == (dense_pages, dense_pages * 16 * TOK * 2)
    kv = int(G * GIB) - 23 * row - dense_pages * 16 * TOK * 2
    assert h["kv_cache_bytes"] == kv
    n_host = (84 * GIB // (16 * TOK * 30)) // pages
    n_gpu = admitted(kv // (16 * TOK * L), 257, pages, 64)
    assert n_host >= 22 and n_gpu >= 22
    assert h["max_requests"] == 22 and h["bound_by"] in ("quest_rows", "host")
    assert out["baseline"]["max_requests"] == (int(G * GIB) // (16 * TOK * L) - 1) // pages


# the 40K server of the brief: Llama-3-8B shape on an H200 share, 6 GiB dense pool, 24 seqs
EXAMPLE = ("--context", 40960, "--gpu-kv-gib", 27.7, "--host-gib", 84, "--dense-pool-gib", 6,
           "--max-num-seqs", 24)


@pytest.mark.parametrize("extra,seqs,batched,rf,wm", [
    ((), 24, 8192, True, 0.0),
    (("--no-resident-first",), 24, 8192, False, 0.0),
    (("--max-num-batched-tokens", 2048, "--watermark", 0.01), 24, 2048, True, 0.01),
    (("--watermark", 0.01, "--no-resident-first"), 24, 8192, False, 0.01),
    (("--prompt", 1024), 24, 8192, True, 0.0),        # peak at min_context, not its prefill
])
def test_gpu_bound_simulates_admission(model_dir, extra, seqs, batched, rf, wm):
    """The GPU bound is what one-by-one admission reaches (N fits, N + 1 does not), not
    num_blocks // (S + 1): before this the brief's example said 17 (host-bound), the last request's
    prompt left out."""
    h = calc_json(model_dir, *EXAMPLE, "--buffer", 6144, "--quest-rows", 18, *extra)["hisparse"]
    prompt = dict(zip(extra[::2], extra[1::2])).get("--prompt", 40960)
    peak = cdiv(max(prompt, 2 * 6144), 16)
    n = admitted(h["num_blocks"], 385, peak, seqs, batched=batched, resident_first=rf, watermark=wm)
    g = h["gpu_bound"]
    assert g["requests"] == n and g["resident_first"] == rf and g["max_num_batched_tokens"] == batched
    # N fits, N + 1 does not, counted from the blocks; R reported, not subtracted
    wmb = int(wm * h["num_blocks"])
    used = lambda k: (k - 1) * 385 + peak + wmb + rf
    assert used(n) <= h["num_blocks"] - 1 < used(n + 1)
    assert g["spill_reserve_blocks"] == (cdiv(batched, 16) + seqs + wmb if rf else 0)
    if not extra:
        assert (n, h["max_requests"], h["bound_by"]) == (16, 16, "gpu")


def test_gpu_bound_is_printed(model_dir):
    out = calc("--model", model_dir, *EXAMPLE, "--buffer", 6144, "--quest-rows", 18)
    assert "GPU bound: 16 = 1 + (blocks 8452 - 1 null - 2561 for the last one admitted" in out
    assert "the KV manager spills to keep R 536 free" in out


@pytest.mark.parametrize("rows", [18, 22])
def test_buffer_auto_keeps_the_requests_of_2k(model_dir, rows):
    """--buffer auto: the largest B whose max requests are those at B = 2 x top_k; one page more
    loses a request."""
    args = (*EXAMPLE, "--quest-rows", rows)
    auto = calc_json(model_dir, *args, "--buffer", "auto")
    B, want = auto["buffer"], calc_json(model_dir, *args, "--buffer", 4096)["hisparse"]["max_requests"]
    assert B % 16 == 0 and B >= 4096 and auto["buffer_auto"]["buffer"] == B
    assert auto["hisparse"]["max_requests"] == auto["buffer_auto"]["max_requests"] == want
    # the sweep pins min_context to the reference's (2 x 4096 here), so the same requests are sparse
    mc = ("--min-context", auto["min_context"])
    assert auto["min_context"] == 8192
    assert auto == calc_json(model_dir, *args, *mc, "--buffer", B) | {"buffer_auto": auto["buffer_auto"]}
    assert calc_json(model_dir, *args, *mc, "--buffer", B + 16)["hisparse"]["max_requests"] < want
    text = calc("--model", model_dir, *args, "--buffer", "auto")
    assert text.startswith(f"B=auto: {B} tokens (S={B // 16}): the largest hot buffer that keeps "
                           f"{want} requests")
    assert f", B={B}, top_k=2048" in text


def test_buffer_auto_capped_by_max_model_len(model_dir):
    """Plenty of GPU: every B up to max_model_len keeps the requests (the host pool bounds them)."""
    out = calc_json(model_dir, "--context", 16384, "--gpu-kv-gib", 100, "--host-gib", 8,
                    "--max-num-seqs", 8, "--min-context", 0, "--buffer", "auto")
    assert out["buffer"] == 16384 and out["buffer_auto"]["capped"]
    assert out["hisparse"]["bound_by"] == "host"


@pytest.mark.parametrize("rows", [12, 16, 17, 18, 22])
def test_quest_rows_warning(model_dir, rows):
    """A warning exactly when the Quest rows exceed the requests the other limits admit: the rows
    never used, their bytes, and the quest_rows that admits the most."""
    args = (*EXAMPLE, "--buffer", 6144, "--quest-rows", rows)
    h = calc_json(model_dir, *args)["hisparse"]
    w, text = h["quest_rows_warning"], calc("--model", model_dir, *args)
    if h["max_requests"] == rows:
        assert w is None and "never used" not in text
        return
    assert h["max_requests"] < rows and h["bound_by"] != "quest_rows"
    assert w["unused_rows"] == rows - h["max_requests"]
    fewer = calc_json(model_dir, *EXAMPLE, "--buffer", 6144, "--quest-rows", h["max_requests"])
    assert w["unused_bytes"] == fewer["hisparse"]["kv_cache_bytes"] - h["kv_cache_bytes"] > 0
    best = w["set_quest_rows"]
    at = lambda q: calc_json(model_dir, *EXAMPLE, "--buffer", 6144, "--quest-rows", q)["hisparse"]
    assert at(best)["max_requests"] == best and at(best)["quest_rows_warning"] is None
    assert at(best + 1)["max_requests"] < best + 1
    assert w["text"] in text and f"set quest_rows to {best}" in text


def test_no_quest_rows_warning_when_auto(model_dir):
    """Without --max-num-seqs, --quest-rows 0 is calc's fixed point: as many rows as requests fit,
    host included, so none is idle (the server's auto rows are not capped by a given host pool:
    tests/test_auto_size.py)."""
    h = calc_json(model_dir, "--context", 40960, "--gpu-kv-gib", 27.7, "--host-gib", 84,
                  "--quest-rows", 0, "--dense-pool-gib", 0)["hisparse"]
    assert h["quest_rows_warning"] is None and h["max_requests"] == h["quest_rows"]


def test_stock_bound_ignores_the_prompt(model_dir):
    """A stock request never gives blocks back: a short prompt does not let more of them run."""
    a = calc_json(model_dir, *EXAMPLE)["baseline"]
    b = calc_json(model_dir, *EXAMPLE, "--prompt", 1024)["baseline"]
    assert a["max_requests"] == b["max_requests"] == (a["num_blocks"] - 1) // cdiv(40960, 16)


def test_the_128k_server_run_at_util_09(model_dir):
    """docs/gpu-results.md, tenth box (H100, util 0.9, 128K in / 1K out, `{"top_k": 2048}`, every
    pool auto): stock logged 56.9 GiB of KV (466,128 tokens: 3 requests of 132,112) and the
    hisparse server saw 124.43 GiB of RAM and printed room for 8 = 6 host-backed + 2 host-less.
    calc with those inputs must print the server's counts, and its stock count by hand."""
    mml = 131072 + 1024 + 16
    out = calc_json(model_dir, "--context", mml, "--max-model-len", mml, "--gpu-kv-gib", 56.9,
                    "--host-ram-gib", 124.43, "--max-num-seqs", 16)
    b, h = out["baseline"], out["hisparse"]
    assert b["max_requests"] == (int(56.9 * GIB) // (16 * TOK * L) - 1) // cdiv(mml, 16) == 3
    assert (h["max_requests"], h["hostless_requests"], h["quest_rows"]) == (6, 2, 8)
    assert h["startup_line"].startswith(
        "hisparse: room for 8 requests of max_model_len=132112 tokens at once "
        "(6 host-backed + 2 host-less (hostless=sparse); quest_rows=8 auto; host pool 90.71 GiB auto")
