"""The union of several query tokens' selections of one request (DSA speculative decoding,
core/latent_spec.py): what RESOLVE runs on once per request instead of once per token, so that
two tokens of one request never pick victims in the same hot slots.

Per request row r with n query tokens, token j at position ``pos[r, j]`` selected
``sel[r, j, :]`` (its indexer top-k, logical positions). Each entry is causally masked to its
token's position (``0 <= u <= pos[r, j]``, else -1), then the row's n x K entries are read in
token order (token 0's selection in its order, then token 1's, ...) and every position keeps its
FIRST occurrence: ``union`` holds it there and -1 at its later occurrences, ``first`` says for
each entry where that first occurrence is. After RESOLVE of ``union`` into ``locs`` (pool rows,
aligned with ``union``), token j's rows are ``gather(locs, 1, first)[:, j*K:(j+1)*K]``. With one
token (n = 1) and a selection of distinct positions, ``union`` is the masked selection itself, in
its order (so RESOLVE decides exactly as for today's one decode token per request).

``selection_union`` is plain torch with fixed shapes and no host sync (a stable sort, a cummax,
a scatter: capturable in a CUDA graph); ``selection_union_reference`` is the loop it must equal
(tests/test_dsa_spec_union.py).
"""
from __future__ import annotations

import torch


def _check(sel: torch.Tensor, pos: torch.Tensor) -> None:
    if sel.dim() != 3 or pos.shape != sel.shape[:2]:
        raise ValueError(f"sel must be (R, n, K) and pos (R, n); got {tuple(sel.shape)} and "
                         f"{tuple(pos.shape)}")


def selection_union_reference(sel: torch.Tensor, pos: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(union (R, n*K) int32, -1 = none; first (R, n*K) int64) of sel (R, n, K) int logical
    positions, -1 = none (anywhere), and pos (R, n) int each token's position, -1 = no token."""
    _check(sel, pos)
    R, n, K = sel.shape
    union = torch.full((R, n * K), -1, dtype=torch.int32)
    first = torch.arange(n * K, dtype=torch.int64).repeat(R, 1)
    for r in range(R):
        seen: dict[int, int] = {}
        for j in range(n):
            p = int(pos[r, j])
            for i in range(K):
                u, m = int(sel[r, j, i]), j * K + i
                if p < 0 or u < 0 or u > p:
                    continue
                if u in seen:
                    first[r, m] = seen[u]
                else:
                    seen[u] = m
                    union[r, m] = u
    return union.to(sel.device), first.to(sel.device)


def selection_union(sel: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """selection_union_reference's result (shapes there), vectorised: fixed shapes, no host
    sync."""
    _check(sel, pos)
    R, n, K = sel.shape
    M = n * K
    p = pos.long()[:, :, None]
    s = sel.long()
    flat = torch.where((p >= 0) & (s >= 0) & (s <= p), s, -1).reshape(R, M)
    idx = torch.arange(M, device=sel.device).expand(R, M)
    # a stable sort puts each position's occurrences together, its first occurrence first
    key, order = torch.sort(flat, dim=1, stable=True)
    new = torch.ones_like(key, dtype=torch.bool)
    new[:, 1:] = key[:, 1:] != key[:, :-1]
    head = torch.where(new, idx, 0).cummax(1).values          # sorted index of the group's head
    first = torch.empty_like(order).scatter_(1, order, torch.gather(order, 1, head))
    live = flat >= 0
    first = torch.where(live, first, idx)
    union = torch.where(live & (first == idx), flat, -1).to(torch.int32)
    return union, first
