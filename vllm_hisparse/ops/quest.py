"""Quest page scores of the runtime rows, reading the per-layer bounds through a row index.

``quest_scores_rows(q, kmin, kmax, rows, n)`` == ``reference.quest_scores(q, kmin[rows], kmax[rows], n)``
without copying ``kmin[rows]`` (megabytes per row per layer) or building the reference's
(R, U, Hkv, G, D) fp32 temporaries. CUDA: the Triton kernel (ops/triton_quest.py); CPU: the
reference. The top pages of the scores are picked by ops/decode_ops.select_resolve.
"""
from __future__ import annotations

import torch

from . import reference

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


def check(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor,
          num_units: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError unless quest_scores_rows can take these (on CUDA: the kernel's strides)."""
    if q.dim() != 3:
        raise ValueError(f"q must be (R, Hq, D); got shape {tuple(q.shape)}")
    R, Hq, D = q.shape
    if kmin.dim() != 4 or kmin.shape[3] != D:
        raise ValueError(f"kmin must be (N, U, Hkv, D={D}); got shape {tuple(kmin.shape)}")
    if kmax.shape != kmin.shape or kmax.dtype != kmin.dtype:
        raise ValueError(f"kmax must match kmin in shape and dtype; got {tuple(kmax.shape)} "
                         f"{kmax.dtype} vs {tuple(kmin.shape)} {kmin.dtype}")
    Hkv = kmin.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's Hq={Hq} must be a multiple of kmin's Hkv={Hkv}")
    if q.dtype not in _FLOATS or kmin.dtype not in _FLOATS:
        raise ValueError(f"q and kmin/kmax must be fp16/bf16/fp32; got {q.dtype}, {kmin.dtype}")
    if rows.shape != (R,) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be ({R},) int64; got {tuple(rows.shape)} {rows.dtype}")
    if num_units.shape != (R,) or num_units.dtype not in _INTS:
        raise ValueError(f"num_units must be ({R},) int32/int64; got {tuple(num_units.shape)} "
                         f"{num_units.dtype}")
    for name, t in (("kmin", kmin), ("kmax", kmax), ("rows", rows), ("num_units", num_units)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if out is not None and (out.shape != (R, kmin.shape[1]) or out.dtype != torch.float32
                            or out.device != q.device):
        raise ValueError(f"out must be ({R}, {kmin.shape[1]}) float32 on {q.device}; got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if not q.is_cuda:
        return
    for name, t in (("q", q), ("kmin", kmin), ("out", out)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim on CUDA; got strides {t.stride()}")
    if kmax.stride() != kmin.stride():
        raise ValueError(f"kmax must have kmin's strides on CUDA; got {kmax.stride()} vs {kmin.stride()}")
    if kmin.shape[2] > 1 and kmin.stride(2) != q.shape[2]:
        raise ValueError(f"kmin's (Hkv, D) block of a page must be contiguous on CUDA; got "
                         f"strides {kmin.stride()}")


def quest_scores_rows(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, rows: torch.Tensor,
                      num_units: torch.Tensor, out: torch.Tensor | None = None,
                      live_only: bool = False) -> torch.Tensor:
    """(R, U) fp32 Quest upper bounds of q.k per page of row ``rows[r]`` of kmin/kmax.

    score[r, u] = sum over KV heads h, the G = Hq/Hkv query heads of group h and d of
    max(q*kmin[rows[r], u, h, d], q*kmax[rows[r], u, h, d]); -inf for u >= num_units[r].

    q: (R, Hq, D) fp16/bf16/fp32; kmin/kmax: (N, U, Hkv, D) fp16/bf16/fp32 (any strides on CPU;
    on CUDA the same strides and a contiguous last dim); rows: (R,) int64 in [0, N), on q's
    device; num_units: (R,) int32/int64 on q's device, values > U mean all U pages; out: optional
    (R, U) fp32 to write into. A row with num_units[r] == 0 reads no bounds on CUDA and is all -inf
    (so rows[r] = -1 is a safe padding row there; on CPU it reads row N-1 and is still all -inf).
    live_only: on CUDA, pages at or past num_units[r] are left unwritten (their programs return
    at once; the decode batch reads only the live ones); the CPU writes -inf there as always.
    CUDA: no host sync and no allocation beyond ``out``; deterministic (a row's bits do not depend
    on the other rows in the batch); equal to the reference up to fp32 summation order provided
    kmin <= kmax on live pages (see ops/triton_quest.py). CPU: exactly the reference.
    """
    check(q, kmin, kmax, rows, num_units, out)
    if q.is_cuda:
        from . import triton_quest
        if out is None:
            out = torch.empty(q.shape[0], kmin.shape[1], dtype=torch.float32, device=q.device)
        return triton_quest.quest_scores_rows(q, kmin, kmax, rows.contiguous(), num_units.contiguous(), out,
                                              live_only)
    s = reference.quest_scores(q, kmin[rows], kmax[rows], num_units)
    if out is None:
        return s
    out.copy_(s)
    return out
