"""bench/chat.py's leak check, aborts and capacity sizing without a server: the page figures read
from a doctored /metrics page, the verdict on clean and leaking runs, the probe / reset / probe
sequence against a scripted server, the bookkeeping of aborted turns; and the page-table gauges
vllm/metrics.py exports for it."""
from __future__ import annotations

import argparse
import asyncio
import functools
import random
from types import SimpleNamespace

import pytest

from vllm_hisparse.bench import chat, chat_leaks, prom

LAB = 'model_name="m",engine="0"'
CLEAN = dict(host_pages_in_use_after=40, host_pages_held_by_cache_after=40,
             host_pages_reserved_after=0, host_pages_worker_pool_used_after=0,
             host_pages_in_use_after_reset=0, host_pages_held_by_cache_after_reset=0)


def metrics_text(in_use, cached, worker=0, reserved=0, running=0, waiting=0, aborts=0) -> str:
    g = {"vllm:hisparse_host_page_table_pages_in_use": in_use,
         "vllm:hisparse_host_page_table_pages_cached": cached,
         "vllm:hisparse_host_pool_pages_used": worker,
         "vllm:hisparse_host_pool_pages_reserved": reserved,
         "vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting}
    lines = []
    for name, v in g.items():
        lines += [f"# TYPE {name} gauge", f"{name}{{{LAB}}} {v}"]
    lines += ["# TYPE vllm:request_success counter",
              f'vllm:request_success_total{{{LAB},finished_reason="abort"}} {aborts}',
              f'vllm:request_success_total{{{LAB},finished_reason="length"}} 99']
    return "\n".join(lines) + "\n"


def test_page_figures_from_a_metrics_page():
    s = prom.parse(metrics_text(52, 40, worker=12, reserved=30, running=1))
    assert chat_leaks.pages(s) == {"in_use": 52, "held_by_cache": 40, "worker_pool_used": 12,
                             "reserved": 30}
    assert not chat_leaks.settled(s)
    assert chat_leaks.settled(prom.parse(metrics_text(40, 40)))
    assert not chat_leaks.settled(prom.parse(metrics_text(41, 40)))        # idle, one page too many
    assert not chat_leaks.settled(prom.parse(metrics_text(40, 40, waiting=2)))
    # -1: the scheduler never reported (metrics.py's initial value); absent: an older plugin
    assert chat_leaks.pages(prom.parse(metrics_text(-1, -1)))["in_use"] is None
    assert chat_leaks.pages({})["held_by_cache"] is None


def test_clean_run_passes_and_every_kind_of_leak_is_named():
    assert chat_leaks.leak_verdict("elastic", CLEAN) is None
    leak = chat_leaks.leak_verdict("elastic", dict(CLEAN, host_pages_in_use_after=43))
    assert "host page leak" in leak and "43 pages in use, 40 held by the prefix cache" in leak
    assert "\n" not in leak
    after_reset = chat_leaks.leak_verdict("elastic", dict(CLEAN, host_pages_in_use_after_reset=3))
    assert "after the reset 3 in use, 0 held" in after_reset
    for k in ("host_pages_reserved_after", "host_pages_worker_pool_used_after",
              "host_pages_held_by_cache_after_reset"):
        assert chat_leaks.leak_verdict("elastic", dict(CLEAN, **{k: 2})) is not None, k
    missing = chat_leaks.leak_verdict("elastic", dict(CLEAN, host_pages_in_use_after=None))
    assert missing.startswith("elastic: leak check impossible") and "in_use_after" in missing


class Server:
    """A scripted server: one /metrics page per scrape (the last one repeats), reset answers in
    order; records the probes."""

    def __init__(self, pages, resets):
        self.pages, self.resets, self.probes = list(pages), list(resets), 0

    def scrape(self, base):
        return prom.parse(self.pages.pop(0) if len(self.pages) > 1 else self.pages[0])

    def reset(self, base):
        return self.resets.pop(0)

    async def complete(self, prompt, out_len, abort_after=None):
        self.probes += 1
        assert prompt == chat_leaks.PROBE and out_len == 2
        return 0.0, 0.0, [0] * out_len


def fake_completer(sent: list):
    """bench.chat's openai_completer stand-in: every reply 7s (cut at abort_after), the prompts
    appended to ``sent``."""
    def completer(port, model):
        async def complete(prompt, out_len, abort_after=None):
            sent.append(list(prompt))
            return 0.01, 0.02, [7] * (out_len if abort_after is None else abort_after)

        class Client:
            async def close(self):
                pass
        return complete, Client()
    return completer


def run_leak_check(monkeypatch, server, timeout=30.0):
    monkeypatch.setattr(chat.prom, "scrape", server.scrape)
    monkeypatch.setattr(chat_leaks, "reset_prefix_cache", server.reset)

    async def no_sleep(s):
        return None
    monkeypatch.setattr(chat.asyncio, "sleep", no_sleep)
    return asyncio.run(chat_leaks.leak_check(server.complete, "http://x", timeout))


def test_leak_check_probes_until_idle_resets_and_reads_again(monkeypatch):
    srv = Server([metrics_text(60, 40, worker=20, reserved=20, running=1),   # an abort in flight
                  metrics_text(40, 40, aborts=3),                            # settled
                  metrics_text(40, 40),                                      # reset not yet seen
                  metrics_text(0, 0)], resets=[False, True])
    r = run_leak_check(monkeypatch, srv)
    assert r["host_pages_in_use_after"] == 40 and r["host_pages_held_by_cache_after"] == 40
    assert r["host_pages_in_use_after_reset"] == 0 and r["requests_aborted_server"] == 3
    assert srv.probes == 5                     # 2 to settle, 1 after the refused reset, 2 after
    assert chat_leaks.leak_verdict("elastic", r) is None


def test_a_leak_that_outlasts_the_probes_is_reported(monkeypatch):
    srv = Server([metrics_text(45, 40), metrics_text(5, 0)], resets=[True])
    r = run_leak_check(monkeypatch, srv, timeout=0.0)          # one probe each, then give up
    assert (r["host_pages_in_use_after"], r["host_pages_in_use_after_reset"]) == (45, 5)
    v = chat_leaks.leak_verdict("elastic", r)
    assert "45 pages in use, 40 held" in v and "after the reset 5 in use" in v


def _args(**kw):
    d = dict(conversations=3, turns=4, system_len=40, user_len=25, output_len=6, concurrency=0,
             text_ids=None, abort_every=5)
    d.update(kw)
    return argparse.Namespace(**d)


def test_every_nth_turn_is_aborted_mid_reply_and_the_conversation_goes_on():
    args = _args()
    assert [chat.aborted_turns(args, c) for c in range(3)] == [set(), {0}, {1}]   # turns 5, 10
    assert chat.aborted_turns(_args(abort_every=0), 0) == set()
    system, users = chat.plan(args, random.Random(3), vocab=1000)
    sent = []

    async def complete(prompt, out_len, abort_after=None):
        sent.append((list(prompt), abort_after))
        reply = [(sum(prompt) + i) % 997 for i in range(out_len)]
        return 0.01, 0.02, reply if abort_after is None else reply[:abort_after]

    turns, _ = asyncio.run(chat.run_backend(complete, args, system, users))
    assert sorted((x.conversation, x.turn) for x in turns if x.aborted) == [(1, 0), (2, 1)]
    assert all(x.output_tokens == (3 if x.aborted else 6) for x in turns)
    first = next(p for p, a in sent if a == 3 and p[-args.user_len:] == users[1][0])
    half = [(sum(first) + i) % 997 for i in range(3)]
    nxt = next(p for p, _ in sent if p[-args.user_len:] == users[1][1])
    assert nxt == first + half + users[1][1]              # the half reply stays in the history
    rows = chat.rows_of("elastic", turns, wall=1.0, hits=(1.0, 2.0))
    assert [(r["turn"], r["requests"], r["aborted"]) for r in rows] == [
        (0, 2, 1), (1, 2, 1), (2, 3, 0), (3, 3, 0), ("all", 10, 2)]
    assert rows[-1]["output_tok_s"] == 10 * 6 + 2 * 3       # aborted turns' tokens count


def test_a_turn_index_with_only_aborted_turns_has_no_means():
    ts = [chat.Turn(0, 0, 100, 0.1, 0.3, 3, aborted=True), chat.Turn(0, 1, 200, 0.2, 0.7, 6)]
    rows = chat.rows_of("stock", ts, wall=1.0, hits=(0.0, 0.0))
    assert rows[0]["requests"] == 0 and rows[0]["aborted"] == 1 and rows[0]["ttft_mean_s"] is None
    assert rows[-1]["ttft_mean_s"] == 0.2 and rows[-1]["prompt_tokens_mean"] == 200


def test_conversations_auto_from_stocks_startup_log(tmp_path):
    args = _args(auto_factor=3.0)
    mml = chat.max_context(args) + 16
    log = tmp_path / "server-stock.log"
    log.write_text(f"INFO Maximum concurrency for {mml:,} tokens per request: 15.37x\n")
    assert chat.conversations_at_capacity(args, str(log)) == 45
    log.write_text("INFO nothing\n")
    with pytest.raises(RuntimeError, match="Maximum concurrency"):
        chat.conversations_at_capacity(args, str(log))


def test_auto_needs_stock_first():
    with pytest.raises(SystemExit):
        chat.main(["--model", "M", "--backends", "elastic", "--conversations", "auto"])


@pytest.mark.vllm
def test_page_table_gauges_start_unreported_then_follow_the_scheduler():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from vllm_hisparse.core.host_pages import HostPageTable
    from vllm_hisparse.vllm import metrics as m

    t = HostPageTable(8)
    pages = t.acquire([], 3)
    t.publish("h0", pages[0])
    t.publish("h1", pages[1])
    t.release(pages)                            # idle: the two published pages stay, cache-only
    assert m.table_gauges(t) == {"host_pages_in_use": 2, "host_pages_cached": 2}
    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Counter, Gauge, Histogram)}
    p = m.HiSparsePromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                              ["model_name", "engine"], {0: ["m", "0"]})
    lab = {"model_name": "m", "engine": "0"}

    def v(name):
        return reg.get_sample_value(name, lab)

    assert v("vllm:hisparse_host_page_table_pages_in_use") == -1
    assert v("vllm:hisparse_host_page_table_pages_cached") == -1
    p.observe({"sched": {"host_pages_reserved": 0, **m.table_gauges(t)}}, 0)
    assert v("vllm:hisparse_host_page_table_pages_in_use") == 2
    t.reset()
    p.observe({"sched": m.table_gauges(t)}, 0)
    assert v("vllm:hisparse_host_page_table_pages_cached") == 0
    assert m.HiSparseStats(data={"sched": m.table_gauges(t)}).reduce() == {
        "host_pages_in_use": 0, "host_pages_cached": 0}


@pytest.mark.parametrize("leak", [False, True])
def test_main_end_to_end_on_fakes(tmp_path, monkeypatch, capsys, leak):
    """main() with the server, client and /metrics faked: auto sizing from stock's log, the dev
    mode and step log in the servers' environment, the figures in chat.json; exit 0 when the reset
    empties the pages, 1 with the numbers when 2 pages stay."""
    import json

    envs, state = [], {"reset": False}

    class Proc:
        def __init__(self, cmd, stdout, stderr, env):
            envs.append(env)
            mml = chat.max_context(_args(turns=2, system_len=32, user_len=16, output_len=4)) + 16
            stdout.write(f"Maximum concurrency for {mml:,} tokens per request: 2.0x\n")

    completer = fake_completer([])

    def scrape(base):
        if state["reset"]:
            return prom.parse(metrics_text(2 if leak else 0, 0))
        return prom.parse(metrics_text(10, 10))

    def reset(base):
        state["reset"] = True
        return True

    async def no_sleep(s):
        return None
    for name, v in {"wait_healthy": lambda *a: None, "stop": lambda *a, **k: None,
                    "model_vocab": lambda m: 1000, "openai_completer": completer,
                    "plot": lambda rows, out: None}.items():
        monkeypatch.setattr(chat, name, v)
    monkeypatch.setattr(chat_leaks, "reset_prefix_cache", reset)
    monkeypatch.setattr(chat.subprocess, "Popen", Proc)
    monkeypatch.setattr(chat.prom, "scrape", scrape)
    monkeypatch.setattr(chat.asyncio, "sleep", no_sleep)
    argv = ["--model", "M", "--conversations", "auto", "--turns", "2", "--system-len", "32",
            "--user-len", "16", "--output-len", "4", "--abort-every", "3", "--settle-timeout", "0",
            "--out", str(tmp_path)]
    assert chat.main(argv) == (1 if leak else 0)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert (last == "elastic: host page leak: after the run 10 pages in use, 10 held by the prefix "
            "cache, 0 reserved, 0 held on the worker; after the reset 2 in use, 0 held") == leak
    rows = json.loads((tmp_path / "chat.json").read_text())
    total = [r for r in rows if r["backend"] == "elastic" and r["turn"] == "all"][0]
    assert total["requests"] + total["aborted"] == 6 * 2 and total["aborted"] == 4
    assert total["host_pages_in_use_after"] == 10 and total["host_pages_held_by_cache_after"] == 10
    assert total["host_pages_in_use_after_reset"] == (2 if leak else 0)
    assert "host_pages_in_use_after" not in rows[2]          # stock: no leak check
    assert all(e["VLLM_SERVER_DEV_MODE"] == "1" and e["HISPARSE_STEP_LOG"] for e in envs)


def test_a_failed_reset_keeps_the_runs_figures_and_fails_the_check(tmp_path, monkeypatch):
    sent = []
    completer = fake_completer(sent)

    def refused(base):
        raise RuntimeError("POST /reset_prefix_cache: HTTP 404; the server needs "
                           "VLLM_SERVER_DEV_MODE=1")

    async def no_sleep(s):
        return None
    monkeypatch.setattr(chat, "openai_completer", completer)
    monkeypatch.setattr(chat_leaks, "reset_prefix_cache", refused)
    monkeypatch.setattr(chat.prom, "scrape", lambda base: prom.parse(metrics_text(4, 4)))
    monkeypatch.setattr(chat.asyncio, "sleep", no_sleep)
    args = _args(conversations=2, turns=2, abort_every=0, port=1, model="M", leak_check=True,
                 settle_timeout=0.0)
    system, users = chat.plan(args, random.Random(0), vocab=1000)
    rows, verdict = asyncio.run(chat.measure(args, "elastic", system, users,
                                             str(tmp_path / "steps.jsonl")))
    assert rows[-1]["requests"] == 4 and rows[-1]["running_max"] is None    # no step records
    assert verdict.startswith("elastic: leak check failed: POST /reset_prefix_cache: HTTP 404")
    # the warm-up: a first-turn-long prompt sharing no block with the trace, then a hit on it
    w0, w1 = sent[:2]
    assert len(w0) == args.system_len + args.user_len and w0[:16] != system[:16]
    assert w1[:args.system_len] == w0[:args.system_len] and sent[2][:16] == system[:16]
