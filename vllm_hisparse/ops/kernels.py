"""Dispatch to the compiled CUDA ops (vllm_hisparse._C) with the plain-torch references as the
CPU path. Each public function has the signature of its reference in ops/reference.py."""
from __future__ import annotations

import torch

from . import reference

_ext = None
_err: str | None = None
try:
    from vllm_hisparse import _C as _ext  # noqa: F401  (registers torch.ops.hisparse.*)
except Exception as e:  # noqa: BLE001 - report any import failure verbatim
    _err = f"{type(e).__name__}: {e}"


def available() -> bool:
    return _ext is not None


def import_error() -> str | None:
    return _err


def use_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and _ext is not None


def add_one(x: torch.Tensor) -> torch.Tensor:
    """Pipeline probe: x + 1 through the extension (CUDA) or torch (CPU)."""
    if use_cuda(x):
        out = torch.empty_like(x)
        torch.ops.hisparse.add_one(x, out)
        return out
    return x + 1
