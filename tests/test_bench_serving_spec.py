"""bench.serving --speculative / --repeat-block (issue 47 item 3's speedup at 1 request,
bench/serving_spec.py) on fake servers: every backend served twice (rows BACKEND and BACKEND+spec,
--speculative-config only on the second), each +spec row's acceptance from /metrics deltas around
its point, the TPOT speedup per backend and hisparse's over stock's; the repeated-block prompts."""
from __future__ import annotations

import asyncio
import csv
import http.server
import json
import random
import threading
from types import SimpleNamespace

import pytest

from vllm_hisparse.bench import serving, serving_load
from vllm_hisparse.bench import serving_spec as spec
from vllm_hisparse.bench.prompts import repeated
from vllm_hisparse.bench.serving_load import Point, RequestResult

SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'


def test_each_backend_served_twice_with_the_config_on_the_second():
    assert spec.runs(["stock", "hisparse"], SPEC) == [
        ("stock", "stock", []), ("stock", "stock+spec", ["--speculative-config", SPEC]),
        ("hisparse", "hisparse", []), ("hisparse", "hisparse+spec", ["--speculative-config", SPEC])]
    assert spec.runs(["stock", "elastic"], None) == [("stock", "stock", []),
                                                      ("elastic", "elastic", [])]
    assert spec.file_tag("hisparse+spec") == "hisparse-spec"


def test_acceptance_from_counter_deltas():
    before = {"drafts": 10, "draft_tokens": 30, "accepted": 12}
    after = {"drafts": 50, "draft_tokens": 150, "accepted": 102}
    assert spec.acceptance(before, after) == {"spec_drafts": 40, "spec_draft_tokens": 120,
                                              "spec_accepted": 90, "acceptance_rate": 0.75}
    none = spec.acceptance({}, {})                       # a server without speculation
    assert set(none.values()) == {None}
    zero = spec.acceptance(after, after)                 # no draft in the point: no rate
    assert zero["spec_draft_tokens"] == 0 and zero["acceptance_rate"] is None


def test_scrape_reads_vllm_counter_names():
    """The names vLLM 0.26 gives its counters (v1/spec_decode/metrics.py), as prometheus_client
    exposes them on /metrics (counters' samples end in _total), summed over engines."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reg = CollectorRegistry()
    got = {"drafts": 7, "draft_tokens": 21, "accepted_tokens": 15}
    for k, v in got.items():
        c = Counter(f"vllm:spec_decode_num_{k}", "x", ["model_name", "engine"], registry=reg)
        c.labels("m", "0").inc(v)
        c.labels("m", "1").inc(1)
    body = generate_latest(reg)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert spec.scrape(srv.server_address[1]) == {"drafts": 8, "draft_tokens": 22,
                                                      "accepted": 16}
    finally:
        srv.shutdown()
    assert spec.scrape(1) == {}                          # nothing listening: no counters


def _rows(tpots: dict) -> list[dict]:
    return [{"backend": b, "concurrency": 1, "tpot_mean_ms": t} for b, t in tpots.items()]


def test_speedup_lines_and_the_ratio():
    rows = _rows({"stock": 20.0, "stock+spec": 10.0, "hisparse": 24.0, "hisparse+spec": 12.5})
    assert spec.speedup_lines(rows) == [
        "speedup stock: TPOT 20.00 / 10.00 = 2.000",
        "speedup hisparse: TPOT 24.00 / 12.50 = 1.920",
        "hisparse speedup / stock speedup = 0.960 (issue 47: >= 0.9): met"]
    slow = _rows({"stock": 20.0, "stock+spec": 10.0, "elastic": 24.0, "elastic+spec": 16.0})
    assert spec.speedup_lines(slow)[-1] == ("elastic speedup / stock speedup = 0.750 "
                                            "(issue 47: >= 0.9): NOT met")
    # without stock's pair: the speedup alone, no ratio; a backend without its +spec row: nothing
    only = spec.speedup_lines(_rows({"hisparse": 24.0, "hisparse+spec": 12.0, "stock": 9.0}))
    assert only == ["speedup hisparse: TPOT 24.00 / 12.00 = 2.000"]


def test_main_serves_twice_and_prints_the_speedups(tmp_path, monkeypatch, capsys):
    """bench.serving's main on fake servers: the commands, rows, CSV columns and end lines."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    cmds, live = [], {}
    tpot = {"stock": 20.0, "stock+spec": 10.0, "hisparse": 24.0, "hisparse+spec": 12.5}
    counters = {"n": 0}

    class Proc:
        def __init__(self, cmd, **kw):
            cmds.append(cmd)
            live["spec"] = "--speculative-config" in cmd

    def scrape(port):
        if not live["spec"]:
            return {}
        counters["n"] += 1           # each scrape later than the last: the point's drafts
        n = counters["n"]
        return {"drafts": 10 * n, "draft_tokens": 30 * n, "accepted": 12 * n}

    async def run_point(args, name, c, *a, **kw):
        t = tpot[name] / 1e3
        return Point(name, c, [RequestResult(0.5, 0.5 + t * 9, 10)], wall=1.0)

    monkeypatch.setattr(serving.subprocess, "Popen", Proc)
    for attr, fake in (("wait_healthy", lambda *a: 0), ("warm_up", lambda *a: None),
                       ("stop", lambda *a, **k: None), ("run_point", run_point),
                       ("plot", lambda *a: None)):
        monkeypatch.setattr(serving, attr, fake)
    monkeypatch.setattr(serving.st, "read", lambda *a: ([{"running": 0}], 0))
    monkeypatch.setattr(spec, "scrape", scrape)
    out = tmp_path / "out"
    assert serving.main(["--model", str(tmp_path / "m"), "--concurrency", "1", "--backends",
                         "stock,hisparse", "--speculative", SPEC, "--out", str(out)]) == 0
    assert [("--speculative-config" in c, "--attention-backend" in c) for c in cmds] == [
        (False, False), (True, False), (False, True), (True, True)]
    assert cmds[1][cmds[1].index("--speculative-config") + 1] == SPEC
    rows = list(csv.DictReader(open(out / "serving.csv")))
    assert [r["backend"] for r in rows] == ["stock", "stock+spec", "hisparse", "hisparse+spec"]
    assert [r["acceptance_rate"] for r in rows] == ["", "0.4", "", "0.4"]
    assert [r["spec_draft_tokens"] for r in rows] == ["", "30", "", "30"]
    printed = capsys.readouterr().out.splitlines()
    assert printed[-3:] == ["speedup stock: TPOT 20.00 / 10.00 = 2.000",
                            "speedup hisparse: TPOT 24.00 / 12.50 = 1.920",
                            "hisparse speedup / stock speedup = 0.960 (issue 47: >= 0.9): met"]
    assert (out / "server-hisparse-spec.log").exists()
    # without --speculative: one server a backend, today's columns, no speedup line
    cmds.clear()
    assert serving.main(["--model", str(tmp_path / "m"), "--concurrency", "1", "--backends",
                         "stock", "--out", str(out)]) == 0
    assert len(cmds) == 1 and "acceptance_rate" not in next(csv.DictReader(open(out / "serving.csv")))
    assert not any("speedup" in x for x in capsys.readouterr().out.splitlines())


def test_repeated_block():
    block = [5, 6, 7]
    assert repeated(block, 8) == [5, 6, 7, 5, 6, 7, 5, 6]
    assert repeated(block, 2) == [5, 6] and repeated(block, 3) == block
    with pytest.raises(ValueError):
        repeated([], 4)


@pytest.mark.parametrize("text", [False, True])
def test_run_point_repeats_a_block_per_request(tmp_path, monkeypatch, text):
    """--repeat-block N: each request's prompt is one N-token window (of the real text with
    --text-ids, each request its own) repeated to --input-len."""
    sent = []

    class Client:
        def __init__(self, **kw):
            self.completions = SimpleNamespace(create=self._create)

        async def _create(self, **kw):
            sent.append(kw["prompt"])

            async def gen():
                yield SimpleNamespace(choices=[SimpleNamespace(text="x")], usage=None)
                yield SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=1))
            return gen()

        async def close(self):
            pass

    import openai

    monkeypatch.setattr(openai, "AsyncOpenAI", Client)
    monkeypatch.setattr(serving_load.st, "read", lambda *a: ([], 0))
    monkeypatch.setattr(serving_load, "_settle", lambda *a: ([], None))
    rng = random.Random(1)
    toks = [rng.randrange(100, 900) for _ in range(2000)]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(toks))
    args = SimpleNamespace(rounds=2, input_len=1000, output_len=1, repeat_block=96,
                           text_ids=str(ids) if text else None)
    asyncio.run(serving_load.run_point(args, "stock", 3, 0, "m", 1000, "steps"))
    assert len(sent) == 6 and all(len(p) == 1000 for p in sent)
    blocks = [p[:96] for p in sent]
    assert all(p == repeated(b, 1000) for p, b in zip(sent, blocks))
    assert len({tuple(b) for b in blocks}) == 6                     # a window per request
    if text:
        s = "," + ",".join(map(str, toks)) + ","
        assert all("," + ",".join(map(str, b)) + "," in s for b in blocks)   # windows of the text
    args.repeat_block = 0                                            # off: as before
    sent.clear()
    asyncio.run(serving_load.run_point(args, "stock", 1, 0, "m", 1000, "steps"))
    assert len(sent[0]) == 1000 and sent[0][:96] != sent[0][96:192]
