"""Page-locked host tensors of exactly their size, for the host KV pool.

torch's pinned allocator (``pin_memory=True``) is a caching allocator that rounds every block up to
the next power of two: a 52 GiB host pool pins 64 GiB, and an 80 GiB one asks the driver for 128
GiB, which a 128 GiB host cannot give. Here the memory comes from the
ordinary CPU allocator and is registered with CUDA (``cudaHostRegister``, portable + mapped: every
device reaches it through UVA, which RESOLVE and the write-through kernel use), so pinning costs
exactly the tensor's bytes. ``tensor.is_pinned()`` is True for registered memory.
"""
from __future__ import annotations

from typing import Callable

import torch

HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2


def pinned_empty(shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
    """(tensor, unpin): an uninitialised page-locked CPU tensor of exactly ``shape`` and the call
    that unregisters it. The caller keeps the tensor (and every view of it) alive until unpin, and
    calls unpin before the memory is freed. Raises RuntimeError naming the CUDA error."""
    t = torch.empty(shape, dtype=dtype, device="cpu")   # not the default device: vLLM builds models
    # under `with torch.device("cuda")`, and registering a device pointer fails (cudaError 1)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t, lambda: None
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    rc = int(cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {rc}")

    def unpin() -> None:
        int(cudart.cudaHostUnregister(ptr))

    return t, unpin
