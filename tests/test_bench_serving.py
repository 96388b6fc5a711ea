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
