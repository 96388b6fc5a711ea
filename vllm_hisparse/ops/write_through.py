"""Write-through of the step's new K/V rows into one layer of the pinned host pool (contract:
reference.write_through).

CUDA: one kernel of UVA stores straight into pinned host memory on the current stream (no host sync,
no allocation, CUDA-graph capturable); it replaces a synchronous `host[pages, 0, offs] = k.to("cpu")`
per layer. CPU tensors: the plain-torch reference. CUDA tensors without the extension raise: a
synchronous copy per layer is exactly the stall this op exists to remove.
"""
from __future__ import annotations

import torch

from . import kernels, reference


def _has_op() -> bool:
    """The extension imported and has this op (an extension built before the op existed lacks it)."""
    return kernels.available() and hasattr(torch.ops.hisparse, "write_through")


if _has_op():
    @torch.library.register_fake("hisparse::write_through")
    def _write_through_fake(host, k, v, tok, page, off, max_blocks=0):
        return None


def write_through(host: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tok: torch.Tensor,
                  page: torch.Tensor, off: torch.Tensor, max_blocks: int = 0) -> None:
    """k[tok[i]] -> host[page[i], 0, off[i]] and v[tok[i]] -> host[page[i], 1, off[i]], in place.

    host: (pages, 2, P, Hkv, D) one layer of the pool, contiguous; pinned CPU memory (or, for tests,
          a CUDA tensor on k's device)
    k, v: (T, Hkv, D) host's dtype (any; copied as opaque bytes), on the GPU; each token's (Hkv, D)
          block contiguous, the token stride may be wider (views into the fused qkv output)
    tok, page, off: (n,) int64 on k's device; destinations distinct; page[i] < 0 = padding (no-op);
          n == 0 launches nothing. Out-of-range indices are invalid (the kernel skips them rather
          than store outside the pool; the reference raises).
    max_blocks: CUDA only, > 0 caps the kernel's grid (default 0: 8 blocks an SM); the bytes
          written are the same (a grid-stride loop). core/write_behind.py caps it on its side stream.
    CUDA path: one launch on the current stream, no host sync, no allocation. The host sees the
    bytes once that stream's work before it is done (an event or a synchronize).
    """
    if k.is_cuda:
        if not _has_op():
            why = kernels.import_error() or "the extension predates write_through; rebuild it"
            raise RuntimeError(
                f"write_through: k is on {k.device} but the CUDA op hisparse::write_through is not "
                f"available ({why}). Build the extension (`make build`); there is no slow fallback "
                f"for CUDA tensors.")
        torch.ops.hisparse.write_through(host, k, v, tok, page, off, max_blocks)
        return
    reference.write_through(host, k, v, tok, page, off)
