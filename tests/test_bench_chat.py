"""bench/chat.py, the multi-turn benchmark, driven by a fake completer (no server): every turn
re-sends the conversation's history exactly (system + earlier user messages + the replies the model
wrote), conversations share the system prompt and nothing else, and the rows count what ran."""
from __future__ import annotations

import argparse
import asyncio
import random

from vllm_hisparse.bench import chat


def _args(**kw):
    d = dict(conversations=3, turns=4, system_len=40, user_len=25, output_len=6, concurrency=0,
             text_ids=None)
    d.update(kw)
    return argparse.Namespace(**d)


def test_each_turn_resends_the_history_with_the_replies_written():
    args = _args()
    rng = random.Random(7)
    system, users = chat.plan(args, rng, vocab=1000)
    sent = []

    async def complete(prompt, out_len):      # a reply that depends on the prompt: a history
        sent.append(list(prompt))             # rebuilt wrongly would show in the next prompt
        reply = [(sum(prompt) + i) % 997 for i in range(out_len)]
        return 0.01, 0.02, reply

    turns, wall = asyncio.run(chat.run_backend(complete, args, system, users))
    assert len(turns) == args.conversations * args.turns and len(sent) == len(turns)
    for c in range(args.conversations):
        mine = [p for p in sent if p[len(system):len(system) + args.user_len] == users[c][0]]
        assert len(mine) == args.turns
        mine.sort(key=len)
        for t, prompt in enumerate(mine):
            assert prompt[:len(system)] == system
            assert prompt[-args.user_len:] == users[c][t]
            if t:
                prev = mine[t - 1]
                reply = [(sum(prev) + i) % 997 for i in range(args.output_len)]
                assert prompt == prev + reply + users[c][t]
        assert len(mine[-1]) == chat.max_context(args) - args.output_len
    firsts = {tuple(users[c][0]) for c in range(args.conversations)}
    assert len(firsts) == args.conversations            # no two conversations share a message


def test_rows_per_turn_and_the_run():
    ts = [chat.Turn(c, t, 100 * (t + 1), 0.1 * (t + 1), 0.1 * (t + 1) + 0.5, 11)
          for c in range(2) for t in range(3)]
    rows = chat.rows_of("stock", ts, wall=2.0, hits=(300.0, 400.0))
    assert [r["turn"] for r in rows] == [0, 1, 2, "all"]
    assert rows[1]["requests"] == 2 and rows[1]["prompt_tokens_mean"] == 200
    assert rows[2]["ttft_mean_s"] == 0.3
    assert rows[0]["tpot_mean_ms"] == 50.0                 # 0.5 s over 10 tokens after the first
    assert rows[-1]["output_tok_s"] == 33.0 and rows[-1]["prefix_hit_rate"] == 0.75


def test_prefix_hits_read_from_two_scrapes():
    before = {"vllm:prefix_cache_hits_total": 10.0, "vllm:prefix_cache_queries_total": 50.0}
    after = {"vllm:prefix_cache_hits_total": 70.0, "vllm:prefix_cache_queries_total": 150.0}
    assert chat.prefix_hits(before, after) == (60.0, 100.0)
    assert chat.prefix_hits({}, {}) == (0.0, 0.0)


def test_real_text_too_short_is_refused_in_one_line(tmp_path):
    import json

    import pytest
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(list(range(100))))
    with pytest.raises(SystemExit, match="the trace needs 340"):
        chat.plan(_args(text_ids=str(f)), random.Random(0), vocab=1000)


def test_chat_serves_with_prefix_caching_the_serving_benchmark_without():
    from vllm_hisparse.bench import serving
    a = argparse.Namespace(model="M", port=1234, gpu_memory_utilization=0.5, load_format="dummy",
                           hisparse='{"top_k": 8}', extra_server_args=["--seed", "1"],
                           system_len=10, user_len=20, output_len=5, turns=2)
    c = chat.server_cmd(a, "elastic")
    assert "--no-enable-prefix-caching" not in c and c[-2:] == ["--seed", "1"]
    assert c[c.index("--max-model-len") + 1] == str(chat.max_context(a) + 16)
    assert '"resident_first": true' in c[c.index("--additional-config") + 1]
    s = serving.serve_cmd(a, "stock", 1234, 100, max_seqs=7)
    assert "--no-enable-prefix-caching" in s and "--attention-backend" not in s
    assert s[s.index("--max-num-seqs") + 1] == "7"
