"""Serving benchmark plumbing (the GPU runs live in docs/gpu-results.md): the server command each
backend gets and the per-point aggregation."""
import json
from types import SimpleNamespace

import pytest

from vllm_hisparse.bench.serving import server_cmd
from vllm_hisparse.bench.serving_load import Point, RequestResult


def args(**kw):
    base = dict(model="/m", input_len=1000, output_len=24, concurrency=[1, 8],
                gpu_memory_utilization=0.3, load_format="dummy", extra_server_args=[],
                hisparse='{"top_k": 64, "device_buffer_size": 128}')
    return SimpleNamespace(**{**base, **kw})


def test_server_cmd_per_backend():
    stock = server_cmd(args(), "stock", 9)
    assert "--attention-backend" not in stock and "--no-enable-prefix-caching" in stock
    assert stock[stock.index("--max-model-len") + 1] == "1040" and stock[stock.index("--max-num-seqs") + 1] == "8"
    cap = server_cmd(args(concurrency=[1, "cap"]), "stock", 9)
    assert cap[cap.index("--max-num-seqs") + 1] == "256"        # vLLM's default
    mine = server_cmd(args(concurrency=[1, "cap"], max_num_seqs=24), "stock", 9)
    assert mine[mine.index("--max-num-seqs") + 1] == "24"
    res = server_cmd(args(), "resident", 9)
    cfg = json.loads(res[res.index("--additional-config") + 1])["hisparse"]
    assert cfg == {"top_k": 64, "device_buffer_size": 128, "host_tier": False}
    his = server_cmd(args(), "hisparse", 9)
    cfg = json.loads(his[his.index("--additional-config") + 1])["hisparse"]
    assert cfg.get("host_tier", True) and cfg["resident_first"] is False
    el = server_cmd(args(), "elastic", 9)
    cfg = json.loads(el[el.index("--additional-config") + 1])["hisparse"]
    assert cfg == {"top_k": 64, "device_buffer_size": 128, "resident_first": True}


def test_point_row_aggregates():
    rs = [RequestResult(ttft=0.5, latency=2.5, output_tokens=5), RequestResult(1.5, 3.5, 3)]
    pt = Point("stock", 2, rs, wall=4.0, running_max=2, running_mean=1.5,
               decode={"tok_s": 12.34, "seconds": 0.5, "step_ms": 1.25}, engine_steps=9,
               host={"plan": 0.1234, "layers": 2.5})
    row = pt.row()
    assert row["output_tok_s"] == pytest.approx(8 / 4.0)
    assert row["ttft_mean_s"] == pytest.approx(1.0)
    assert row["tpot_mean_ms"] == pytest.approx(1e3 * (2.0 / 4 + 2.0 / 2) / 2)
    assert row["requests"] == 2 and row["running_max"] == 2
    assert (row["decode_tok_s"], row["decode_step_ms"], row["engine_steps"]) == (12.3, 1.25, 9)
    assert (row["host_ms_plan_per_step"], row["host_ms_layers_per_step"]) == (0.123, 2.5)
    empty = Point("stock", 1, rs, wall=1.0).row()          # stock: no worker counters
    assert empty["decode_tok_s"] is None and empty["host_ms_plan_per_step"] is None


class _FakeStream:
    """An OpenAI completions stream: text chunks (several tokens merged into one, as vLLM's API
    server does under load), then the usage chunk (stream_options include_usage)."""

    def __init__(self, texts, usage):
        self.items = [SimpleNamespace(choices=[SimpleNamespace(text=t)], usage=None) for t in texts]
        if usage is not None:
            self.items.append(SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=usage)))

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for x in self.items:
            yield x


class _FakeClient:
    def __init__(self, stream):
        self.stream, self.kwargs = stream, None
        self.completions = SimpleNamespace(create=self._create)

    async def _create(self, **kw):
        self.kwargs = kw
        return self.stream


@pytest.mark.parametrize("n_chunks", [1, 3, 7])
def test_one_request_counts_tokens_from_usage_not_chunks(n_chunks):
    import asyncio
    import random

    from vllm_hisparse.bench.serving_load import one_request

    out_len = random.randint(20, 600)
    client = _FakeClient(_FakeStream([" ab" * 3] * n_chunks, usage=out_len))
    r = asyncio.run(one_request(client, "m", [1, 2, 3], out_len))
    assert r.output_tokens == out_len                    # not n_chunks
    assert client.kwargs["stream_options"] == {"include_usage": True}
    assert client.kwargs["extra_body"] == {"ignore_eos": True, "min_tokens": out_len}


def test_ttft_counts_chunks_without_text():
    """A first token that decodes to no text yet still ends the time to first token; a stream with
    no token chunk at all has no TTFT (nan), never 0."""
    import asyncio
    import math

    from vllm_hisparse.bench.serving_load import one_request

    r = asyncio.run(one_request(_FakeClient(_FakeStream(["", "", "x"], usage=3)), "m", [1], 3))
    assert 0 <= r.ttft <= r.latency and not math.isnan(r.ttft)
    r = asyncio.run(one_request(_FakeClient(_FakeStream([], usage=3)), "m", [1], 3))
    assert math.isnan(r.ttft) and math.isnan(r.tpot)


def test_one_request_without_usage_says_so():
    import asyncio

    from vllm_hisparse.bench.serving_load import one_request

    with pytest.raises(RuntimeError, match="include_usage"):
        asyncio.run(one_request(_FakeClient(_FakeStream(["x", "y"], usage=None)), "m", [1], 2))


def test_capacity_from_the_startup_log():
    """--concurrency cap: stock runs what vLLM's KV line says; hisparse also what admission has
    room for (the connector's line); at most max_num_seqs, at least one; no line, one error."""
    from vllm_hisparse.bench.serving import capacity

    log = ("INFO ... Maximum concurrency for 17,424 tokens per request: 12.85x\n"
           "INFO ... hisparse: room for 22 requests of max_model_len=17424 tokens at once (...)\n")
    assert capacity(log, "stock", 17424, 256) == 12
    assert capacity(log.replace("12.85", "99.20"), "hisparse", 17424, 256) == 22
    assert capacity(log.replace("12.85", "99.20"), "hisparse", 17424, 16) == 16
    assert capacity(log.replace("12.85", "0.40"), "stock", 17424, 256) == 1
    with pytest.raises(RuntimeError, match="give numbers to --concurrency"):
        capacity(log, "stock", 1000, 256)
    with pytest.raises(RuntimeError, match="room for N requests"):
        capacity(log.splitlines()[0], "resident", 17424, 256)


def test_host_time_per_step_from_the_worker_counters():
    from vllm_hisparse.bench.worker_stats import host_per_step

    before = {"steps": 10, "host_ms_plan": 5.0, "host_ms_dense_layers": 1.0,
              "host_ms_sparse_layers": 2.0, "host_ms_full_layers": 0.0}
    after = {"steps": 30, "host_ms_plan": 9.0, "host_ms_dense_layers": 3.0,
             "host_ms_sparse_layers": 10.0, "host_ms_full_layers": 20.0}
    h = host_per_step(before, after)
    assert h["steps"] == 20
    assert h["plan"] == pytest.approx(4.0 / 20) and h["layers"] == pytest.approx(30.0 / 20)
    assert host_per_step(None, after) == {} and host_per_step(after, after) == {}


def test_cache_counters_per_point():
    from vllm_hisparse.bench.worker_stats import cache_per_point

    before = {"hits": 100, "misses": 20, "spills": 1, "policy": "crf"}
    after = {"hits": 190, "misses": 30, "spills": 3, "shrinks": 5, "resident_units": 100,
             "policy": "crf"}
    c = cache_per_point(before, after)
    assert c == {"policy": "crf", "hit_rate": pytest.approx(0.9), "misses": 10,
                 "miss_rate": pytest.approx(0.05), "resident_units": 100, "spills": 2,
                 "shrinks": 5}
    assert cache_per_point(None, after) == {} and cache_per_point(after, after) == {}
    # resident_first with no spill: every selected page on the block table, no hot-slot lookup
    res = cache_per_point({"resident_units": 10}, {"resident_units": 50, "policy": "lru"})
    assert res["hit_rate"] is None and res["miss_rate"] == 0 and res["resident_units"] == 40
    rs = [RequestResult(ttft=0.5, latency=2.5, output_tokens=5)]
    row = Point("hisparse", 1, rs, wall=1.0, cache=c).row()
    assert (row["policy"], row["hit_rate"], row["misses"], row["spills"]) == ("crf", 0.9, 10, 2)


def test_real_text_prompts_are_distinct_windows(tmp_path):
    """--text-ids: each request reads input_len tokens of the text at its own offset; the file's
    three layouts load to the same tokens; a text shorter than a prompt is refused."""
    import random

    from vllm_hisparse.bench.prompts import load_text_ids, text_prompts

    a, b = list(range(1000, 1600)), list(range(5000, 5400))
    for i, d in enumerate(({"x": a, "y": b}, [a, b], a + b)):
        path = tmp_path / f"ids{i}.json"
        path.write_text(json.dumps(d))
        assert load_text_ids(str(path)) == a + b
    toks = a + b
    ps = text_prompts(toks, 300, 20, random.Random(3))
    assert len(ps) == 20 and all(len(p) == 300 for p in ps)
    starts = [toks.index(p[0]) for p in ps]
    assert len(set(starts)) == 20                                    # no shared prefix
    assert all(toks[s:s + 300] == p for s, p in zip(starts, ps))    # windows of the text
    assert ps == text_prompts(toks, 300, 20, random.Random(3))       # seeded
    assert len(text_prompts(toks, 999, 5, random.Random(0))) == 5    # 2 offsets: repeats allowed
    with pytest.raises(SystemExit, match="cannot fill --input-len 1001"):
        text_prompts(toks, 1001, 1, random.Random(0))


def test_dsa_models_run_the_dsa_path(tmp_path):
    """A DSA model (index_topk in config.json): stock on FLASH_ATTN_MLA_SPARSE (FLASHMLA_SPARSE
    with an fp8_ds_mla cache) with every prefill token through the sparse MQA path, the tiny
    tokenizer's hf mode, hisparse's DSA default config, the DSA ledger's admission line as
    capacity; hisparse with resident_first off (every complete prompt through its row set),
    elastic with it on (a complete prompt decodes in its region until a prompt needs it)."""
    from vllm_hisparse.bench.serving import DSA_DEFAULT, capacity, is_dsa, main

    (tmp_path / "config.json").write_text(json.dumps({"index_topk": 2048, "kv_lora_rank": 512}))
    assert is_dsa(str(tmp_path)) and not is_dsa(str(tmp_path / "none"))
    a = args(model=str(tmp_path), dsa=True, hisparse=DSA_DEFAULT)
    stock = server_cmd(a, "stock", 9)
    cfg = json.loads(stock[stock.index("--attention-config") + 1])
    assert cfg == {"backend": "FLASH_ATTN_MLA_SPARSE", "sparse_mla_force_mqa": True}
    assert stock[stock.index("--tokenizer-mode") + 1] == "hf"
    f8 = server_cmd(args(model=str(tmp_path), dsa=True, hisparse=DSA_DEFAULT,
                         extra_server_args=["--kv-cache-dtype", "fp8_ds_mla"]), "stock", 9)
    assert json.loads(f8[f8.index("--attention-config") + 1])["backend"] == "FLASHMLA_SPARSE"
    his = server_cmd(a, "hisparse", 9)
    assert "--attention-config" not in his
    hcfg = json.loads(his[his.index("--additional-config") + 1])["hisparse"]
    assert hcfg["indexer"] == "dsa" and hcfg["resident_first"] is False
    ela = server_cmd(a, "elastic", 9)
    ecfg = json.loads(ela[ela.index("--additional-config") + 1])["hisparse"]
    assert ecfg == dict(hcfg, resident_first=True)
    assert "--tokenizer-mode" not in server_cmd(args(), "stock", 9)       # a GQA model: as before
    log = ("INFO ... Maximum concurrency for 33,000 tokens per request: 40.10x\n"
           "INFO ... hisparse dsa: admission of 24 requests at once (2 prefill regions, ...)\n")
    assert capacity(log, "hisparse", 33000, 256) == capacity(log, "elastic", 33000, 256) == 24


def test_capacity_of_a_server_that_is_stock_vllm(monkeypatch):
    """A hisparse server where no request can be sparse says it is stock vLLM (the startup warning
    of setup_check.serve_as_stock, taken from the function itself) and has no room line: its
    capacity is vLLM's KV line alone; without that warning the missing room line is an error."""
    from types import SimpleNamespace

    from vllm_hisparse.bench.serving import capacity
    from vllm_hisparse.config import HiSparseConfig
    from vllm_hisparse.vllm import setup_check

    said = []
    monkeypatch.setattr(setup_check.logger, "warning", lambda msg, *a: said.append(msg % a))
    setup_check.serve_as_stock(SimpleNamespace(attention_config=SimpleNamespace(backend="x")),
                               HiSparseConfig(), 4624)
    log = ("INFO ... Maximum concurrency for 4,624 tokens per request: 57.30x\n"
           f"WARNING ... {said[0]}\n")
    assert capacity(log, "elastic", 4624, 256) == 57
    with pytest.raises(RuntimeError, match="room for N requests"):
        capacity(log.splitlines()[0], "elastic", 4624, 256)
