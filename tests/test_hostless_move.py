"""A host-less request (issue 45 item 1; core/hostless.py) on the runtime alone, driven as the
adapter drives it (tests/test_sparse_runtime_exact.py's Driver: blocks the scheduler frees are
poisoned with NaN, so reading one would fail):

* ``hostless`` "sparse" (the default): admitted without host pages, sparse by the length rule
  exactly as resident mode (a long prompt from its first token, a short one at min_context, in
  the same step as a host-backed request switching beside it), its host page-table row -1; it
  then moves into the host tier (``host_back``: its KV so far copied to new host pages, which the
  test checks byte for byte), is spilled and reads the pages it gave back from the host. Its
  outputs equal resident mode's bit for bit, every layer, every step, with misses > 0; skipping
  the move's copy (the negative control) makes them differ.
* "dense" (opt-in): dense until it moves, then sparse from that step on: equal to resident mode
  for a request whose context reaches min_context at that same step.

The scheduler side: the connector moves a decoding host-less request once the host pool (and,
"dense", the rows) have room, and the KV manager then spills it like any host-backed request."""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import HKV, D, L, P, Driver
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.hostless import host_back

PROMPT, MOVE_AT, SPILL_AT, END = 60, 100, 130, 200       # contexts (tokens)


def _run(host_tier: bool, full: bool, min_context: int, hostless: bool):
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=min_context, host_pool_gib=0.01, host_tier=host_tier,
                         resident_first=True, hostless="dense")
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
            _check_host_copy(d, "x", MOVE_AT)
    st = d.rt.stats_dict()
    assert d.rt.finish("x") and d.rt.host_pages_used == 0
    return d.outs, st


def _check_host_copy(d, rid: str, n: int) -> None:
    """Every byte of the request's first n tokens' KV (whole pages) is in its host pages."""
    blocks = d.blocks[rid][:n // P].long()
    for layer in range(L):
        host = d.rt.host_layer(layer)
        if host is not None:
            got = host[torch.tensor(d.rt.pool.page_table(rid)[:n // P])]
            assert torch.equal(got, d.kv[layer][blocks]), (rid, layer)


@pytest.mark.parametrize("full", [False, True])
def test_dense_hostless_moved_equals_resident_mode_switching_at_the_move(full):
    outs, st = _run(True, full, min_context=40, hostless=True)
    ref, _ = _run(False, full, min_context=MOVE_AT + 1, hostless=False)
    assert len(outs) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    assert st["turned_sparse"] == 1 and st["misses"] > 0       # it read the host after its spill


# "sparse": x (long prompt) and y (short, switching at MIN_CTX) host-less, z host-backed switching
# beside y; x and y move at MOVE, all three are spilled at SPILL
MIN_CTX, PROMPTS, MOVE, SPILL, STEPS = 64, {"x": 100, "y": 40, "z": 40}, 40, 60, 120


def _sparse_run(host_tier: bool, full: bool, dense_pool_gib: float, skip_copy: bool = False):
    """Returns (outputs, stats); checks on the way what each request holds."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=MIN_CTX, host_pool_gib=0.01, host_tier=host_tier,
                         resident_first=True, dense_pool_gib=dense_pool_gib)
    assert cfg.hostless == "sparse"                               # the default
    d = Driver(cfg, rows=4, full=full)
    rt, add = d.rt, d.rt.add
    for rid, n in PROMPTS.items():
        d.rt.add = lambda r, k: add(r, k, hostless=host_tier and rid != "z")
        d.add(rid, n)
    d.rt.add = add
    d.step(dict(PROMPTS))
    for i in range(STEPS):
        if host_tier and i < MOVE:          # host-less: sparse as resident mode, no host page
            assert rt.reqs["x"].sparse and rt.reqs["y"].sparse == (d.lens["y"] >= MIN_CTX)
            for rid in "xy":
                assert rt.pool.page_table(rid) == [] and not (rt.host_pt.table[rt.reqs[rid].row]
                                                              >= 0).any()
                if rt.dpool is not None:
                    assert rt.dpool.page_table(rid) == []
        if host_tier and i == MOVE:
            at_move = len(d.outs)
            for rid in "xy":
                host_back(rt, rid)
                if skip_copy:                 # the negative control: no bulk copy
                    assert rt.reqs[rid].moving        # (a copy to skip: it is sparse already)
                    rt.reqs[rid].moving = False
        if i == SPILL:
            for rid in "xyz":
                d.spill(rid, 0)
        d.step({rid: 1 for rid in PROMPTS})
        if host_tier and i == MOVE:
            for rid in "xy":
                if skip_copy:               # what the copy would have filled: noise, not what
                    _poison_host_pages(rt, rid, d.lens[rid] - 1)  # a freed pool's memory held
                else:
                    _check_host_copy(d, rid, d.lens[rid] - 1)
    st = rt.stats_dict()
    st["outs_at_move"] = at_move if host_tier else None
    for rid in PROMPTS:
        assert rt.finish(rid)
    assert rt.host_pages_used == 0 and len(rt.ix._free) == rt.ix.rows
    return d.outs, st


def _poison_host_pages(rt, rid: str, n: int) -> None:
    """The host pages wholly below token n (those the skipped copy alone would have filled) set
    to noise: the pool is allocated uninitialized, and memory an earlier identical run in the same
    process freed can come back holding exactly the copy's bytes (the control then passed by
    chance: CI, 2026-12-07)."""
    pages = torch.tensor(rt.pool.page_table(rid)[:n // P], dtype=torch.long)
    assert len(pages), (rid, n)
    g = torch.Generator().manual_seed(11)
    for layer in range(L):
        host = rt.host_layer(layer)
        if host is not None and len(pages):
            host[pages] = torch.randn(host[pages].shape, generator=g).to(host.dtype)


@pytest.mark.parametrize("full,dense_pool_gib", [(False, 0.0), (True, 0.0), (True, 0.01)])
def test_sparse_hostless_moved_and_spilled_equals_resident_mode(full, dense_pool_gib):
    outs, st = _sparse_run(True, full, dense_pool_gib)
    ref, _ = _sparse_run(False, full, dense_pool_gib)
    assert len(outs) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    # y and z turned sparse at min_context (y host-less), x from its prompt; they read the host
    assert st["turned_sparse"] == 2 and st["misses"] > 0


@pytest.mark.parametrize("full,dense_pool_gib", [(False, 0.0), (True, 0.0), (True, 0.01)])
def test_sparse_hostless_without_the_moves_copy_differs(full, dense_pool_gib):
    """The negative control, in each config of the exactness test: the same run with the move's
    bulk copy skipped equals resident mode before the move and mismatches after it."""
    outs, st = _sparse_run(True, full, dense_pool_gib, skip_copy=True)
    ref, _ = _sparse_run(False, full, dense_pool_gib)
    assert st["misses"] > 0 and len(outs) == len(ref)
    same = [torch.equal(a, b) for a, b in zip(outs, ref)]
    assert all(same[:st["outs_at_move"]]) and not all(same), same


@pytest.mark.parametrize("when", ["hostless", "moving", "moved"])
def test_a_hostless_request_finished_in_each_state_leaves_nothing(when):
    """Finished (aborted) while host-less, between its move's metadata (host_back) and its next
    step, or after that step: no host page, runtime row or indexer row is left."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=MIN_CTX, host_pool_gib=0.01, resident_first=True,
                         dense_pool_gib=0.01)
    d = Driver(cfg, rows=4)
    rt, add = d.rt, d.rt.add
    d.rt.add = lambda r, k: add(r, k, hostless=True)
    d.add("x", 100)
    d.rt.add = add
    rows, ix_free = len(rt._free_rows), len(rt.ix._free)
    d.step({"x": 100})
    d.step({"x": 1})
    if when != "hostless":
        host_back(rt, "x")
    if when == "moved":
        d.step({"x": 1})
        assert rt.pool.page_table("x") and rt.dpool.page_table("x")
    assert rt.finish("x")
    assert rt.host_pages_used == 0 and rt.dpool.used_pages == 0
    assert len(rt._free_rows) == rows + 1 and len(rt.ix._free) == ix_free + 1
    assert not (rt.host_pt.table >= 0).any() and not (rt.dense_pt.table >= 0).any()


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
