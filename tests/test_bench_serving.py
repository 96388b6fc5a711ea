"""Serving benchmark plumbing (the GPU runs live in docs/gpu-results.md): the server command each
backend gets and the per-point aggregation."""
import json
from types import SimpleNamespace

import pytest

from vllm_hisparse.bench.serving import Point, RequestResult, server_cmd


def args(**kw):
    base = dict(model="/m", input_len=1000, output_len=24, concurrency=[1, 8],
                gpu_memory_utilization=0.3, load_format="dummy", extra_server_args=[],
                hisparse='{"top_k": 64, "device_buffer_size": 128}')
    return SimpleNamespace(**{**base, **kw})


def test_server_cmd_per_backend():
    stock = server_cmd(args(), "stock", 9)
    assert "--attention-backend" not in stock and "--no-enable-prefix-caching" in stock
    assert stock[stock.index("--max-model-len") + 1] == "1040" and stock[stock.index("--max-num-seqs") + 1] == "8"
    res = server_cmd(args(), "resident", 9)
    cfg = json.loads(res[res.index("--additional-config") + 1])["hisparse"]
    assert cfg == {"top_k": 64, "device_buffer_size": 128, "host_tier": False}
    his = server_cmd(args(), "hisparse", 9)
    assert json.loads(his[his.index("--additional-config") + 1])["hisparse"].get("host_tier", True)


def test_point_row_aggregates():
    rs = [RequestResult(ttft=0.5, latency=2.5, output_tokens=5), RequestResult(1.5, 3.5, 3)]
    pt = Point("stock", 2, rs, wall=4.0, running_max=2, running_mean=1.5)
    row = pt.row()
    assert row["output_tok_s"] == pytest.approx(8 / 4.0)
    assert row["ttft_mean_s"] == pytest.approx(1.0)
    assert row["tpot_mean_ms"] == pytest.approx(1e3 * (2.0 / 4 + 2.0 / 2) / 2)
    assert row["requests"] == 2 and row["running_max"] == 2


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

    from vllm_hisparse.bench.serving import one_request

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

    from vllm_hisparse.bench.serving import one_request

    r = asyncio.run(one_request(_FakeClient(_FakeStream(["", "", "x"], usage=3)), "m", [1], 3))
    assert 0 <= r.ttft <= r.latency and not math.isnan(r.ttft)
    r = asyncio.run(one_request(_FakeClient(_FakeStream([], usage=3)), "m", [1], 3))
    assert math.isnan(r.ttft) and math.isnan(r.tpot)


def test_one_request_without_usage_says_so():
    import asyncio

    from vllm_hisparse.bench.serving import one_request

    with pytest.raises(RuntimeError, match="include_usage"):
        asyncio.run(one_request(_FakeClient(_FakeStream(["x", "y"], usage=None)), "m", [1], 2))


def test_parse_metrics():
    from vllm_hisparse.bench.serving import parse_metrics

    text = ('# HELP vllm:num_requests_running Number of requests.\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 12345.0\n'
            'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09\n')
    assert parse_metrics(text) == (7, 12345.0)
    running, gen = parse_metrics("nothing here\n")
    assert running == -1 and gen != gen


def test_peak_rate_finds_the_fastest_window():
    import random

    from vllm_hisparse.bench.serving import peak_rate

    rng = random.Random()
    rates = [rng.uniform(10, 100) for _ in range(40)]        # tok/s in each 1 s interval
    peak_at = rng.randrange(5, 35)
    rates[peak_at:peak_at + 5] = [1000.0] * 5                # one 5 s burst
    samples, t, g = [(0.0, 0.0)], 0.0, 0.0
    for r in rates:
        for _ in range(2):                                   # sampled every 0.5 s
            t += 0.5
            g += r * 0.5
            samples.append((t, g))
    assert peak_rate(samples, window=5.0) == pytest.approx(1000.0)
    assert peak_rate(samples[:5], window=5.0) == 0.0          # spans 2 s: no window
    assert peak_rate([(0.0, float("nan")), (6.0, 60.0), (12.0, 180.0)]) == pytest.approx(20.0)
