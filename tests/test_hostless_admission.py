"""Capacity = HBM + host (issue 45 item 1): a request the host pool cannot take runs *host-less*
(no host page, every block kept, never spilled) when vLLM's GPU blocks hold its whole life,
instead of waiting; one they cannot hold still waits. ``hostless`` "sparse" (the default) gives it
an indexer row (sparse as resident mode), so with the rows full it waits; "dense" (opt-in) runs it
without a row, also when the rows are full; "wait" never runs one. The scheduler-side connector
(vllm/connector_scheduler.py) on a real vLLM BlockPool, with the KV manager (vllm/spec.py) on the
same pool, no engine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.deployment import EngineLimits, resolve
from vllm_hisparse.core.residency import hostless_fits

PAGE, S, MML, SEQS, BATCHED = 16, 4, 1024, 4, 64
# one page of one layer: K+V x 16 tokens x 2 heads x 32 x fp32 = 8 KiB; x 4 layers = 32 KiB:
# 2.5 MiB of host pool = 80 pages
HOST_GIB = 80 * 32768 / (1 << 30)
BLOCKS = 101                        # 100 usable; R = cdiv(64, 16) + 4 = 8, floor S + 1 = 5


def test_hostless_fits_arithmetic():
    # promised + host-backed x floor + R + need <= usable blocks
    assert hostless_fits(100, 8, 0, 3, 5, 77)              # 0 + 15 + 8 + 77 = 100
    assert not hostless_fits(100, 8, 0, 3, 5, 78)          # one block more: waits
    assert not hostless_fits(100, 8, 60, 0, 5, 33)         # promised to host-less before: 101
    assert hostless_fits(100, 0, 0, 0, 5, 100)


def req(rid, prompt, max_tokens):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, max_tokens=max_tokens,
                           num_tokens=prompt)


def make(quest_rows, hostless="sparse"):
    """The connector and the KV manager on one BlockPool of BLOCKS blocks, resident_first on;
    ``hostless``: the config's ("sparse" is the default)."""
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool

    from vllm_hisparse.vllm.connector_scheduler import ConnectorScheduler
    from vllm_hisparse.vllm.spec import HiSparseManager, HiSparseSpec

    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=PAGE, min_context=64,
                         dense_layers=(0,), host_pool_gib=HOST_GIB, quest_rows=quest_rows,
                         hostless=hostless)
    dep = resolve(cfg, EngineLimits(4, MML, SEQS, 2, 32, 4))
    assert dep.admit_pages == 80 and dep.indexer_rows == quest_rows and dep.num_slots == S
    sc = SimpleNamespace(max_num_batched_tokens=BATCHED, max_num_seqs=SEQS, watermark=0.0,
                         scheduler_reserve_full_isl=True)
    conn = ConnectorScheduler(SimpleNamespace(scheduler_config=sc), dep)
    pool = BlockPool(BLOCKS, enable_caching=False, hash_block_size=PAGE)
    spec = HiSparseSpec(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32,
                        deployment=dep)
    mgr = HiSparseManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                          scheduler_block_size=PAGE)
    conn.bind_gpu_block_pool(pool)
    assert conn.spill_reserve() == 8
    return conn, mgr, pool


def admitted(conn, r) -> bool:
    n, async_ = conn.get_num_new_matched_tokens(r, 0)
    assert not async_
    return n is not None


def sched_out(new=(), resumed=()):
    """A SchedulerOutput's parts build_connector_meta reads: new requests (id, first block) and
    resumed ones."""
    news = [SimpleNamespace(req_id=r, block_ids=([b],), prompt_token_ids=None) for r, b in new]
    return SimpleNamespace(scheduled_new_reqs=news, scheduled_cached_reqs=SimpleNamespace(
        req_ids=[r for r, _ in resumed], resumed_req_ids={r for r, _ in resumed},
        new_block_ids=[([b],) for _, b in resumed]))


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_full_host_pool_admits_hostless_while_the_gpu_holds_them_whole(mode):
    conn, mgr, pool = make(quest_rows=6 if mode == "sparse" else SEQS, hostless=mode)
    for rid in "abc":                               # 25 pages each: 75 of 80 reserved
        assert admitted(conn, req(rid, 300, 100))
    assert conn._hostless == {} and conn._reserved_total == 75
    # the host pool is full: d (25 blocks) runs host-less: 0 + 3 x 5 + 8 + 25 <= 100 (the
    # host-backed floors: a, b, c; a host-less request's row does not count as one)
    assert admitted(conn, req("d", 300, 100)) and conn._hostless == {"d": 25}
    # e (50 blocks): 25 + 15 + 8 + 50 = 98 <= 100
    assert admitted(conn, req("e", 600, 200)) and conn._hostless == {"d": 25, "e": 50}
    # "sparse": each took an indexer row; "dense": none
    assert conn._rows_held == ({"a", "b", "c", "d", "e"} if mode == "sparse" else {"a", "b", "c"})
    # negative: f (25 blocks) does not fit beside them (123 > 100): it waits, for the host pool
    assert not admitted(conn, req("f", 300, 100))
    assert conn._waiting == {"f": "host_pool"} and "f" not in conn._hostless
    st = conn.stats().data["sched"]
    assert st["requests_hostless"] == 2 and st["waiting_host_pool"] == 1
    assert st["host_pages_reserved"] == 75                    # host-less reserve no host page
    # the worker learns which new requests run host-less
    md = conn.build_connector_meta(sched_out(new=[("a", 1), ("d", 30), ("e", 60)]))
    assert md.hostless == ["d", "e"] and set(md.new) == {"a", "d", "e"}
    # the KV manager never frees or spills a host-less request's blocks, even under pressure
    mgr.allocate_new_blocks("a", 321, 321)
    mgr.remove_skipped_blocks("a", 320, 320)                  # resident, surplus 16
    mgr.allocate_new_blocks("d", 501, 501)                    # 32 blocks: 47 free
    mgr.remove_skipped_blocks("d", 500, 300)
    mgr.allocate_new_blocks("e", 16 * 40, 16 * 40)           # 40 more: 7 free < R = 8
    mgr.remove_skipped_blocks("e", 16 * 40, 600)
    assert conn._ledger.take() == {"a": 15}                   # a spilled by the 1 missing
    assert "d" not in mgr._seen and "e" not in mgr._seen
    assert mgr.surplus("a") == 15 and len(mgr.req_to_blocks["d"]) == 32
    conn._ledger.make_room(100)                               # everything spillable: a only
    assert conn._ledger.take() == {"a": 0}
    assert sum(b is not mgr._null_block for b in mgr.req_to_blocks["d"]) == 32
    # finishing a host-less request leaves nothing behind; then f fits. "dense": its blocks
    # go at once and the worker drops it unreported; "sparse": it holds an indexer row, so they
    # go once the worker reports it dropped (delayed free, as a host-backed request)
    if mode == "dense":
        assert conn.request_finished(req("d", 300, 100), ()) == (False, None)
        assert conn.build_connector_meta(sched_out()).freed == ["d"]
    else:
        assert conn.request_finished(req("d", 300, 100), ()) == (True, None)
        assert conn.build_connector_meta(sched_out()).finished == ["d"]
        assert "d" in conn._rows_held                         # until the worker reports it
        conn.update_connector_output(SimpleNamespace(finished_sending={"d"}))
    assert conn._hostless == {"e": 50} and conn._shared.hostless == {"e"}
    assert "d" not in conn._rows_held
    assert admitted(conn, req("f", 300, 100)) and "f" in conn._hostless


def test_wait_makes_a_request_the_host_tier_cannot_take_wait():
    """hostless "wait": the GPU could hold d whole, but it waits for the host pool (and e for a
    row); nothing runs host-less. An unknown value is refused in one line naming the field."""
    conn, mgr, pool = make(quest_rows=SEQS, hostless="wait")
    for rid in "abc":
        assert admitted(conn, req(rid, 300, 100))
    assert not admitted(conn, req("d", 300, 100))
    assert conn._waiting == {"d": "host_pool"} and conn._hostless == {}
    assert conn.stats().data["sched"]["requests_hostless"] == 0
    conn2, _, _ = make(quest_rows=3, hostless="wait")
    for rid in "abc":
        assert admitted(conn2, req(rid, 100, 50))
    assert not admitted(conn2, req("e", 100, 50)) and conn2._hostless == {}
    with pytest.raises(ValueError, match=r"^hisparse config: hostless='exact' is invalid: choose "
                                         r"one of sparse, wait, dense$"):
        HiSparseConfig(hostless="exact")
    assert HiSparseConfig().hostless == "sparse"


def test_full_indexer_rows_make_a_sparse_hostless_request_wait():
    """"sparse" needs a row: with the rows full the request waits, though the GPU holds it."""
    conn, mgr, pool = make(quest_rows=3)
    for rid in "abc":
        assert admitted(conn, req(rid, 100, 50))
    assert not admitted(conn, req("d", 100, 50))
    assert conn._waiting == {"d": "quest_rows"} and conn._hostless == {}
    assert conn.request_finished(req("a", 100, 50), ()) == (False, None)   # never sent
    assert admitted(conn, req("d", 100, 50)) and conn._waiting == {} and "d" in conn._rows_held


def test_dense_full_indexer_rows_admit_hostless_and_a_preempted_one_resumes_hostless():
    conn, mgr, pool = make(quest_rows=3, hostless="dense")
    for rid in "abc":                               # 3 rows: every one held (10 pages each)
        assert admitted(conn, req(rid, 100, 50))
    assert admitted(conn, req("d", 100, 50)) and conn._hostless == {"d": 10}
    assert conn._waiting == {}
    conn.build_connector_meta(sched_out(new=[("d", 5)]))
    # preempted (vLLM frees its blocks), asked again when it resumes: still host-less, no row
    assert admitted(conn, req("d", 100, 50)) and conn._rows_held == {"a", "b", "c"}
    md = conn.build_connector_meta(sched_out(resumed=[("d", 7)]))
    assert md.new == {"d": (100, 7)} and md.hostless == ["d"]
    # aborted while waiting to resume: nothing left
    conn.request_finished(req("d", 100, 50), ())
    assert conn._hostless == {} and conn._shared.hostless == set()
    assert conn.stats().data["sched"]["requests_hostless"] == 0


def test_a_short_request_never_runs_hostless():
    """A request that never could be sparse needs no host page: admitted as today."""
    conn, mgr, pool = make(quest_rows=SEQS)
    for rid in "abc":
        assert admitted(conn, req(rid, 300, 100))
    assert admitted(conn, req("s", 20, 20)) and "s" not in conn._hostless
    assert conn._reserved["s"] == 0
