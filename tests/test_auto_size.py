"""core/auto_size.py through core/deployment.resolve: the sizes a config leaves out, from the
machine, on fixed inputs worked out by hand below (not read back from the code)."""
from __future__ import annotations

import pytest

from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError
from vllm_hisparse.core.auto_size import Machine
from vllm_hisparse.core.deployment import EngineLimits, resolve
from vllm_hisparse.core.host_pool import PIN_SHARE, check_host_room

GIB, MIB = 1 << 30, 1 << 20
# 4 layers (layer 0 dense), 2 KV heads x 32, fp32, page 16, B 64 (S = 4), max_model_len 1024
CFG = dict(top_k=32, device_buffer_size=64, page_size=16, dense_layers=(0,))
LIM = dict(num_layers=4, max_model_len=1024, max_num_seqs=8, num_kv_heads=2, head_dim=32,
           dtype_bytes=4)
PER = 1024 // 16                         # pages of a request of max_model_len
PAGE = 2 * 16 * 2 * 32 * 4               # one page of one layer, K and V: 8 KiB
BLOCK = PAGE * 4                         # a vLLM block: the page in all 4 layers
ROW = 2 * PER * 2 * 32 * 4 * 3           # Quest min + max per page, 3 sparse layers: 96 KiB
DENSE = PER * PAGE * 1                   # a request's pages in the 1 dense layer: 512 KiB
HOST_PAGE = PAGE * 3                     # a host page holds the 3 sparse layers (dense pool on)


def sized(machine=None, **over):
    lim = dict(LIM)
    for k in [k for k in over if k in lim or k in ("tensor_parallel_size",
                                                    "max_num_batched_tokens", "watermark")]:
        lim[k] = over.pop(k)
    return resolve(HiSparseConfig(**{**CFG, **over}), EngineLimits(**lim, machine=machine))


def requests(blocks):
    """Requests of 1024 tokens in `blocks` (the null block out): the last admitted holds its 64
    pages + 1 (resident_first), the others their S + 1 = 5."""
    return 0 if blocks - 1 < PER + 1 else 1 + (blocks - 1 - (PER + 1)) // 5


def test_everything_auto_on_a_known_machine():
    # 8 MiB of stock KV budget; 9 GiB of RAM: the host is no bound here
    dep = sized(Machine(9 * GIB, 1, 8 * MIB, False, "test"))
    # H: R rows reserve (R + 1) x ROW + R x DENSE, at most half of the budget: H = 6 (3.66 MiB),
    # 7 takes 4.25 MiB > 4 MiB; the KV cache then holds 139 blocks, 15 requests >= 6
    assert 7 * ROW + 6 * DENSE <= 4 * MIB < 8 * ROW + 7 * DENSE
    kv = 8 * MIB - (7 * ROW + 6 * DENSE)
    assert (kv // BLOCK, requests(kv // BLOCK)) == (139, 15)
    # L: one more row (no dense pages: a host-less request reads its own blocks) reserves
    # 8 x 96 + 6 x 512 = 3840 KiB <= 4 MiB, leaving 136 blocks: usable 135 - R (cdiv(0, 16) +
    # max_num_seqs 8 + watermark 0) - 6 floors of S + 1 = 5 = 97 >= one whole life of 64; a second
    # row: 3936 KiB, 133 blocks, 132 - 8 - 30 - 64 (the first host-less) = 30 < 64
    assert (8 * MIB - (8 * ROW + 6 * DENSE)) // BLOCK == 136 and 135 - 8 - 30 >= PER
    assert (8 * MIB - (9 * ROW + 6 * DENSE)) // BLOCK == 133 and 132 - 8 - 30 - PER < PER
    assert 8 * ROW + 6 * DENSE <= 4 * MIB
    assert dep.auto == ("host_pool_gib", "quest_rows", "dense_pool_gib")
    # the GPU KV line: 136 blocks run 1 + (135 - 65) // 5 = 15 requests at their floor
    assert (dep.cfg.quest_rows, dep.indexer_rows, dep.gpu_requests) == (7, 7, 15)
    assert dep.hostless_requests == 1
    assert dep.dense_pool_pages == 6 * PER and dep.cfg.dense_pool_gib == 6 * DENSE / GIB
    assert dep.host_pages == 6 * PER and dep.cfg.host_pool_gib == 6 * PER * HOST_PAGE / GIB
    assert dep.room()[0] == 7 and dep.idle_rows_note() is None
    line = dep.room_line()
    assert line.startswith("hisparse: room for 7 requests of max_model_len=1024 tokens at once ("
                           "6 host-backed + 1 host-less (hostless=sparse); quest_rows=7 auto; ")
    assert "host pool 9.0 MiB auto: 384 pages = 6 requests" in line
    assert "GPU dense pool 3.0 MiB auto: 384 pages = 6 requests" in line     # 384 x 8 KiB
    assert "GPU KV 8.0 MiB (test): 15 requests" in line and "\n" not in line


def test_the_host_bounds_the_rows():
    # 10 MiB above the 8 GiB reserve: 80% of it is 341 host pages, 5 requests of 64
    dep = sized(Machine(8 * GIB + 10 * MIB, 1, 8 * MIB, False, "test"))
    assert int(0.8 * 10 * MIB) // HOST_PAGE == 341
    assert (dep.host_pages, dep.dense_pool_pages) == (5 * PER, 5 * PER)
    # + 1 host-less row: 7 x 96 + 5 x 512 = 3232 KiB, 155 blocks: 154 - 8 (R) - 25 (5 floors)
    # = 121 >= 64; + 2: 3328 KiB, 152 blocks: 151 - 8 - 25 - 64 = 54 < 64
    assert (8 * MIB - (7 * ROW + 5 * DENSE)) // BLOCK == 155 and 154 - 8 - 25 >= PER
    assert (8 * MIB - (8 * ROW + 5 * DENSE)) // BLOCK == 152 and 151 - 8 - 25 - PER < PER
    assert (dep.indexer_rows, dep.hostless_requests, dep.room()[0]) == (6, 1, 6)


def test_hostless_rows_count_the_connectors_reserve_and_modes():
    m = Machine(8 * GIB + 10 * MIB, 1, 8 * MIB, False, "test")      # H = 5, as above
    # R with max_num_batched_tokens 1024: cdiv(1024, 16) + 8 = 72 > 154 - 25 - 64 = 65: none
    big = sized(m, max_num_batched_tokens=1024)
    assert (big.indexer_rows, big.hostless_requests) == (5, 0)
    # 16 tokens: cdiv(16, 16) + 8 = 9 <= 65: one
    assert sized(m, max_num_batched_tokens=16).hostless_requests == 1
    # a watermark of 0.05 x 155 blocks = 7 more blocks in R: 154 - 15 - 25 = 114 >= 64: one
    assert sized(m, watermark=0.05).hostless_requests == 1
    # max_num_seqs caps H + L
    assert (sized(m, max_num_seqs=5).indexer_rows, sized(m, max_num_seqs=5).hostless_requests) == (5, 0)
    # "wait": no host-less request, no row for one; the line says 0
    wait = sized(m, hostless="wait")
    assert (wait.indexer_rows, wait.hostless_requests, wait.room()[0]) == (5, 0, 5)
    assert "(5 host-backed + 0 host-less (hostless=wait); quest_rows=5 auto;" in wait.room_line()
    # "dense": host-less requests take no row, so the rows stay H, but the line counts them beside
    # the rows: 6 x ROW + 5 x DENSE = 3136 KiB reserved leaves 158 blocks: 157 - 8 - 25 = 124 >= 64,
    # one; a second: 124 - 64 = 60 < 64
    dense = sized(m, hostless="dense")
    assert (8 * MIB - (6 * ROW + 5 * DENSE)) // BLOCK == 158 and 157 - 8 - 25 - PER < PER
    assert (dense.indexer_rows, dense.hostless_requests, dense.room()[0]) == (5, 1, 6)
    assert "(5 host-backed + 1 host-less (hostless=dense); quest_rows=5 auto;" in dense.room_line()
    # resident mode: no host tier, no host-less request
    assert sized(m, host_tier=False).hostless_requests is None
    # an explicit quest_rows wins: host-less requests only on its idle rows, none here (the auto
    # host pool holds the 5 rows' requests)
    given = sized(m, quest_rows=5)
    assert (given.indexer_rows, given.hostless_requests) == (5, 0)


def test_an_explicit_value_overrides_its_field_only():
    machine = Machine(9 * GIB, 1, 8 * MIB, False, "test")
    dep = sized(machine, quest_rows=2)
    assert dep.auto == ("host_pool_gib", "dense_pool_gib") and dep.indexer_rows == 2
    assert (dep.dense_pool_pages, dep.host_pages) == (2 * PER, 2 * PER)     # what 2 rows fill
    assert "quest_rows=2;" in dep.room_line()
    dep = sized(machine, host_pool_gib=0.5)        # 0.5 GiB / 24 KiB = 21845 pages: no bound
    assert dep.cfg.host_pool_gib == 0.5 and dep.host_pages == GIB // 2 // HOST_PAGE
    assert dep.indexer_rows == 6 and dep.auto == ("quest_rows", "dense_pool_gib")
    small = sized(machine, host_pool_gib=2 * PER * HOST_PAGE / GIB)      # 2 requests of 64 pages
    assert small.indexer_rows == 6                  # a given pool does not cap the rows
    # the 4 idle rows serve host-less requests (hostless "sparse", the default): 7 x ROW + 6 x
    # DENSE = 3744 KiB leaves 139 blocks: 138 - R 8 - 2 floors of 5 = 120 >= 64, one; two: 56 < 64
    assert (8 * MIB - (7 * ROW + 6 * DENSE)) // BLOCK == 139 and 138 - 8 - 10 - PER < PER
    assert (small.hostless_requests, small.room()[0]) == (1, 3)
    assert "3 rows serve only shorter requests" in small.idle_rows_note()
    # ... and say so; not with "wait" (none counted, 4 idle)
    assert "those rows also serve host-less requests" in small.idle_rows_note()
    waits = sized(machine, host_pool_gib=2 * PER * HOST_PAGE / GIB, hostless="wait")
    assert "host-less" not in waits.idle_rows_note() and waits.hostless_requests is None
    assert "4 rows serve only shorter requests" in waits.idle_rows_note()
    dep = sized(machine, dense_pool_gib=0)          # no dense pool: the host holds all 4 layers
    assert dep.dense_pool_pages is None and dep.host_layers == (0, 1, 2, 3)
    # 9 rows x ROW = 864 KiB reserved: the max_num_seqs cap (8) binds
    assert dep.indexer_rows == 8 and dep.host_pages == 8 * PER
    assert sized(machine, quest_rows="auto").cfg.quest_rows == 7           # "auto" = absent


def test_an_explicit_kv_cache_size_is_not_cut_by_the_reservations():
    # --kv-cache-memory-bytes 3 MiB: 96 blocks, whatever is reserved: 7 requests
    dep = sized(Machine(9 * GIB, 1, 3 * MIB, True, "kv_cache_memory_bytes"))
    assert requests(3 * MIB // BLOCK) == 7 and dep.indexer_rows == 7


def test_unknown_machine_parts():
    dep = sized(Machine(None, 1, None))            # no RAM, no GPU figure: max_num_seqs rows
    assert (dep.indexer_rows, dep.host_pages, dep.dense_pool_pages) == (8, 8 * PER, 8 * PER)
    old = sized(None)                              # outside vLLM and calc: the fixed sizes
    assert (old.cfg.host_pool_gib, old.cfg.quest_rows, old.cfg.dense_pool_gib) == (16.0, 0, 0.0)
    assert old.auto == () and old.indexer_rows == 8 and old.dense_pool_pages is None


def test_no_request_can_turn_sparse():
    dep = sized(Machine(9 * GIB, 1, 8 * MIB, False, "test"), max_model_len=100)   # < 2 x B
    assert (dep.indexer_rows, dep.host_pages, dep.cfg.dense_pool_gib) == (0, 0, 0.0)
    assert "no request can turn sparse" in dep.room_line()


def test_tensor_parallel_ranks_split_the_host_and_the_startup_check_agrees():
    avail = 9 * GIB
    m = Machine(avail, 2, None)                    # 2 ranks on this host, 1 KV head each
    dep = sized(m, num_kv_heads=1, tensor_parallel_size=2, max_num_seqs=100000)
    rank_page = HOST_PAGE // 2
    room = int(0.8 * GIB) // 2 // rank_page        # each rank's share of 80% of 9 - 8 GiB
    assert dep.host_pages == room // PER * PER     # the rows the room holds, each 64 pages
    rank_bytes = dep.host_pages * rank_page
    assert dep.cfg.host_pool_bytes == 2 * rank_bytes          # host_pool_gib: the engine's total
    check_host_room(dep.cfg.host_pool_gib, rank_bytes, 2, 2, True, {"available": avail})
    assert 2 * rank_bytes <= PIN_SHARE * avail


def test_a_ram_too_small_for_one_request_fails_in_one_line():
    with pytest.raises(HiSparseConfigError) as e:
        sized(Machine(8 * GIB + MIB, 1, 8 * MIB, False, "test"))    # 34 pages < 64
    msg = str(e.value)
    assert msg.startswith("hisparse config: host_pool_gib='auto' is invalid: ") and "\n" not in msg
    assert "max_model_len=1024" in msg


def test_a_gpu_too_small_for_one_request_fails_in_one_line():
    with pytest.raises(HiSparseConfigError) as e:
        sized(Machine(9 * GIB, 1, 2 * MIB, True, "kv_cache_memory_bytes"))   # 64 blocks < 66
    msg = str(e.value)
    assert msg.startswith("hisparse config: quest_rows='auto' is invalid: ") and "\n" not in msg


@pytest.mark.parametrize("field", ["host_pool_gib", "quest_rows", "dense_pool_gib"])
def test_auto_spellings_and_bad_values(field):
    assert getattr(HiSparseConfig.from_dict({field: "auto"}), field) is None
    assert getattr(HiSparseConfig(), field) is None
    with pytest.raises(HiSparseConfigError, match=rf"^hisparse config: {field}=-1 is invalid: .*auto"):
        HiSparseConfig.from_dict({field: -1})
    if field != "quest_rows":
        with pytest.raises(HiSparseConfigError, match=rf"{field}=nan is invalid: .*\"auto\""):
            HiSparseConfig.from_dict({field: float("nan")})
