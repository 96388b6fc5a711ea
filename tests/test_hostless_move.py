"""A host-less request moving into the host tier (issue 45 item 1, phase 2; core/turn_sparse.py
``host_back``): admitted without host pages (dense, resident), it gets host pages and a row
mid-decode, turns sparse at its next step (its KV so far copied to the host pool and its Quest
row), is spilled later (its given-back blocks poisoned with NaN, as
tests/test_sparse_runtime_exact.py does) and reads them from the host. Its outputs equal resident
mode's for a request whose context reaches min_context at that same step, bit for bit; the
runtime driven as the adapter drives it. The scheduler side: the connector moves a decoding
host-less request once the host pool and the rows have room, and the KV manager then spills it
like any host-backed request."""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import HKV, D, L, P, Driver
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.turn_sparse import host_back

PROMPT, MOVE_AT, SPILL_AT, END = 60, 100, 130, 200       # contexts (tokens)


def _run(host_tier: bool, full: bool, min_context: int, hostless: bool):
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=min_context, host_pool_gib=0.01, host_tier=host_tier,
                         resident_first=True)
    d = Driver(cfg, full=full)
    add = d.rt.add
    d.rt.add = lambda rid, n: add(rid, n, hostless=hostless)
    d.add("x", PROMPT)
    d.rt.add = add
    d.step({"x": PROMPT})
    r = d.rt.reqs["x"]
    while d.lens["x"] < END:
        seq = d.lens["x"]
        if hostless and seq == MOVE_AT:
            assert not r.sparse and r.irow < 0 and d.rt.pool.page_table("x") == []
            host_back(d.rt, "x")
        if seq == SPILL_AT:
            d.spill("x", 0)                # its blocks beyond the floor given back (NaN)
        d.step({"x": 1})
        # sparse from the step whose context passes MOVE_AT (the reference's min_context)
        assert r.sparse == (d.lens["x"] > MOVE_AT), d.lens["x"]
        if hostless and host_tier and d.lens["x"] == MOVE_AT + 1:
            blocks = d.blocks["x"][:MOVE_AT // P].long()
            for layer in range(L):         # every byte of its KV so far, in its host pages
                if d.rt.host_layer(layer) is None:
                    continue
                got = d.rt.host_layer(layer)[torch.tensor(d.rt.pool.page_table("x")[:MOVE_AT // P])]
                assert torch.equal(got, d.kv[layer][blocks]), layer
    st = d.rt.stats_dict()
    assert d.rt.finish("x") and d.rt.host_pages_used == 0
    return d.outs, st


@pytest.mark.parametrize("full", [False, True])
def test_moved_request_equals_resident_mode_switching_at_the_move(full):
    outs, st = _run(True, full, min_context=40, hostless=True)
    ref, _ = _run(False, full, min_context=MOVE_AT + 1, hostless=False)
    assert len(outs) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    assert st["turned_sparse"] == 1 and st["misses"] > 0       # it read the host after its spill


def cached(*reqs):
    """scheduler_output with only cached (running) requests: (id, computed tokens, resumed)."""
    from types import SimpleNamespace

    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=[r for r, _, _ in reqs], resumed_req_ids={r for r, _, res in reqs if res},
        new_block_ids=[([90],) if res else None for _, _, res in reqs],
        num_computed_tokens=[n for _, n, _ in reqs]))


def test_the_scheduler_moves_a_decoding_hostless_request_when_host_room_frees():
    from types import SimpleNamespace

    from test_hostless_admission import admitted, make, req

    conn, mgr, pool = make(quest_rows=4)
    for rid in "abc":                                   # 75 of 80 pages
        assert admitted(conn, req(rid, 300, 100))
    assert admitted(conn, req("d", 300, 100)) and conn._hostless == {"d": 25}
    conn._sent.update("abcd")                          # the worker knows them
    assert conn.build_connector_meta(cached(("d", 310, False))).hosted == []   # no room yet
    assert conn.request_finished(req("a", 300, 100), ()) == (True, None)
    conn.update_connector_output(SimpleNamespace(finished_sending={"a"}))      # 50 reserved
    # no move while still in prefill, resumed this step, or while a request waits for host room
    assert conn.build_connector_meta(cached(("d", 256, False))).hosted == []
    assert conn.build_connector_meta(cached(("d", 0, True))).hosted == []
    conn._waiting["w"] = "host_pool"
    assert conn.build_connector_meta(cached(("d", 310, False))).hosted == []
    del conn._waiting["w"]
    md = conn.build_connector_meta(cached(("d", 310, False)))
    assert md.hosted == ["d"] and conn._hostless == {} and conn._shared.hostless == set()
    assert conn._reserved["d"] == 25 and conn._reserved_total == 75 and "d" in conn._rows_held
    st = conn.stats().data["sched"]
    assert st["requests_hostless"] == 0 and st["requests_moved_to_host"] == 1
    # from the next KV-manager call on, an ordinary host-backed request: spilled under pressure
    mgr.allocate_new_blocks("d", 311, 311)
    mgr.remove_skipped_blocks("d", 310, 300)
    assert "d" in mgr._seen
    conn._ledger.make_room(100)
    assert conn._ledger.take() == {"d": 0}
    assert conn.request_finished(req("d", 300, 100), ()) == (True, None)   # delayed free now
