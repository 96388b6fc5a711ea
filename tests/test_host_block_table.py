"""vllm/host_block_table.py finds the host tensor vLLM fills its device block table from (a real
vllm BlockTable, as the model runner holds it), and the metadata builder reads the first blocks of
the rows with tokens from it (-1 for token-less padding rows), equal to the device copy's."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm


def _block_table(rows):
    from vllm.v1.worker.block_table import BlockTable

    bt = BlockTable(block_size=16, max_num_reqs=8, max_num_blocks_per_req=12,
                    max_num_batched_tokens=64, pin_memory=False, device=torch.device("cpu"),
                    kernel_block_size=16, cp_kv_cache_interleave_size=1)
    for i, blocks in enumerate(rows):
        bt.add_row(blocks, i)
    bt.commit_block_table(len(rows))
    return bt


def test_finds_the_runner_table_by_its_device_tensor():
    from vllm_hisparse.vllm.host_block_table import host_block_table

    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 500, (int(n),), generator=g).tolist() for n in (5, 1, 12)]
    bt = _block_table(rows)
    dev = bt.get_device_tensor(3)
    host = host_block_table(dev, {})
    assert host is not None and host.data_ptr() == bt.block_table.cpu.data_ptr()
    assert torch.equal(host[:3], dev.cpu())
    assert host_block_table(torch.zeros(3, 12, dtype=torch.int32), {}) is None   # not a runner's


def test_found_up_the_stack_when_the_heap_is_frozen():
    """vLLM freezes the GC heap after startup (gc.get_objects no longer lists its objects): the
    table is then found through the caller that holds it, as the model runner calls the builder."""
    import gc

    from vllm_hisparse.vllm import host_block_table as hbt

    class Batch:
        def __init__(self, table):
            self.block_table = table

    class Runner:
        def __init__(self, table):
            self.input_batch = Batch(table)

        def build(self):
            return hbt.host_block_table(self.input_batch.block_table.get_device_tensor(2), {})

    bt = _block_table([[11, 12], [13]])
    gc.freeze()
    try:
        assert hbt._search(bt.block_table.gpu.data_ptr(), 12) is None      # what gc misses
        host = Runner(bt).build()
    finally:
        gc.unfreeze()
    assert host is not None and host.data_ptr() == bt.block_table.cpu.data_ptr()


def test_builder_first_blocks_skip_padding_rows():
    from vllm_hisparse.vllm.backend import _host_first_blocks

    rows = [[41, 7], [9], [300, 2, 5], [77]]
    bt = _block_table(rows)
    dev = bt.get_device_tensor(4)
    found = {}
    assert _host_first_blocks(dev, [0, 1, 2, 3, 4], found) == [41, 9, 300, 77]
    assert _host_first_blocks(dev, [0, 1, 2, 2, 2], found) == [41, 9, -1, -1]     # rows 2-3: padding
