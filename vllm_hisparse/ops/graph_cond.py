"""Work that runs only when a device flag is set, inside a CUDA graph as well as eagerly.

A FULL CUDA graph of a decode step is recorded once and replayed for any batch of its size, so it
cannot branch on the batch in Python: a batch without sparse rows would still run every sparse
kernel (~55 us per layer of kernels for nothing, measured on the H200, docs/gpu-results.md). With
``run_if(preds, flags, fns)`` the kernels of ``fns[i]`` are recorded into the body of a conditional
(IF) graph node that the GPU skips when ``preds[i]`` (an int64 the step's plan wrote) is 0; one
kernel sets every node's condition. Eagerly (no capture), ``fns[i]`` runs when the host-side
``flags[i]`` is true. Each fn must be correct to run unconditionally too (the decode body's kernels
skip rows that are not theirs): ``HISPARSE_GRAPH_COND=0`` records them without conditional nodes,
to measure what the nodes save.

A body is captured on a stream of its own into its IF node's graph (csrc/graph_cond.cu). It must
not allocate: the caching allocator does not know that capture, so a block it hands out there could
be reused by later work while the graph still writes it. The callers allocate every output and
workspace before ``run_if``; a capture that allocates inside a body is refused with an error.
"""
from __future__ import annotations

import os

import torch

_streams: dict[int, torch.cuda.Stream] = {}
ENABLED = os.environ.get("HISPARSE_GRAPH_COND", "1") != "0"


def run_if(preds: torch.Tensor, flags: list[bool], fns: list) -> None:
    """fns[i]() when preds[i] is non-zero (preds: (n,) int64, contiguous): decided by the GPU at
    replay when the current CUDA stream is being captured, else by flags[i] (preds' values, known
    to the host)."""
    if not (preds.is_cuda and torch.cuda.is_current_stream_capturing()):
        for flag, fn in zip(flags, fns):
            if flag:
                fn()
        return
    if not ENABLED:
        for fn in fns:
            fn()
        return
    dev = preds.device.index
    s = _streams.get(dev)
    if s is None:
        s = _streams[dev] = torch.cuda.Stream(preds.device)
    allocs = torch.cuda.memory_stats(preds.device).get("allocation.all.allocated", 0)
    handles = torch.ops.hisparse.graph_cond_set(preds).tolist()
    for h, fn in zip(handles, fns):
        torch.ops.hisparse.graph_cond_begin(preds, h, s.cuda_stream)
        try:
            with torch.cuda.stream(s):
                fn()
        finally:
            torch.ops.hisparse.graph_cond_end(preds, s.cuda_stream)
    if torch.cuda.memory_stats(preds.device).get("allocation.all.allocated", 0) != allocs:
        raise RuntimeError("hisparse: a conditional CUDA-graph body allocated memory (its kernels "
                           "must use buffers allocated before run_if)")
