"""resident_first on the scheduler side (vllm/spec.py HiSparseManager, issue 15 item 1-2): a sparse
request keeps its blocks while the pool's free blocks stay at or above the reserve R; below it the
manager takes just the missing blocks, from the request with the most surplus first, its oldest
pages first (a window of its newest pages stays, down to the hot-buffer floor), one way, and
records each request's new keep for the connector. Driven on a real vLLM BlockPool."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.deployment import EngineLimits, resolve

pytestmark = pytest.mark.vllm
PAGE, S = 16, 4                                  # device_buffer_size 64: 4 hot slots


def manager(num_blocks, reserve, **over):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_hisparse.vllm.spec import HiSparseManager, HiSparseSpec
    from vllm_hisparse.vllm.spill_ledger import ledger_of

    cfg = HiSparseConfig(**dict(dict(top_k=48, device_buffer_size=64, page_size=PAGE,
                                     min_context=64, resident_first=True), **over))
    spec = HiSparseSpec(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32,
                        deployment=resolve(cfg, EngineLimits(4, 1024, 16, 2, 32, 4)))
    pool = BlockPool(num_blocks, enable_caching=False, hash_block_size=PAGE)
    m = HiSparseManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                        scheduler_block_size=PAGE)
    ledger_of(pool).reserve = reserve
    return m, pool, ledger_of(pool)


def prefill(m, rid, tokens):
    m.allocate_new_blocks(rid, tokens + 1, tokens + 1)
    m.remove_skipped_blocks(rid, tokens, tokens)       # prompt processed: resident or floor


def held(m, rid):
    return sum(b is not m._null_block for b in m.req_to_blocks[rid])


def real(m, rid):
    """Logical pages of the request that still have a block (the rest is vLLM's null block)."""
    return [i for i, b in enumerate(m.req_to_blocks[rid]) if b is not m._null_block]


def test_resident_while_above_reserve_then_partial_spill_of_the_oldest_pages():
    m, pool, led = manager(101, reserve=40)           # 100 usable blocks
    prefill(m, "a", 320)                              # 21 blocks, surplus 16
    prefill(m, "b", 480)                              # 31 blocks, surplus 26: 48 free
    assert (held(m, "a"), held(m, "b"), led.take()) == (21, 31, {})
    m.allocate_new_blocks("c", 200, 200)              # 13 more: 35 free < 40
    m.remove_skipped_blocks("a", 321, 320)
    # the most surplus gives back just the 5 missing blocks: its oldest pages beyond the floor
    assert led.take() == {"b": 21}
    assert real(m, "b") == list(range(S)) + list(range(S + 5, 31))
    assert held(m, "a") == 21 and pool.get_num_free_blocks() == 40
    # the window slides with the request: a new complete page pushes its oldest one out
    m.allocate_new_blocks("b", 497, 497)              # page 31 (block 32 of b)
    m.remove_skipped_blocks("b", 496, 480)            # 31 complete pages, keep 21: [10, 31)
    assert real(m, "b") == list(range(S)) + list(range(10, 32)) and led.take() == {}
    assert held(m, "b") == S + 21 + 1                 # never more than at its spill
    # more pressure: b (21 kept) still has the most surplus, then a (16): levels them down
    m.allocate_new_blocks("c", 280, 280)              # 5 more: 35 free
    m.remove_skipped_blocks("c", 100, 280)            # c in prefill: never spilled
    assert led.take() == {"b": 16} and pool.get_num_free_blocks() == 40
    m.allocate_new_blocks("d", 16 * 9, 16 * 9)        # 9 more: 31 free, b and a both at 16
    m.remove_skipped_blocks("d", 0, 16 * 9)
    assert led.take() == {"a": 7} and real(m, "a") == list(range(S)) + list(range(13, 21))
    # finishing frees everything, no state left behind
    for rid in ("a", "b", "c", "d"):
        m.free(rid)
    assert pool.get_num_free_blocks() == 100 and not m._seen and not m._keep


def test_a_big_shortfall_takes_whole_requests_down_to_the_floor():
    m, pool, led = manager(101, reserve=60)
    prefill(m, "a", 320)                              # surplus 16
    prefill(m, "b", 480)                              # surplus 26: 48 free < 60
    assert led.take() == {"b": 14} and pool.get_num_free_blocks() == 60
    m.allocate_new_blocks("c", 16 * 30, 16 * 30)      # 30 free: 30 short
    m.remove_skipped_blocks("a", 320, 320)
    # b (14) and a (16): a first (most surplus) to its floor, then b by the 14 still missing
    assert led.take() == {"a": 0, "b": 0} and held(m, "a") == held(m, "b") == S + 1
    assert pool.get_num_free_blocks() == 60


def test_no_reserve_bound_spills_at_once_and_off_never_keeps():
    m, pool, led = manager(101, reserve=None)        # no connector bound: today's behaviour
    prefill(m, "a", 320)
    assert led.take() == {"a": 0} and held(m, "a") == S + 1
    off, _, led_off = manager(101, reserve=40, resident_first=False)
    prefill(off, "a", 320)
    assert held(off, "a") == S + 1 and led_off.take() == {}


def test_prefill_and_short_requests_are_never_spilled():
    m, pool, led = manager(60, reserve=1000)         # always under pressure
    m.allocate_new_blocks("a", 320, 320)
    m.remove_skipped_blocks("a", 256, 320)            # prompt not processed yet: keeps every block
    m.allocate_new_blocks("d", 50, 50)
    m.remove_skipped_blocks("d", 49, 49)              # below min_context: dense, nothing to free
    assert led.take() == {} and held(m, "a") == 20 and held(m, "d") == 4


def test_one_sparse_group_per_pool():
    """The worker keeps one residency state per request: a second hisparse KV group on the same
    pool (whose spills could differ) is refused."""
    from vllm_hisparse.vllm.spec import HiSparseManager

    m, pool, _ = manager(40, reserve=10)
    with pytest.raises(ValueError, match="resident_first=true needs all hisparse layers in one"):
        HiSparseManager(m.kv_cache_spec, block_pool=pool, enable_caching=False,
                        kv_cache_group_id=1, scheduler_block_size=PAGE)


def connector_view(ledger, max_model_len=512, batched=64, seqs=4, watermark=0.0, full_isl=True):
    """The scheduler-side connector's pieces that size R and a waiting request's room (no engine):
    what ConnectorScheduler.bind_gpu_block_pool sets up, on a SimpleNamespace."""
    from types import SimpleNamespace

    sc = SimpleNamespace(max_num_batched_tokens=batched, max_num_seqs=seqs, watermark=watermark,
                         scheduler_reserve_full_isl=full_isl)
    cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=PAGE, min_context=64,
                         resident_first=True)
    from vllm_hisparse.vllm.connector_scheduler import ConnectorScheduler

    me = SimpleNamespace(cfg=cfg, max_model_len=max_model_len, _ledger=ledger,
                         _vllm_config=SimpleNamespace(scheduler_config=sc),
                         _watermark_blocks=int(watermark * 101))
    me.admission_blocks = lambda request, hit_tokens=0: ConnectorScheduler.admission_blocks(
        me, request, hit_tokens)
    return me


def test_room_for_the_waiting_requests_own_prompt():
    """Item 2: R covers one step's allocations of running requests only (not a max_model_len
    prompt); a waiting request gets its own blocks (whole sequence + watermark + 1) freed when
    the connector admits it, before vLLM's full-sequence check, by spilling just enough."""
    from types import SimpleNamespace

    from vllm_hisparse.vllm.connector_scheduler import ConnectorScheduler as C

    m, pool, led = manager(101, reserve=None)
    me = connector_view(led, watermark=0.02)           # 2 watermark blocks
    led.reserve = C.spill_reserve(me)
    assert led.reserve == 64 // PAGE + 4 + 2 == 10     # was cdiv(512, 16) + 10 = 42
    prefill(m, "a", 480)                               # 31 blocks, surplus 26
    prefill(m, "b", 480)                               # 31 more
    prefill(m, "c", 160)                               # 11 more: 27 free >= R, all resident
    assert led.take() == {} and pool.get_num_free_blocks() == 27
    waiting = SimpleNamespace(num_tokens=700)          # clamped to max_model_len: 32 blocks
    need = C.admission_blocks(me, waiting)
    assert need == 32 + 2 + 1
    C._make_room(me, waiting)
    # 8 blocks from the most surplus (a and b: 26; ties by id), its oldest pages
    assert pool.get_num_free_blocks() == need and led.take() == {"a": 18}
    assert real(m, "a") == list(range(S)) + list(range(S + 8, 31))
    C._make_room(me, SimpleNamespace(num_tokens=200))  # already room: nothing more
    assert led.take() == {}
    # chunked admission without the full-sequence check: its first chunk only
    assert C.admission_blocks(connector_view(led, full_isl=False), waiting) == 64 // PAGE + 1
    # a preempted request (prompt + outputs) asks for all its tokens
    assert C.admission_blocks(me, SimpleNamespace(num_tokens=330)) == 21 + 2 + 1
