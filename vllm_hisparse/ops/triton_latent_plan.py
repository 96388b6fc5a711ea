"""``ops/latent_plan.materialize`` on CUDA (its plain-torch reference there): one launch, BLOCK
entries of the plan buffer a program; a token's entry also writes its host row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["delta"])    # a new value each step: no recompiles
def _materialize_kernel(BASE, META, HOST_ROW, TABLE, N, T, S0, D, delta, HAS_TABLE: tl.constexpr,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    x = tl.load(BASE + i, mask=inside, other=-1)
    adj = ((i < 2 * T) & (x >= 0)) | ((i >= S0) & (i < S0 + D) & (x > 0))
    y = tl.where(adj, x + delta, x)
    tl.store(META + i, y, mask=inside)
    tok = i < T
    h = tl.full([BLOCK], -1, tl.int64)
    if HAS_TABLE:
        h = tl.where(y >= 0, tl.load(TABLE + y, mask=tok & (y >= 0), other=-1).to(tl.int64), -1)
    tl.store(HOST_ROW + i, h, mask=tok)


def materialize(base: torch.Tensor, meta: torch.Tensor, host_row: torch.Tensor,
                table: torch.Tensor | None, delta: int, T: int, D: int) -> None:
    """Checked inputs (ops/latent_plan.py)."""
    N = base.shape[0]
    if table is not None and not table.is_contiguous():
        raise ValueError("the host page table must be contiguous")
    _materialize_kernel[(triton.cdiv(max(N, T), BLOCK),)](
        base, meta, host_row, base if table is None else table, N, T, 3 * T + 3 * D, D, delta,
        HAS_TABLE=table is not None, BLOCK=BLOCK, num_warps=4)
