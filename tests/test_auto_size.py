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
    for k in [k for k in over if k in lim or k == "tensor_parallel_size"]:
        lim[k] = over.pop(k)
    return resolve(HiSparseConfig(**{**CFG, **over}), EngineLimits(**lim, machine=machine))


def requests(blocks):
    """Requests of 1024 tokens in `blocks` (the null block out): the last admitted holds its 64
    pages + 1 (resident_first), the others their S + 1 = 5."""
    return 0 if blocks - 1 < PER + 1 else 1 + (blocks - 1 - (PER + 1)) // 5


def test_everything_auto_on_a_known_machine():
    # 8 MiB of stock KV budget; 9 GiB of RAM: the host is no bound here
    dep = sized(Machine(9 * GIB, 1, 8 * MIB, False, "test"))
    # R rows reserve (R + 1) x ROW + R x DENSE, at most half of the budget: R = 6 (3.66 MiB),
    # R = 7 takes 4.25 MiB > 4 MiB; the KV cache then holds 139 blocks, 15 requests >= 6
    assert 7 * ROW + 6 * DENSE <= 4 * MIB < 8 * ROW + 7 * DENSE
    kv = 8 * MIB - (7 * ROW + 6 * DENSE)
    assert (kv // BLOCK, requests(kv // BLOCK)) == (139, 15)
    assert dep.auto == ("host_pool_gib", "quest_rows", "dense_pool_gib")
    assert (dep.cfg.quest_rows, dep.indexer_rows, dep.gpu_requests) == (6, 6, 15)
    assert dep.dense_pool_pages == 6 * PER and dep.cfg.dense_pool_gib == 6 * DENSE / GIB
    assert dep.host_pages == 6 * PER and dep.cfg.host_pool_gib == 6 * PER * HOST_PAGE / GIB
    assert dep.room()[0] == 6 and dep.idle_rows_note() is None
    line = dep.room_line()
    assert line.startswith("hisparse: room for 6 requests of max_model_len=1024 tokens at once (")
    assert "quest_rows=6 auto" in line and "host pool 9.0 MiB auto: 384 pages = 6 requests" in line
    assert "GPU dense pool 3.0 MiB auto: 384 pages = 6 requests" in line     # 384 x 8 KiB
    assert "GPU KV 8.0 MiB (test): 15 requests" in line and "\n" not in line


def test_the_host_bounds_the_rows():
    # 10 MiB above the 8 GiB reserve: 80% of it is 341 host pages, 5 requests of 64
    dep = sized(Machine(8 * GIB + 10 * MIB, 1, 8 * MIB, False, "test"))
    assert int(0.8 * 10 * MIB) // HOST_PAGE == 341
    assert (dep.indexer_rows, dep.host_pages, dep.dense_pool_pages) == (5, 5 * PER, 5 * PER)


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
    assert (small.indexer_rows, small.room()[0]) == (6, 2)    # a given pool does not cap the rows
    assert "4 rows serve only shorter requests" in small.idle_rows_note()
    # ... and, hostless "sparse" (the default), host-less requests; not with "wait"
    assert "those rows also serve host-less requests" in small.idle_rows_note()
    waits = sized(machine, host_pool_gib=2 * PER * HOST_PAGE / GIB, hostless="wait")
    assert "host-less" not in waits.idle_rows_note()
    dep = sized(machine, dense_pool_gib=0)          # no dense pool: the host holds all 4 layers
    assert dep.dense_pool_pages is None and dep.host_layers == (0, 1, 2, 3)
    # 9 rows x ROW = 864 KiB reserved: the max_num_seqs cap (8) binds
    assert dep.indexer_rows == 8 and dep.host_pages == 8 * PER
    assert sized(machine, quest_rows="auto").cfg.quest_rows == 6           # "auto" = absent


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
