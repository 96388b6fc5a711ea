"""Quest page bounds: fold a step's keys into kmin/kmax by page index (contract:
reference.quest_update_pages).

CUDA: one Triton launch (ops/triton_quest_update.py) instead of the reference's ~12 torch ops, the
same bits (min/max are exact). CPU: the reference.
"""
from __future__ import annotations

import torch

from . import reference


def _check(kmin: torch.Tensor, kmax: torch.Tensor, page_flat: torch.Tensor, page_new: torch.Tensor,
           tok_page: torch.Tensor, k: torch.Tensor) -> None:
    if kmin.dim() != 4 or kmax.shape != kmin.shape or kmax.dtype != kmin.dtype:
        raise ValueError(f"kmin/kmax must be (R, U, Hkv, D) of one shape and dtype; got "
                         f"{tuple(kmin.shape)} {kmin.dtype}, {tuple(kmax.shape)} {kmax.dtype}")
    if kmax.stride() != kmin.stride():
        raise ValueError(f"kmax must have kmin's strides on CUDA; got {kmax.stride()} vs {kmin.stride()}")
    m, T = page_flat.shape[0], tok_page.shape[0]
    if k.dim() != 3 or k.shape[0] != T or k.shape[1:] != kmin.shape[2:]:
        raise ValueError(f"k must be (T={T}, Hkv, D) = (T, {kmin.shape[2]}, {kmin.shape[3]}); "
                         f"got {tuple(k.shape)}")
    if page_flat.dtype != torch.int64 or tok_page.dtype != torch.int64:
        raise ValueError(f"page_flat/tok_page must be int64; got {page_flat.dtype}, {tok_page.dtype}")
    if page_new.shape != (m,) or page_new.dtype != torch.bool:
        raise ValueError(f"page_new must be ({m},) bool; got {tuple(page_new.shape)} {page_new.dtype}")
    if T < m:
        raise ValueError(f"{T} tokens for {m} pages: every page needs at least one token")
    for name, t in (("kmax", kmax), ("page_flat", page_flat), ("page_new", page_new),
                    ("tok_page", tok_page), ("k", k)):
        if t.device != kmin.device:
            raise ValueError(f"{name} is on {t.device} but kmin is on {kmin.device}")
    for name, t in (("page_flat", page_flat), ("page_new", page_new), ("tok_page", tok_page)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on CUDA")


def quest_update_pages(kmin: torch.Tensor, kmax: torch.Tensor, page_flat: torch.Tensor,
                       page_new: torch.Tensor, tok_page: torch.Tensor, k: torch.Tensor) -> None:
    """Fold the keys k into the bounds of the pages they touch, in place, no host sync.

    kmin/kmax: (R, U, Hkv, D) fp16/bf16/fp32, the same strides; page_flat: (m,) int64 distinct
    ``row * U + page``; page_new: (m,) bool, the page's first token is in this step (its bounds
    restart); tok_page: (T,) int64 index into page_flat of each token of k (T, Hkv, D), any strides.
    The CUDA path also needs what the plan guarantees: tok_page non-decreasing, every page in
    [0, m) holding at least one token (a page's tokens are consecutive). m == 0 is a no-op.
    CUDA: one launch (plus k.to(kmin.dtype) when k has another dtype), no allocation, no sync.
    """
    if page_flat.shape[0] == 0:
        return
    if kmin.is_cuda:
        from . import triton_quest_update
        _check(kmin, kmax, page_flat, page_new, tok_page, k)
        triton_quest_update.quest_update_pages(kmin, kmax, page_flat, page_new, tok_page,
                                               k.to(kmin.dtype))
        return
    reference.quest_update_pages(kmin, kmax, page_flat, page_new, tok_page, k)
