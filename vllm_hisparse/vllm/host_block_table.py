"""The host copy of vLLM's block table, so the metadata builder reads each row's first block (the
request's identity, worker_state.bind_request) without a device->host copy.

``CommonAttentionMetadata`` hands the builder only the device block table; ``.cpu()`` on it waits for
every kernel queued before (the previous step's forward, under asynchronous scheduling), so the GPU
idles while the host plans. The model runner fills that table from a host tensor it keeps beside it
(``vllm.v1.worker.block_table.BlockTable.block_table``: a CpuGpuBuffer ``.cpu`` / ``.gpu``) and has
already filled this step's rows when the builder runs. vLLM offers no hook to it, so it is found once
among the live objects by the device tensor's address. Not found (another runner): None, and the
caller keeps the device copy.
"""
from __future__ import annotations

import gc
import logging

import torch

logger = logging.getLogger(__name__)
# device address -> (the device tensor, kept alive so the address is not reused; its host twin)
_found: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}


def host_block_table(device_table: torch.Tensor) -> torch.Tensor | None:
    """The host tensor whose rows vLLM copies into ``device_table`` (any view starting at its row 0),
    or None."""
    ptr = device_table.data_ptr()
    if ptr not in _found:
        _found[ptr] = (device_table, _search(ptr, device_table.shape[-1]))
        if _found[ptr][1] is None:
            logger.warning("hisparse: vLLM's host block table not found; the metadata builder "
                           "copies the first blocks from the device (one GPU sync per step)")
    return _found[ptr][1]


def _search(ptr: int, width: int) -> torch.Tensor | None:
    try:
        from vllm.v1.worker.block_table import BlockTable
    except ImportError:
        return None
    for obj in gc.get_objects():
        if BlockTable in type(obj).__mro__:            # not isinstance: no __class__ lookups
            buf = getattr(obj, "block_table", None)
            gpu, cpu = getattr(buf, "gpu", None), getattr(buf, "cpu", None)
            if (isinstance(gpu, torch.Tensor) and isinstance(cpu, torch.Tensor)
                    and gpu.data_ptr() == ptr and cpu.shape[-1] == width):
                return cpu
    return None
