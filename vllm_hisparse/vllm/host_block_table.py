"""The host copy of vLLM's block table, so the metadata builder reads each row's first block (the
request's identity, request_rows.RequestRows) without a device->host copy.

``CommonAttentionMetadata`` hands the builder only the device block table; ``.cpu()`` on it waits for
every kernel queued before (the previous step's forward, under asynchronous scheduling), so the GPU
idles while the host plans. The model runner fills that table from a host tensor it keeps beside it
(``vllm.v1.worker.block_table.BlockTable.block_table``: a CpuGpuBuffer ``.cpu`` / ``.gpu``) and has
already filled this step's rows when the builder runs. vLLM offers no hook to it, so it is found once,
by the device tensor's address: first up the call stack (the builder is called from the model
runner's ``_build_attention_metadata``: its ``self.input_batch.block_table``), else among the live
objects (``gc.get_objects``, which misses what vLLM froze with ``gc.freeze()`` after startup — the
engine's own tables). Not found (another runner): None, and the caller keeps the device copy.
What was found is kept in the caller's ``found`` dict (the worker object's ``host_tables``).
"""
from __future__ import annotations

import gc
import logging
import sys

import torch

logger = logging.getLogger(__name__)


def host_block_table(device_table: torch.Tensor, found: dict) -> torch.Tensor | None:
    """The host tensor whose rows vLLM copies into ``device_table`` (any view starting at its row 0),
    or None. ``found``: device address -> (the device tensor, kept alive so the address is not
    reused; its host twin or None), filled on the first call for each table."""
    ptr = device_table.data_ptr()
    if ptr not in found:
        width = device_table.shape[-1]
        host = _from_stack(ptr, width)
        found[ptr] = (device_table, host if host is not None else _search(ptr, width))
        if found[ptr][1] is None:
            logger.warning("hisparse: vLLM's host block table not found; the metadata builder "
                           "copies the first blocks from the device (one GPU sync per step)")
    return found[ptr][1]


def _match(table, ptr: int, width: int) -> torch.Tensor | None:
    buf = getattr(table, "block_table", None)
    gpu, cpu = getattr(buf, "gpu", None), getattr(buf, "cpu", None)
    if (isinstance(gpu, torch.Tensor) and isinstance(cpu, torch.Tensor)
            and gpu.data_ptr() == ptr and cpu.shape[-1] == width):
        return cpu
    return None


def _from_stack(ptr: int, width: int, depth: int = 16) -> torch.Tensor | None:
    """A caller whose ``self`` holds ``input_batch.block_table`` (vLLM's model runner)."""
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return None
        tables = getattr(getattr(f.f_locals.get("self"), "input_batch", None), "block_table", None)
        for t in getattr(tables, "block_tables", None) or ([tables] if tables is not None else []):
            cpu = _match(t, ptr, width)
            if cpu is not None:
                return cpu
        f = f.f_back
    return None


def _search(ptr: int, width: int) -> torch.Tensor | None:
    try:
        from vllm.v1.worker.block_table import BlockTable
    except ImportError:
        return None
    for obj in gc.get_objects():
        if BlockTable in type(obj).__mro__:            # not isinstance: no __class__ lookups
            cpu = _match(obj, ptr, width)
            if cpu is not None:
                return cpu
    return None
