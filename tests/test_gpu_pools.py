"""core/gpu_pools.py: the GPU pools of sparse requests are sized from what this engine's sparse
requests can hold at once, checked against hand computations, and the runtime allocates exactly
that (no Quest row but the scratch row and an empty dense pool when no request can be sparse)."""
import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import gpu_pools
from vllm_hisparse.core.sparse_runtime import SparseRuntime

# bench/serving.py's config: min_context = 2 x B = 8192
SERVING = dict(top_k=2048, device_buffer_size=4096, dense_pool_gib=6, host_pool_gib=84, quest_rows=22)
PAGE_BYTES = 2 * 16 * 8 * 128 * 2            # one page of one layer, Llama-3-8B shape, bf16


@pytest.mark.parametrize("mml,possible", [(4624, False), (8191, False), (8192, True), (33296, True)])
def test_serving_config(mml, possible):
    cfg = HiSparseConfig(**SERVING)
    assert gpu_pools.sparse_possible(cfg, mml) is possible
    rows = gpu_pools.quest_rows(cfg, 64, mml)
    pages = gpu_pools.dense_pool_pages(cfg, PAGE_BYTES, 64, mml)
    if not possible:
        assert (rows, pages, gpu_pools.dense_pool_bytes(cfg, PAGE_BYTES, 64, mml)) == (0, 0, 0)
        return
    assert rows == 22
    per_req = -(-mml // 16)
    configured = (6 << 30) // (PAGE_BYTES * 2)          # 24,576 pages of both dense layers
    assert pages == min(configured, 22 * per_req)
    assert gpu_pools.dense_pool_bytes(cfg, PAGE_BYTES, 64, mml) == pages * PAGE_BYTES * 2


def test_rows_default_to_max_num_seqs_and_min_context_zero():
    cfg = HiSparseConfig(min_context=0, dense_pool_gib=1)
    assert gpu_pools.quest_rows(cfg, 7, 16) == 7
    assert gpu_pools.dense_pool_pages(cfg, 1024, 7, 100) == min((1 << 30) // 2048, 7 * 7)
    assert gpu_pools.dense_pool_pages(HiSparseConfig(), 1024, 7, 100) is None   # no pool


@pytest.mark.parametrize("mml", [100, 300])
def test_runtime_allocates_what_gpu_pools_says(mml):
    """min_context 160 tokens: a 100-token engine reserves the scratch Quest row only and an empty
    dense pool; a 300-token one 5 rows and 5 x 19 pool pages (less than the 0.01 GiB asked)."""
    P, H, D = 16, 2, 8
    cfg = HiSparseConfig(top_k=32, device_buffer_size=80, page_size=P, dense_layers=(0,),
                         dense_pool_gib=0.01, host_pool_gib=0.01, quest_rows=5)
    rt = SparseRuntime(cfg, 3, H, D, torch.float32, "cpu", 4, mml)
    U = -(-mml // P)
    rows = 0 if mml < 160 else 5
    assert [t.shape if t is not None else None for t in rt.ix.kmin] == \
        [None, (rows + 1, U, H, D), (rows + 1, U, H, D)]
    assert rt.ix.rows == rows
    assert rt.dpool.num_pages == (0 if mml < 160 else min(5 * U, int(0.01 * (1 << 30)) // (2 * P * H * D * 4)))


def test_idle_rows_note_only_when_rows_exceed_the_pool():
    # the paper config: 22 rows, the 84 GiB host pool holds 17 requests of 40K tokens
    note = gpu_pools.idle_rows_note(22, 17, 40960, "host")
    assert "22 Quest rows (quest_rows)" in note and "5 rows" in note and "set quest_rows to 17" in note
    note = gpu_pools.idle_rows_note(256, 17, 40960, "host", "max_num_seqs: quest_rows unset")
    assert "256 Quest rows (max_num_seqs: quest_rows unset)" in note
    assert gpu_pools.idle_rows_note(17, 17, 40960, "host") is None
    assert gpu_pools.idle_rows_note(8, 17, 40960, "host") is None
