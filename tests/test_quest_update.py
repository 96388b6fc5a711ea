"""ops.quest_update.quest_update_pages: the one-launch Triton update (ops/triton_quest_update.py)
leaves the same bits in kmin/kmax as the torch reference (reference.quest_update_pages), which
equals reference.quest_update. Cases: decode (one token per page), prefill chunks that start mid-page
and cross pages, mixed batches, a page whose old bounds are kept, bf16/fp16/fp32, keys as a strided
view (the fused qkv output), NaN keys (same NaN positions; a NaN's payload may differ).
CPU through Triton's interpreter; GPU marked ``cuda``.
"""

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import reference
from vllm_hisparse.ops.quest_update import quest_update_pages

# (page size, rows, U, Hkv, D, spans (row, start, end) in batch order)
DECODE = (16, 6, 12, 2, 64, [(0, 37, 38), (1, 16, 17), (2, 0, 1), (3, 100, 101), (5, 47, 48)])
PREFILL = (16, 3, 12, 2, 32, [(0, 21, 75), (2, 0, 17)])
MIXED = (8, 5, 40, 4, 16, [(0, 21, 45), (1, 30, 31), (2, 0, 17), (4, 63, 64), (3, 7, 300)])
ONE_PAGE = (4, 2, 3, 1, 8, [(1, 5, 6)])
CASES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED, "one_page": ONE_PAGE}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def plan_pages(spans, P, U):
    """page_flat, page_new, tok_page as SparseRuntime._plan_writes builds them."""
    qp, qn, qtp, rows, pos, base = [], [], [], [], [], 0
    for r, s, e in spans:
        p = torch.arange(s, e)
        pages = torch.arange(s // P, (e - 1) // P + 1)
        qtp.append(p // P - s // P + base)
        qp.append(r * U + pages)
        qn.append(pages * P >= s)
        rows.append(torch.full((e - s,), r))
        pos.append(p)
        base += len(pages)
    return torch.cat(qp), torch.cat(qn), torch.cat(qtp), torch.cat(rows), torch.cat(pos)


def make_case(name, dtype, seed, strided=False, nan=False):
    P, R, U, Hkv, D, spans = CASES[name]
    g = torch.Generator().manual_seed(seed)
    kmin = torch.randn(R, U, Hkv, D, generator=g).to(dtype)
    kmax = kmin + torch.rand(R, U, Hkv, D, generator=g).to(dtype)
    page, new, tp, rows, pos = plan_pages(spans, P, U)
    T = len(tp)
    if strided:                                         # k as a slice of a wider qkv row
        k = torch.randn(T, 3 * Hkv * D, generator=g).to(dtype)[:, Hkv * D:2 * Hkv * D].view(T, Hkv, D)
    else:
        k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    if nan:
        k[T // 2, 0, 1] = float("nan")
    return kmin, kmax, page, new, tp, k, rows, pos, P


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b):
    """Bit-identical, except that a NaN may be any NaN (payloads differ between torch ops)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def check_case(name, dtype, seed, launch, strided=False, nan=False, device="cpu"):
    kmin, kmax, page, new, tp, k, rows, pos, P = make_case(name, dtype, seed, strided, nan)
    kmin, kmax, page, new, tp, k = (t.to(device) for t in (kmin, kmax, page, new, tp, k))
    rmin, rmax = kmin.clone(), kmax.clone()
    reference.quest_update_pages(rmin, rmax, page, new, tp, k)
    launch(kmin, kmax, page, new, tp, k)
    assert same(kmin, rmin) and same(kmax, rmax), (name, dtype)
    return rmin, rmax, rows, pos, P, k


# ---- CPU: the dispatcher is the reference, which equals reference.quest_update ------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_equals_reference_quest_update(name, dtype):
    kmin, kmax, page, new, tp, k, rows, pos, P = make_case(name, dtype, seed=3)
    a_min, a_max = kmin.clone(), kmax.clone()
    quest_update_pages(a_min, a_max, page, new, tp, k)
    reference.quest_update(kmin, kmax, rows, pos, k, P)
    assert torch.equal(a_min, kmin) and torch.equal(a_max, kmax)


def test_empty_step_is_a_no_op():
    kmin = torch.randn(2, 3, 1, 8)
    kmax = kmin.clone()
    e = torch.empty(0, dtype=torch.int64)
    quest_update_pages(kmin, kmax, e, e.bool(), e, torch.empty(0, 1, 8))
    assert torch.equal(kmin, kmax)


# ---- the Triton kernel on CPU through Triton's interpreter ---------------------------------------
def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_quest_update as tq
    for i, name in enumerate(CASES):
        for dtype in DTYPES[:2]:
            check_case(name, dtype, 20 + i, tq.quest_update_pages)
    check_case("prefill", torch.float16, 6, tq.quest_update_pages)
    check_case("mixed", torch.bfloat16, 7, tq.quest_update_pages, strided=True)
    check_case("prefill", torch.float32, 8, tq.quest_update_pages, nan=True)
    check_case("decode", torch.float32, 9, tq.quest_update_pages, nan=True)
    print("interpreter ok")


def test_triton_kernel_in_interpreter():
    run_cases("test_quest_update")


# ---- the Triton kernel on the GPU --------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_equals_reference(name, dtype):
    check_case(name, dtype, 30, quest_update_pages, device="cuda")
    check_case(name, dtype, 31, quest_update_pages, strided=True, nan=True, device="cuda")


@pytest.mark.cuda
def test_gpu_fp32_keys_into_bf16_bounds_and_cuda_graph():
    kmin, kmax, page, new, tp, k, *_ = make_case("mixed", torch.bfloat16, 5)
    kmin, kmax, page, new, tp = (t.cuda() for t in (kmin, kmax, page, new, tp))
    k = torch.randn(k.shape, device="cuda")              # fp32 keys: rounded to bf16 like torch's .to
    rmin, rmax = kmin.clone(), kmax.clone()
    reference.quest_update_pages(rmin, rmax, page, new, tp, k)
    a_min, a_max = kmin.clone(), kmax.clone()
    quest_update_pages(a_min, a_max, page, new, tp, k)
    assert torch.equal(bits(a_min), bits(rmin)) and torch.equal(bits(a_max), bits(rmax))
    kb = k.bfloat16()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        quest_update_pages(kmin, kmax, page, new, tp, kb)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(kmin), bits(rmin)) and torch.equal(bits(kmax), bits(rmax))


@pytest.mark.cuda
def test_gpu_serving_shapes():
    """32 decode rows (one token per page), then a 2048-token prefill chunk plus 31 decode rows."""
    P, U, Hkv, D, R = 16, 2048, 8, 128, 64
    g = torch.Generator().manual_seed(11)
    for spans in ([(r, 1000 + 7 * r, 1001 + 7 * r) for r in range(32)],
                  [(0, 4100, 6148)] + [(r, 3000 + r, 3001 + r) for r in range(1, 32)]):
        kmin = torch.randn(R, U, Hkv, D, generator=g).bfloat16().cuda()
        kmax = kmin + 1
        page, new, tp, _, _ = (t.cuda() for t in plan_pages(spans, P, U))
        k = torch.randn(len(tp), Hkv, D, generator=g).bfloat16().cuda()
        rmin, rmax = kmin.clone(), kmax.clone()
        reference.quest_update_pages(rmin, rmax, page, new, tp, k)
        quest_update_pages(kmin, kmax, page, new, tp, k)
        assert torch.equal(bits(kmin), bits(rmin)) and torch.equal(bits(kmax), bits(rmax))
