"""quest_topk / quest_topk_locs (core/sparse_layer.py) give exactly what the torch code before the
one-launch topk_pages gave (kept below as OLD_*, its torch.topk indices put in ascending order as
topk_index returns them; random scores have no ties): int32 pages with -1 padding, and the
runtime's block lookup. The Triton topk_pages (ops/triton_quest.py) equals reference.topk_pages on
CPU through Triton's interpreter and on the GPU."""

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.ops import reference
from vllm_hisparse.ops.quest import quest_scores_rows, topk_pages

# (R, N, U, Hkv, G, D, k_units): k_units < U, == U, > U (padding columns), 0; a single row
CASES = [(5, 7, 40, 2, 2, 16, 9), (3, 4, 12, 1, 4, 8, 12), (4, 6, 10, 2, 1, 8, 15), (2, 3, 9, 1, 2, 8, 0),
         (1, 2, 33, 2, 2, 16, 31), (6, 6, 300, 1, 1, 16, 127)]


def old_quest_topk(q, kmin, kmax, rows, num_full, k_units):
    R, U = q.shape[0], kmin.shape[1]
    out = torch.full((R, k_units), -1, dtype=torch.int32, device=q.device)
    kk = min(k_units, U)
    if R == 0 or kk == 0:
        return out
    scores = quest_scores_rows(q, kmin, kmax, rows, num_full)
    idx = torch.topk(scores, kk, dim=1)[1].sort(dim=1).values
    idx = torch.where(idx < num_full.long()[:, None].to(idx.device), idx, -1)
    out[:, :kk] = idx.to(torch.int32)
    return out


def old_locs(sel, bt):
    """SparseRuntime.forward_layer's resident-mode slots before quest_topk_locs."""
    return torch.where(sel >= 0, torch.gather(bt, 1, sel.long().clamp(min=0)), -1).to(torch.int32)


def make_case(R, N, U, Hkv, G, D, k_units, seed, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, Hkv * G, D, generator=g)
    kmin = torch.randn(N, U, Hkv, D, generator=g)
    kmax = kmin + torch.rand(N, U, Hkv, D, generator=g)
    rows = torch.randint(0, N, (R,), generator=g)
    n = torch.randint(0, U + 1, (R,), generator=g)
    n[0] = 0                                              # no complete page yet
    if R > 1:
        n[1] = min(U, 2)                                  # fewer pages than k_units
    bt = torch.randint(0, 1000, (R, U + 3), generator=g)
    return [t.to(dev) for t in (q, kmin, kmax, rows, n, bt)] + [k_units]


@pytest.mark.parametrize("case", CASES)
def test_cpu_equals_old_code(case):
    q, kmin, kmax, rows, n, bt, k = make_case(*case, seed=sum(case))
    want = old_quest_topk(q, kmin, kmax, rows, n, k)
    sel = sl.quest_topk(q, kmin, kmax, rows, n, k)
    assert sel.dtype == torch.int32 and torch.equal(sel, want)
    sel2, locs = sl.quest_topk_locs(q, kmin, kmax, rows, n, k, bt)
    assert torch.equal(sel2, want) and locs.dtype == torch.int32 and torch.equal(locs, old_locs(want, bt))


def test_cpu_no_rows():
    q, kmin, kmax, rows, n, bt, k = make_case(*CASES[0], seed=1)
    sel, locs = sl.quest_topk_locs(q[:0], kmin, kmax, rows[:0], n[:0], k, bt[:0])
    assert sel.shape == locs.shape == (0, k)


# ---- the Triton kernel on CPU through Triton's interpreter ---------------------------------------
def topk_inputs(R, U, kk, seed, dev="cpu"):
    """torch.topk indices over scores with -inf past num_full (ties among them in any order)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, U + 1, (R,), generator=g)
    n[0] = 0
    s = torch.randn(R, U, generator=g).masked_fill(torch.arange(U)[None] >= n[:, None], float("-inf"))
    idx = torch.topk(s, kk, dim=1)[1]
    bt = torch.randint(0, 1 << 20, (R, U), generator=g)
    return idx.to(dev), n.to(dev), bt.to(dev)


def check_topk_pages(launch, dev="cpu"):
    for i, (R, U, kk, K, nint, btint) in enumerate([(4, 20, 7, 7, False, False), (3, 9, 9, 12, True, True),
                                                    (5, 2000, 1500, 1500, False, False),
                                                    (2, 5, 0, 3, False, True)]):
        idx, n, bt = topk_inputs(R, U, kk, 50 + i, dev)
        n = n.int() if nint else n
        bt = bt.int() if btint else bt
        want, want_b = reference.topk_pages(idx, n, K, bt)
        assert torch.equal(launch(idx, n, K), want)
        got, got_b = launch(idx, n, K, bt)
        assert torch.equal(got, want) and torch.equal(got_b, want_b), (R, U, kk, K)


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_quest

    def launch(idx, n, K, bt=None):
        out = torch.full((idx.shape[0], K), 7, dtype=torch.int32)
        blocks = None if bt is None else torch.full_like(out, 7)
        triton_quest.topk_pages(idx, n, out, bt, blocks)
        return out if bt is None else (out, blocks)

    check_topk_pages(launch)
    print("interpreter ok")


def test_triton_kernel_in_interpreter():
    run_cases("test_topk_pages")


# ---- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.cuda
def test_gpu_topk_pages_equals_reference():
    check_topk_pages(topk_pages, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_gpu_quest_topk_equals_old_code(case):
    q, kmin, kmax, rows, n, bt, k = make_case(*case, seed=sum(case), dev="cuda")
    want = old_quest_topk(q, kmin, kmax, rows, n, k)
    assert torch.equal(sl.quest_topk(q, kmin, kmax, rows, n, k), want)
    sel, locs = sl.quest_topk_locs(q, kmin, kmax, rows, n, k, bt)
    assert torch.equal(sel, want) and torch.equal(locs, old_locs(want, bt))
