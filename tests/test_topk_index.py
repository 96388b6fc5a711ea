"""topk_index (ops/quest.py): each row's k largest scores as ascending indices, ties to the lowest
index. The reference is checked against torch.topk (as sets, on tie-free scores) and against a
brute-force (-score, index) ordering on scores full of ties; the Triton kernel (ops/triton_topk.py)
must equal the reference exactly, through Triton's interpreter on CPU and on the GPU."""

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import reference
from vllm_hisparse.ops.quest import topk_index

# (R, U, k): k at 0, 1, U, U - 1; U not a power of two, one below / above a power of two, one score
CASES = [(3, 40, 9), (1, 1, 1), (2, 17, 17), (4, 33, 32), (5, 2081, 127), (2, 64, 0), (3, 300, 1),
         (2, 1023, 511)]
KINDS = ["random", "ties", "neg_inf_tail", "signed_zeros"]


def make_scores(R, U, kind, seed, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(R, U, generator=g)
    if kind == "ties":                       # a handful of distinct values: ties everywhere
        s = torch.randint(0, 4, (R, U), generator=g).float() - 1.5
    elif kind == "neg_inf_tail":             # Quest's pages past num_full score -inf
        n = torch.randint(0, U + 1, (R,), generator=g)
        s[torch.arange(U)[None] >= n[:, None]] = float("-inf")
    elif kind == "signed_zeros":
        s = torch.where(torch.rand(R, U, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
        s[:, ::7] = 1.0
    return s.to(dev)


def brute_force(s, k):
    out = []
    for row in s.cpu().tolist():
        key = [(-v, 0 if str(v) == "-0.0" else -1, i) for i, v in enumerate(row)]  # +0 above -0
        out.append(sorted(i for _, _, i in sorted(key)[:k]))
    return torch.tensor(out, dtype=torch.int64).reshape(len(out), k)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_the_ordered_top_k(case, kind):
    R, U, k = case
    s = make_scores(R, U, kind, seed=sum(case))
    got = reference.topk_index(s, k)
    assert got.dtype == torch.int64 and got.shape == (R, k)
    assert torch.equal(got, brute_force(s, k))
    if kind == "random" and k:
        want = torch.topk(s, k, dim=1)[1].sort(dim=1).values
        assert torch.equal(got, want)


def test_cpu_dispatch_is_the_reference():
    s = make_scores(3, 100, "ties", seed=1)
    assert torch.equal(topk_index(s, 10), reference.topk_index(s, 10))


@pytest.mark.parametrize("scores, k, match", [
    (torch.zeros(2, 5, dtype=torch.float16), 2, "float32"),
    (torch.zeros(5), 2, r"\(R, U\)"),
    (torch.zeros(2, 5), 6, "k=6"),
    (torch.zeros(2, 5), -1, "k=-1"),
])
def test_bad_arguments_are_named(scores, k, match):
    with pytest.raises(ValueError, match=match):
        topk_index(scores, k)


def check_kernel(launch, dev):
    for case in CASES:
        R, U, k = case
        for j, kind in enumerate(KINDS):
            s = make_scores(R, U, kind, seed=sum(case) + j, dev=dev)
            out = torch.full((R, k), -7, dtype=torch.int64, device=dev)
            got = launch(s, k, out)
            want = reference.topk_index(s.cpu(), k)
            assert torch.equal(got.cpu(), want), (case, kind)


def run_interpreter_cases():
    from vllm_hisparse.ops import triton_topk

    check_kernel(triton_topk.topk_index, "cpu")
    print("interpreter ok")


def test_triton_kernel_in_interpreter():
    run_cases("test_topk_index")


# ---- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.cuda
def test_gpu_kernel_equals_reference():
    from vllm_hisparse.ops import triton_topk

    check_kernel(triton_topk.topk_index, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("U", [4096, 16384, 16385])
def test_gpu_long_rows(U):
    """The largest row one program holds, and one past it (the reference path)."""
    s = make_scores(3, U, "neg_inf_tail", seed=U, dev="cuda")
    s[1] = torch.randint(0, 3, (U,), device="cuda").float()
    got = topk_index(s, 1000)
    assert got.is_cuda and torch.equal(got.cpu(), reference.topk_index(s.cpu(), 1000))


@pytest.mark.cuda
def test_gpu_strided_scores_and_cuda_graph():
    base = make_scores(4, 600, "ties", seed=3, dev="cuda")
    s = base[:, 50:550]                                  # a row stride wider than the row
    want = reference.topk_index(s.cpu(), 64)
    assert torch.equal(topk_index(s, 64).cpu(), want)
    static = s.contiguous()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = topk_index(static, 64)
    static.copy_(make_scores(4, 500, "random", seed=4, dev="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference.topk_index(static.cpu(), 64))
