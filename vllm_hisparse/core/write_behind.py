"""WRITE-BEHIND: the prefill's write-through to the pinned host pool on a side stream, overlapping
the next layers' compute instead of holding up the compute stream.

Why (profile, docs/gpu-results.md "sixteenth box"): a 32K prompt on the Llama-3-8B shape prefilled
in 1,292 ms against stock's 1,203 ms; 79 of the 89 ms were ``write_through_kernel`` on the compute
stream (64 launches, ~4.3 GB at PCIe rate), while the GPU's SMs could run the next layers.

Here a prefill row's write-through reads its K/V rows from the paged cache, where write_kv has just
stored the same bytes (the cache's (N*2*P) rows: sparse_layer.cache_row), not from the layer's
k / v: those may live in vLLM's CUDA-graph pool (a PIECEWISE step), which the next graph piece
reuses without asking the caching allocator. The side stream waits for
the compute stream's work so far, runs the kernel with a capped grid (it is bound by PCIe, not by
SMs: ``MAX_BLOCKS`` CTAs leave the rest to the compute stream), and the allocator is told that it
still reads the plan's index tensors (``record_stream``).

The compute stream waits for the side stream (``join``) at the end of every step's forward
(SparseRuntime.end_step, from the KV connector's wait_for_save: vLLM zeroes or copies blocks it
freed before the next step's plan, and may reuse them then), at the next plan (plan / plan_full),
and before the slow path that reads the pool from the host (prefill.attend_from_host). Within a
step nothing reads what it writes: decode and verify rows select complete pages written in earlier
steps and read the step's own tokens from the cache. The bytes are the same kernel's; only the
stream and the source differ.

Off (``HISPARSE_WRITE_BEHIND=0``, for A/B runs), on the CPU, with a cache that is not contiguous,
and while a CUDA graph is being captured: the write-through reads k / v on the current stream, as
before.
"""
from __future__ import annotations

import torch

from vllm_hisparse.knobs import env_flag
from vllm_hisparse.ops.write_through import write_through

ENV = "HISPARSE_WRITE_BEHIND"
MAX_BLOCKS = 32          # CTAs of the side stream's kernel (PCIe-bound; to be checked by a profile)


def enabled() -> bool:
    return env_flag(ENV, True, on="the prefill's host write-through on a side stream",
                    off="on the compute stream")


class WriteBehind:
    def __init__(self, device, on: bool | None = None):
        self.device = torch.device(device)
        on = enabled() if on is None else on
        self.stream = (torch.cuda.Stream(self.device)
                       if on and self.device.type == "cuda" else None)
        self.pending = False             # side-stream work not yet joined by the compute stream
        self.writes = 0                  # side-stream launches (stats: write_behind_writes)

    def write(self, host: torch.Tensor, kv: torch.Tensor, src: torch.Tensor | None,
              k: torch.Tensor, v: torch.Tensor, tok: torch.Tensor, page: torch.Tensor,
              off: torch.Tensor) -> None:
        """Rows tok of k / v (stored in the cache kv (N, 2, P, Hkv, D) at its K rows ``src``, None
        when there is no side stream) -> host[page, 0|1, off]: ops.write_through's contract."""
        if (self.stream is None or src is None or not kv.is_contiguous()
                or (kv.is_cuda and torch.cuda.is_current_stream_capturing())):
            write_through(host, k, v, tok, page, off)
            return
        P = kv.shape[2]
        rows = kv.view(-1, *kv.shape[3:])                  # (N*2*P, Hkv, D)
        self._issue(host, rows[:-P], rows[P:], src, page, off)
        self.pending = True
        self.writes += 1

    def _issue(self, host, k_rows, v_rows, src, page, off) -> None:
        """The launch on the side stream, after the compute stream's work so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            write_through(host, k_rows, v_rows, src, page, off, max_blocks=MAX_BLOCKS)
        for t in (src, page, off):
            t.record_stream(self.stream)

    def join(self) -> None:
        """The compute stream waits for every write queued so far (no host wait). Not while a
        graph is captured: the writes come from eager prefill steps, joined by the next plan."""
        if self.pending and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False
