"""Host->device copies of per-step metadata that do not wait for the GPU.

A plain ``cpu_tensor.to("cuda")`` copies from pageable memory and synchronises the stream: the host
waits until every kernel queued before it (the previous step's forward) has run. Under vLLM's
asynchronous scheduling the host prepares step t+1 while the GPU still runs step t, so one such copy
in the plan turns the overlap off and the GPU idles for the whole plan. ``HostToDevice`` copies
through a ring of pinned buffers with ``non_blocking=True`` instead; an event per buffer keeps the
host from refilling one whose copy has not run yet (a ring of 64, ~15 copies per step: a copy
several steps back, long done). The destination is a fresh tensor from the caching
allocator, so it is stream-ordered like any other. On the CPU it is a plain copy.
"""
from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    def __init__(self, device, slots: int = 64):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list = [None] * slots
        self._next = 0

    def __call__(self, x, dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x: a CPU tensor, numpy array or (nested) list -> a new tensor on the device with its
        values (dtype: the list's, or as given), or those values copied into ``out`` (a device
        tensor of as many elements, contiguous; returned)."""
        if isinstance(x, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(x))
        elif isinstance(x, torch.Tensor):
            t = x.contiguous()
        else:
            t = torch.tensor(x, dtype=dtype)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        if out is not None:
            t = t.to(out.dtype).view(out.shape)
        if not self.pinned:
            return t.to(self.device, copy=True) if out is None else out.copy_(t)
        nbytes = t.numel() * t.element_size()
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        if self._events[i] is not None and not self._events[i].query():
            self._events[i].synchronize()          # its last copy has not run yet (rare)
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            size = max(4096, 1 << max(nbytes - 1, 1).bit_length())
            buf = self._bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        staged = buf[:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        if out is None:
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        out.copy_(staged, non_blocking=True)
        if self._events[i] is None:
            self._events[i] = torch.cuda.Event()
        self._events[i].record()
        return out
