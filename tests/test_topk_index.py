"""topk_index: each row's k largest scores as ascending indices, ties to the lowest index. The
reference is checked against torch.topk (as sets, on tie-free scores) and against a brute-force
(-score, index) ordering on scores full of ties; the top-k of the decode batch's select_resolve
kernel (ops/triton_select.py) must equal the reference exactly, on special scores too (ties,
-inf, signed zeros), through Triton's interpreter on CPU and on the GPU."""

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import decode_ops, reference

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


def select_top(launch, s: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k part of select_resolve (every page live, resident rows): its selection, as
    reference.topk_index's indices (ascending; the kernel pads with -1 past min(k, U))."""
    R, U = s.shape
    dev = s.device
    seq = torch.full((R,), U * 16 + 1, dtype=torch.int64, device=dev)
    full = torch.full((R,), U, dtype=torch.int64, device=dev)
    bt = torch.arange(U + 1, dtype=torch.int32, device=dev).repeat(R, 1)
    sel = torch.full((R, k), -7, dtype=torch.int32, device=dev)
    locs = torch.full_like(sel, -7)
    work = tuple(torch.zeros(sh, dtype=torch.int32, device=dev)
                 for sh in decode_ops.workspace_shapes(R, k, 1))
    launch(s, seq, full, k, bt, sel, locs, work)
    assert torch.equal(sel, locs), "resident rows: block i holds page i here"
    return sel.long()


def check_kernel(launch, dev):
    for case in CASES:
        R, U, k = case
        if k == 0:
            continue
        for j, kind in enumerate(KINDS):
            s = make_scores(R, U, kind, seed=sum(case) + j, dev=dev)
            want = reference.topk_index(s.cpu(), k)
            assert torch.equal(select_top(launch, s, k).cpu(), want), (case, kind)


def run_interpreter_cases():
    from vllm_hisparse.ops import triton_select

    def launch(s, seq, full, k, bt, sel, locs, work):
        triton_select.select_resolve(s, seq, full, k, bt, sel, locs, *work)

    for bits in (8, 11):                # 4 passes of 256 bins; 3 of up to 2048 bins
        triton_select.RADIX_BITS = bits
        check_kernel(launch, "cpu")
    print("interpreter ok")


def test_triton_kernel_in_interpreter():
    run_cases("test_topk_index")


# ---- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("bits", [8, 11])
def test_gpu_kernel_equals_reference(bits, monkeypatch):
    from vllm_hisparse.ops import triton_select
    monkeypatch.setattr(triton_select, "RADIX_BITS", bits)
    check_kernel(decode_ops.select_resolve, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("U", [4096, 16384])
def test_gpu_long_rows(U):
    """Rows of up to 16384 pages (256K tokens of 16-token pages) in one program."""
    s = make_scores(3, U, "neg_inf_tail", seed=U, dev="cuda")
    s[1] = torch.randint(0, 3, (U,), device="cuda").float()
    got = select_top(decode_ops.select_resolve, s, 1000)
    assert torch.equal(got.cpu(), reference.topk_index(s.cpu(), 1000))
