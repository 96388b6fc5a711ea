"""ops/triton_latent_index.py's three glue kernels of the DSA read path against their plain-torch
references (ops/latent_index.py) on fresh random inputs, bit for bit, under Triton's interpreter:
region tokens and others, -1 and out-of-range selections, a selection buffer with a row stride
wider than K (a slice of vLLM's buffer), padding decode entries (gather past T: clipped)."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.ops import latent_index as li

from triton_interpreter import run_cases

CASES = [(1, 8, 40, 1), (7, 37, 90, 3), (12, 64, 130, 12), (5, 2048, 4096, 5)]   # T, K, len, n


def inputs(T, K, region_len, n, g):
    wide = torch.randint(-1, region_len + 20, (T, K + 5), generator=g, dtype=torch.int32)
    topk = wide[:, :K]                                     # row stride K + 5
    base = torch.randint(0, 4 * region_len, (T,), generator=g) * (torch.rand(T, generator=g) < 0.6)
    base = torch.where(base > 0, base, -1).long()
    base[0] = base[0].clamp(min=1)          # every case maps some rows and leaves some -1 (below):
    wide[0, :2] = torch.tensor([-1, 0])     # a T = 1 case drew base -1 on the H100 (2026-12-07)
    gather = torch.randint(0, T + 3, (n,), generator=g).long()     # >= T: a padding entry
    return topk, base, gather


def check(tli, case, seed) -> None:
    T, K, L, n = case
    g = torch.Generator().manual_seed(seed)
    topk, base, gather = inputs(T, K, L, n, g)
    out = torch.full((T, K), 7, dtype=torch.int32)
    ref = out.clone()
    tli.region_rows(topk, base, L, out)
    li.region_rows(topk, base, L, ref)
    assert torch.equal(out, ref), ("region_rows", case)
    assert (ref >= 0).any() and (ref == -1).any()
    sel, locs = torch.zeros(n, K, dtype=torch.int32), torch.zeros(n, K, dtype=torch.int32)
    rsel, rlocs = sel.clone(), locs.clone()
    tli.decode_selections(topk, gather, L, sel, locs)
    li.decode_selections(topk, gather, L, rsel, rlocs)
    assert torch.equal(sel, rsel) and torch.equal(locs, rlocs), ("decode_selections", case)
    for rows in (ref, torch.randint(-2, 3, (T, K), generator=g, dtype=torch.int32)):  # 0s too
        valid, rvalid = torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
        tli.valid_counts(rows, valid)
        li.valid_counts(rows, rvalid)
        assert torch.equal(valid, rvalid), ("valid_counts", case)


def run_interpreter_cases():
    from vllm_hisparse.ops import triton_latent_index as tli

    for i, case in enumerate(CASES):
        check(tli, case, 100 + i)
    print("interpreter ok")


def test_kernels_equal_the_references_in_the_interpreter():
    run_cases("test_latent_index_kernels")


def test_references_against_a_loop():
    """The references themselves against the rules written as a loop over entries."""
    T, K, L, n = 6, 9, 30, 4
    topk, base, gather = inputs(T, K, L, n, torch.Generator().manual_seed(7))
    out = torch.empty(T, K, dtype=torch.int32)
    li.region_rows(topk, base, L, out)
    sel, locs = torch.empty(n, K, dtype=torch.int32), torch.zeros(n, K, dtype=torch.int32)
    li.decode_selections(topk, gather, L, sel, locs)
    valid = torch.empty(T, dtype=torch.int32)
    li.valid_counts(out, valid)
    for t in range(T):
        for j in range(K):
            u, b = int(topk[t, j]), int(base[t])
            assert int(out[t, j]) == (b + u if b >= 0 and 0 <= u < L else -1)
        assert int(valid[t]) == sum(int(x) >= 0 for x in out[t])
    for d in range(n):
        t = min(int(gather[d]), T - 1)
        assert [int(x) for x in sel[d]] == [int(u) if int(u) < L else -1 for u in topk[t]]
    assert (locs == -1).all()


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_kernels_on_the_gpu(case):
    from vllm_hisparse.ops import triton_latent_index as tli

    class OnGpu:                      # the kernels on CUDA copies, results back for the compare
        @staticmethod
        def region_rows(topk, base, L, out):
            o = out.cuda()
            tli.region_rows(topk.cuda(), base.cuda(), L, o)
            out.copy_(o.cpu())

        @staticmethod
        def decode_selections(topk, gather, L, sel, locs):
            s, lo = sel.cuda(), locs.cuda()
            tli.decode_selections(topk.cuda(), gather.cuda(), L, s, lo)
            sel.copy_(s.cpu())
            locs.copy_(lo.cpu())

        @staticmethod
        def valid_counts(out, valid):
            v = valid.cuda()
            tli.valid_counts(out.cuda(), v)
            valid.copy_(v.cpu())

    check(OnGpu, case, 200)
