"""quest_scores_rows (ops/quest.py) == reference.quest_scores(q, kmin[rows], kmax[rows], n).

CPU: exactly the reference. The Triton kernel (ops/triton_quest.py) on CPU through Triton's
interpreter and on the GPU at serving shapes: within fp32 summation-order error of the fp32
reference and no more than 2x its error against fp64, identical -inf masks, the same top-k page
sets away from near-ties, and a row's bits independent of the rest of the batch.
"""

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import reference
from vllm_hisparse.ops.quest import quest_scores_rows

# (R, N, U, Hkv, G, D): GQA G=1 and 4, U not a multiple of any block, a single row and page
CPU_CASES = [(1, 1, 1, 1, 1, 8), (5, 3, 17, 2, 4, 16), (7, 9, 33, 4, 1, 64), (6, 4, 64, 1, 8, 32),
             (4, 6, 50, 2, 3, 24)]
# Triton interpreter: U around the block size (D=16 -> 256 pages, D=64 -> 64, D=128 -> 32),
# D not a power of two, G=1, 3, 4
INTERP_CASES = [(3, 5, 37, 2, 4, 64, torch.float32), (4, 3, 65, 1, 1, 64, torch.float32),
                (2, 4, 300, 2, 3, 16, torch.float32), (3, 2, 33, 2, 4, 128, torch.float16),
                (2, 3, 20, 1, 2, 24, torch.float32)]
# serving shapes: (R, Hq, Hkv, D, U)
GPU_CASES = [(64, 32, 8, 128, 2048), (64, 8, 8, 64, 2048)]
GPU_DTYPES = [torch.bfloat16, torch.float16]
# |kernel - reference| <= REL * sum_{h,g,d} |q| * max(|kmin|, |kmax|) (>= sum of |terms|). Both
# sum the same fp32 products in different orders: the kernel folds the G query heads first (G
# roundings), adds the Hkv heads in sequence and D as a tree, so its worst case is about
# (G + Hkv + log2 D + 2) * 2^-24 ~ 1.3e-6 of sum |terms| at G=4, Hkv=8, D=128; torch's reduction
# adds its own. 1e-5 leaves room for both and is still 1e5x below a dropped or doubled head.
REL = 1e-5


def bounds_from_keys(N, U, Hkv, D, page, dtype, gen):
    """kmin/kmax (N, U, Hkv, D) on gen's device: the real per-page min/max of random keys with
    per-channel offsets and scales (real keys have outlier channels), built a few rows at a time."""
    dev = gen.device
    scale = torch.rand(Hkv, D, generator=gen, device=dev).mul(3).add(0.2)
    shift = torch.randn(Hkv, D, generator=gen, device=dev)
    kmin = torch.empty(N, U, Hkv, D, dtype=dtype, device=dev)
    kmax = torch.empty_like(kmin)
    for i in range(0, N, 8):
        c = min(8, N - i)
        keys = torch.randn(c, U, page, Hkv, D, generator=gen, device=dev) * scale + shift
        kmin[i:i + c], kmax[i:i + c] = keys.amin(2).to(dtype), keys.amax(2).to(dtype)
    return kmin, kmax


def random_inputs(R, N, U, Hkv, G, D, dtype, gen, page=4):
    """q, kmin, kmax, rows (with repeats), num_units (0 and U included, one > U) on gen's device;
    pages no row scores, and rows no one picks, hold NaN: they must never reach a score."""
    dev = gen.device
    q = torch.randn(R, Hkv * G, D, generator=gen, device=dev).to(dtype)
    kmin, kmax = bounds_from_keys(N, U, Hkv, D, page, dtype, gen)
    rows = torch.randint(0, N, (R,), generator=gen, device=dev)
    n = torch.randint(0, U + 1, (R,), generator=gen, device=dev)
    n[0] = 0
    if R > 1:
        n[1] = U
        rows[-1] = rows[0]
    if R > 2:
        n[2] = U + 3
    used = torch.zeros(N, dtype=torch.long, device=dev)
    used.scatter_reduce_(0, rows, n.clamp(max=U), "amax")
    for r, u in enumerate(used.tolist()):
        kmin[r, u:] = float("nan")
        kmax[r, u:] = float("nan")
    return q, kmin, kmax, rows, n.int()


def reference_rows(q, kmin, kmax, rows, n, chunk=8):
    """The reference on gathered rows, a few rows at a time (its temporaries are (R, U, Hkv, G, D))."""
    return torch.cat([reference.quest_scores(q[i:i + chunk], kmin[rows[i:i + chunk]],
                                             kmax[rows[i:i + chunk]], n[i:i + chunk])
                      for i in range(0, q.shape[0], chunk)])


def truth_rows(q, kmin, kmax, rows, n, chunk=4):
    """The reference's formula in fp64, a few rows at a time."""
    R, Hq, D = q.shape
    U, Hkv = kmin.shape[1], kmin.shape[2]
    out = []
    for i in range(0, R, chunk):
        qd = q[i:i + chunk].double().view(-1, 1, Hkv, Hq // Hkv, D)
        a = qd * kmin[rows[i:i + chunk]].double()[:, :, :, None]
        b = qd * kmax[rows[i:i + chunk]].double()[:, :, :, None]
        out.append(torch.maximum(a, b).sum((2, 3, 4)))
    live = torch.arange(U, device=q.device)[None] < n.long()[:, None]
    return torch.cat(out).masked_fill(~live, float("-inf"))


def abs_bound(q, kmin, kmax, rows):
    """(R, 1) sum over h, g, d of |q| * max(|kmin|, |kmax|), the largest page of each row."""
    R, Hq, D = q.shape
    Hkv = kmin.shape[2]
    qa = q.float().abs().view(R, Hkv, Hq // Hkv, D).sum(2)                    # (R, Hkv, D)
    out = []
    for r in range(R):
        m = torch.maximum(kmin[rows[r]].float().abs(), kmax[rows[r]].float().abs()).nan_to_num(0.0)
        out.append((m * qa[r]).sum((1, 2)).max())
    return torch.stack(out)[:, None]


def assert_close_to_reference(s, ref, q, kmin, kmax, rows, n):
    assert s.shape == ref.shape and s.dtype == torch.float32
    assert torch.equal(torch.isneginf(s), torch.isneginf(ref)), "-inf masks differ"
    assert torch.isfinite(s[~torch.isneginf(ref)]).all(), "NaN/inf leaked into a live page"
    tol = (REL * abs_bound(q, kmin, kmax, rows)).expand_as(s)
    live = ~torch.isneginf(ref)
    err = (s - ref).abs()
    assert (err[live] <= tol[live]).all(), f"max err {err[live].max()} > tol {tol[live].min()}"
    torch.testing.assert_close(s[live], ref[live], rtol=REL, atol=float(tol.max()))
    # and no worse than torch's own fp32 (the reference) against fp64, the FlashAttention rule
    truth = truth_rows(q, kmin, kmax, rows, n)[live]
    err_kernel = float((s[live].double() - truth).abs().max())
    err_torch = float((ref[live].double() - truth).abs().max())
    ulp = 2.0 ** -24 * float(truth.abs().max())             # floor: one rounding of the largest score
    assert err_kernel <= 2 * err_torch + ulp, f"kernel err {err_kernel} > 2 x torch fp32 err {err_torch}"


# ---- CPU: the dispatcher is the reference --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CPU_CASES)
def test_cpu_equals_reference_on_gathered_rows(case, dtype):
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    q, kmin, kmax, rows, n = random_inputs(*case, dtype, gen)
    s = quest_scores_rows(q, kmin, kmax, rows, n)
    assert torch.equal(s, reference.quest_scores(q, kmin[rows], kmax[rows], n))
    out = torch.full_like(s, 7.0)
    assert quest_scores_rows(q, kmin, kmax, rows, n, out=out) is out and torch.equal(out, s)


def test_cpu_padding_row_is_all_neg_inf():
    gen = torch.Generator().manual_seed(1)
    q, kmin, kmax, _, _ = random_inputs(2, 3, 9, 2, 2, 8, torch.float32, gen)
    s = quest_scores_rows(q, kmin, kmax, torch.tensor([-1, 0]), torch.tensor([0, 0]))
    assert torch.isneginf(s).all()


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(kmin=a["kmin"][..., :4]), "kmin must be"),
    (lambda a: a.update(kmax=a["kmax"].double()), "kmax must match"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of kmin's Hkv"),
    (lambda a: a.update(rows=a["rows"].int()), "rows must be"),
    (lambda a: a.update(num_units=a["num_units"][:1]), "num_units must be"),
    (lambda a: a.update(num_units=a["num_units"].float()), "num_units must be"),
    (lambda a: a.update(out=torch.empty(2, 8)), "out must be"),
])
def test_bad_arguments_are_named(change, match):
    gen = torch.Generator().manual_seed(2)
    q, kmin, kmax, rows, n = random_inputs(2, 3, 9, 2, 2, 8, torch.float32, gen)
    args = dict(q=q, kmin=kmin, kmax=kmax, rows=rows, num_units=n)
    change(args)
    with pytest.raises(ValueError, match=match):
        quest_scores_rows(**args)


# ---- the Triton kernel on CPU through Triton's interpreter ---------------------------------------
def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_quest
    for i, (R, N, U, Hkv, G, D, dtype) in enumerate(INTERP_CASES):
        gen = torch.Generator().manual_seed(10 + i)
        q, kmin, kmax, rows, n = random_inputs(R, N, U, Hkv, G, D, dtype, gen)
        rows[0] = -1                                     # num_units[0] == 0: padding, never read
        out = torch.full((R, U), 7.0)
        s = triton_quest.quest_scores_rows(q, kmin, kmax, rows, n, out)
        rows[0] = 0
        assert_close_to_reference(s, reference_rows(q, kmin, kmax, rows, n), q, kmin, kmax, rows, n)
    print("interpreter ok")


def test_triton_kernel_in_interpreter():
    run_cases("test_quest_rows")


# ---- the Triton kernel on the GPU --------------------------------------------------------------
def gpu_inputs(R, Hq, Hkv, D, U, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return random_inputs(R, R + 16, U, Hkv, Hq // Hkv, D, dtype, gen)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_fp32_reference_and_topk(case, dtype):
    q, kmin, kmax, rows, n = gpu_inputs(*case, dtype, seed=sum(case))
    s = quest_scores_rows(q, kmin, kmax, rows, n)
    ref = reference_rows(q, kmin, kmax, rows, n)
    assert_close_to_reference(s, ref, q, kmin, kmax, rows, n)
    # Top-k pages: if every score moved by at most e and the reference's k-th and (k+1)-th scores
    # are more than 2e apart, the selected set cannot change; elsewhere compare selected-score sums.
    k = 128
    compared = 0
    for r in range(s.shape[0]):
        if int(n[r]) <= k:
            continue
        live = ~torch.isneginf(ref[r])
        e = float((s[r] - ref[r]).abs()[live].max())
        rv, ri = torch.topk(ref[r], k + 1)
        _, si = torch.topk(s[r], k)
        if float(rv[k - 1] - rv[k]) > 2 * e:
            assert set(si.tolist()) == set(ri[:k].tolist()), f"row {r}: top-{k} sets differ"
            compared += 1
        assert float(ref[r][si].sum()) >= float(rv[:k].sum()) - 2 * k * e
    assert compared > 0


@pytest.mark.cuda
def test_gpu_row_bits_do_not_depend_on_the_batch():
    R, Hq, Hkv, D, U = GPU_CASES[0]
    q, kmin, kmax, rows, n = gpu_inputs(R, Hq, Hkv, D, U, torch.bfloat16, seed=5)
    a = quest_scores_rows(q, kmin, kmax, rows, n)
    assert torch.equal(a, quest_scores_rows(q, kmin, kmax, rows, n))
    for x in (1, 5):                        # num_units U, and a random one
        perm = torch.randperm(R, device="cuda")[:17]
        perm = torch.cat([perm[perm != x], torch.tensor([x], device="cuda")])
        b = quest_scores_rows(q[perm], kmin, kmax, rows[perm], n[perm])
        c = quest_scores_rows(q[x:x + 1], kmin, kmax, rows[x:x + 1], n[x:x + 1])
        assert torch.equal(a[x], b[-1]) and torch.equal(a[x], c[0])


@pytest.mark.cuda
def test_gpu_padding_rows_out_and_cuda_graph():
    R, Hq, Hkv, D, U = 8, 32, 8, 128, 300
    q, kmin, kmax, rows, n = gpu_inputs(R, Hq, Hkv, D, U, torch.float16, seed=6)
    rows[0], n[0] = -1, 0                   # CUDA-graph padding row: reads nothing, all -inf
    out = torch.full((R, U), 7.0, device="cuda")
    quest_scores_rows(q, kmin, kmax, rows, n, out=out)
    assert torch.isneginf(out[0]).all()
    want = out.clone()
    out.fill_(7.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quest_scores_rows(q, kmin, kmax, rows, n, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
