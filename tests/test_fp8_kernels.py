"""fp8 (e4m3) KV in the kernels that read K/V values (ops/fp8.py): the quantization step, the
decode attention kernels (sparse with the newest page, dense split-KV, the fused pair with misses
read from an fp8 host pool) against the plain-torch reference in fp32/fp64 (kernel error <= 2x
torch's own error in the query's dtype), and Quest's page bounds and scores from fp8 keys (the
sync-free update, decode_write's fold and the fused write + score) against the reference, bit for
bit. Triton runs in its interpreter on the CPU (fp16 and fp32 queries: the interpreter's bf16 is
not faithful) and for real on the GPU."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import decode_ops, reference
from vllm_hisparse.ops.fp8 import FP8, FP8_MAX, quantize

# (R, Hq, Hkv, D, P, k selected, max dense seq)
ATTN_CASES = [(5, 8, 2, 64, 4, 5, 300), (3, 16, 2, 128, 8, 9, 33)]
QDTYPES = [torch.float16, torch.float32]
KV_SPREAD = 6.0                       # random K/V values span e4m3's normal and subnormal range


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def fp8_rand(*shape, gen, spread=KV_SPREAD) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * spread).to(FP8)


# ---- the quantization step ------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 0.37, 4.0])
def test_quantize_rounds_to_the_nearest_e4m3_and_saturates(scale):
    gen = torch.Generator().manual_seed(int(scale * 100))
    x = torch.randn(4096, generator=gen, dtype=torch.float64) * 100 * scale
    x[:4] = torch.tensor([1e6, -1e6, 448.0 * scale * 1.06, float("nan")], dtype=torch.float64)
    got = quantize(x.float(), scale)
    assert got.dtype == FP8
    deq = got.double() * scale
    assert deq[0] == FP8_MAX * scale and deq[1] == -FP8_MAX * scale and deq[2] == FP8_MAX * scale
    assert torch.isnan(deq[3])
    # every finite e4m3 value (256 bytes minus NaNs) with the scale: the nearest one was taken
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).double()
    grid = grid[torch.isfinite(grid)] * scale
    y = x[4:].clamp(-FP8_MAX * scale, FP8_MAX * scale)
    best = (grid[None, :] - y[:, None]).abs().min(1).values
    err = (deq[4:] - y).abs()
    # fp32 division first: within fp32 rounding of the nearest grid point
    assert (err <= best + 1e-6 * y.abs() + 1e-12).all()
    # values on the grid (times a power-of-two scale: exact in fp32) come back byte for byte
    on = fp8_rand(512, gen=gen)
    assert torch.equal(u8(quantize(on.float(), 1.0)), u8(on))
    assert torch.equal(u8(quantize(on.float() * 4.0, 4.0)), u8(on))


def test_cpu_attention_of_fp8_equals_the_widened_cache():
    """The CPU path (the references) reads fp8 as its widened values: the same bits as a cache in
    the query's dtype holding them."""
    gen = torch.Generator().manual_seed(5)
    from test_decode_attention import mixed_batch
    from vllm_hisparse.ops import kernels
    q, kv, bt, locs, units, sp, newest, dn, out = mixed_batch(*ATTN_CASES[0], torch.float32, gen)
    kv8 = (kv * KV_SPREAD).to(FP8)
    a = kernels.decode_attention(q, kv8, bt, locs, units, sp, newest, dn, 0.1, out.clone(), ())
    b = kernels.decode_attention(q, kv8.float(), bt, locs, units, sp, newest, dn, 0.1,
                                 out.clone(), ())
    assert torch.equal(a, b) and not torch.equal(a, out)


# ---- attention: Triton vs the reference --------------------------------------------------------
def _lowp_sparse(q, kv, locs, units, seq, scale, extra, elen):
    from test_kernels_attention import _torch_lowp
    return _torch_lowp(q, kv.to(q.dtype), locs, units, seq, scale,
                       None if extra is None else extra.to(q.dtype), elen)


def _bound(got, ref, low, what):
    err = (got.double() - ref).abs().max().item()
    err_pt = (low.double() - ref).abs().max().item()
    assert not got.isnan().any(), what
    assert err <= 2 * err_pt + 1e-4, f"{what}: kernel err {err} vs torch {err_pt}"


def check_sparse(case, qdt, gen, dev="cpu"):
    from test_kernels_attention import _newest_inputs
    from vllm_hisparse.ops import triton_attention as ta
    R, Hq, Hkv, D, P, k, _ = case
    q, kv, locs, units, seq, newest, extra, elen = _newest_inputs(R, Hq, Hkv, D, P, k,
                                                                  torch.float32, gen, "cpu")
    q = q.to(qdt)
    kv8 = (kv * KV_SPREAD).to(FP8)                  # NaN rows stay NaN: never attended
    extra8 = kv8[newest].transpose(1, 2).contiguous()
    d = [x.to(dev) for x in (q, kv8, locs, units, seq, newest)]
    got = ta.sparse_decode_attention_newest(*d[:5], d[5], D ** -0.5).cpu()
    ref = reference.sparse_decode_attention(q.double(), kv8.double(), locs, units, seq,
                                            D ** -0.5, extra8.double(), elen)
    low = _lowp_sparse(q, kv8, locs, units, seq, D ** -0.5, extra8, elen)
    _bound(got, ref, low, f"sparse {case} {qdt}")
    # the same rows gathered as extra keys (the verify rows' call): the same bits
    gathered = ta.sparse_decode_attention(*d[:5], D ** -0.5, extra8.to(dev), elen.to(dev)).cpu()
    assert torch.equal(gathered, got), f"sparse with extra keys {case} {qdt}"


def check_dense(case, qdt, gen, dev="cpu"):
    from vllm_hisparse.ops import triton_dense_decode as td
    R, Hq, Hkv, D, P, _, max_seq = case
    W = -(-max_seq // P)
    N = R * W + 3
    kv8 = fp8_rand(N, 2, P, Hkv, D, gen=gen)
    q = torch.randn(R, Hq, D, generator=gen).to(qdt)
    bt = torch.randperm(N, generator=gen)[:R * W].view(R, W).int()
    seq = torch.randint(1, max_seq + 1, (R,), generator=gen).int()
    seq[0], seq[-1] = max_seq, 0
    got = td.dense_decode_attention(q.to(dev), kv8[:, 0].to(dev), kv8[:, 1].to(dev), bt.to(dev),
                                    seq.to(dev), D ** -0.5).cpu()
    ref = reference.dense_decode_attention(q.double(), kv8[:, 0].double(), kv8[:, 1].double(),
                                           bt, seq, D ** -0.5)
    low = torch.zeros_like(q)
    for r in range(R):             # torch in the query's dtype over the row's keys
        n = int(seq[r])
        if n:
            blocks = bt[r, :-(-n // P)].long()
            kk = kv8[blocks, 0].reshape(-1, Hkv, D)[:n].to(qdt)
            vv = kv8[blocks, 1].reshape(-1, Hkv, D)[:n].to(qdt)
            qq = q[r].view(Hkv, Hq // Hkv, D)
            s = torch.einsum("hgd,thd->hgt", qq, kk).float() * D ** -0.5
            p = torch.softmax(s, -1).to(qdt)
            low[r] = torch.einsum("hgt,thd->hgd", p, vv).reshape(Hq, D)
    _bound(got, ref, low, f"dense {case} {qdt}")


def check_two(qdt, gen):
    """dense_decode_two over two fp8 caches (vLLM's and the dense pool): each row within fp16
    rounding of the fp32 reference over its own cache; rows of neither keep their out row."""
    from test_dense_decode_two import INTERP_CASES, _row_reference, _two_inputs, _work
    from vllm_hisparse.ops import triton_dense_decode as td
    q, kv, bt, seq_k, kv2, t2, rows2, seq2 = _two_inputs(INTERP_CASES[1], torch.float32, gen,
                                                         "cpu")
    q, kv, kv2 = q.to(qdt), (kv * KV_SPREAD).to(FP8), (kv2 * KV_SPREAD).to(FP8)
    out = torch.full_like(q, 7.0)
    td.dense_decode_two(q, kv, bt, seq_k, kv2, t2, rows2, seq2, 0.1, out, _work(q))
    want = _row_reference(q, kv, bt, seq_k, kv2, t2, rows2, seq2)
    assert any(w is None for w in want) and any(w is not None for w in want)
    for r, w in enumerate(want):
        if w is None:
            assert (out[r] == 7.0).all(), f"row {r} of neither kind was written"
        else:
            torch.testing.assert_close(out[r].float(), w, rtol=2e-2, atol=2e-2)


def check_fused_with_misses(case, qdt, gen):
    """The fused pair over an fp8 cache whose missed pages sit in an fp8 host pool: the same bits
    as the two kernels over the resident cache, and each missed block ends up holding its host
    page byte for byte."""
    from test_decode_attention import fused, mixed_batch, separate, with_misses
    t = mixed_batch(*case, torch.float32, gen)
    q, kv = t[0].to(qdt), (t[1] * KV_SPREAD).to(FP8)
    out = t[-1].to(qdt)
    t = [q, kv, *t[2:-1], out]
    want = separate(*t[:-1], out.clone(), case[3] ** -0.5)
    (q2, kvm, bt, locs, units, sp, newest, dn, _), (rows, hpt, host, missed) = \
        with_misses(t, gen)
    assert host.dtype == FP8 and kvm.dtype == FP8
    from vllm_hisparse.ops import triton_decode_attention as tda
    R, Hq, D = q.shape
    work = tuple(torch.empty(n, dtype=torch.float32)
                 for n in tda.partials_numel(R, Hq, kv.shape[3], locs.shape[1], kv.shape[2], D))
    got = tda.decode_attention(q2, kvm, bt, locs, units, sp, newest, dn, case[3] ** -0.5,
                               out.clone(), work, (rows, hpt, host, missed))
    assert torch.equal(got, want), f"fused with misses {case} {qdt}"
    marked = (sp > 0)[:, None] & (locs <= -2)
    r, j = torch.nonzero(marked, as_tuple=True)
    assert len(r) > 0
    blocks = (-2 - locs[r, j]).long()
    pages = hpt[rows[r].long(), units[r, j].long()].long()
    assert torch.equal(u8(kvm[blocks]), u8(host[pages])), "a fetched block is not its host page"
    assert torch.equal(u8(kvm[blocks]), u8(kv[blocks]))


# ---- Quest from fp8 keys -----------------------------------------------------------------------
def check_quest_update(bounds_dtype, seed, launch):
    from test_quest_update import make_case, same
    kmin, kmax, page, new, tp, k, *_ = make_case("mixed", bounds_dtype, seed)
    k8 = (k.float() * KV_SPREAD).to(FP8)
    rmin, rmax = kmin.clone(), kmax.clone()
    reference.quest_update_pages(rmin, rmax, page, new, tp, k8)
    launch(kmin, kmax, page, new, tp, k8)
    assert same(kmin, rmin) and same(kmax, rmax), bounds_dtype
    # the bounds are the widened fp8 keys' (what the attention reads), exactly
    ref2min, ref2max = kmin.clone(), kmax.clone()
    reference.quest_update_pages(ref2min, ref2max, page, new, tp, k8.to(bounds_dtype))
    assert same(rmin, ref2min) and same(rmax, ref2max)


def fp8_write_inputs(case, gen, bounds_dtype=torch.float32):
    """test_decode_ops.write_inputs with the cache, k/v and the second pool fp8."""
    from test_decode_ops import write_inputs
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page = write_inputs(*case, gen)
    to8 = lambda x: (x * KV_SPREAD).to(FP8)              # noqa: E731
    return [to8(kv), bt, seq, to8(k), to8(v), to8(dst), dst_page, kmin.to(bounds_dtype),
            kmax.to(bounds_dtype), q_page]


def run_write(fn, t):
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page = [x.clone() for x in t]
    newest = torch.full((len(seq),), 7, dtype=torch.int32)
    fn(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax, q_page)
    return kv, dst, kmin, kmax, newest


def check_write(case, gen, fn, bounds_dtype):
    t = fp8_write_inputs(case, gen, bounds_dtype)
    want = run_write(reference.decode_write, t)
    got = run_write(fn, t)
    for name, x, y in zip(("kv", "dst", "kmin", "kmax", "newest"), want, got):
        eq = torch.equal(u8(x), u8(y)) if x.dtype == FP8 else torch.equal(x, y)
        assert eq, f"decode_write {name} differs ({case})"
    assert not torch.equal(u8(got[0]), u8(t[0])), "nothing was written"


def test_decode_write_reference_on_fp8_is_the_loop():
    """reference.decode_write on fp8 == the obvious row loop (bytes into both pools, the widened
    key into the bounds)."""
    from test_decode_ops import WRITE_CASES, write_loop
    for i, case in enumerate(WRITE_CASES):
        t = fp8_write_inputs(case, torch.Generator().manual_seed(60 + i))
        got = run_write(reference.decode_write, t)
        kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page = [x.clone() for x in t]
        kv, dst = kv.view(torch.uint8), dst.view(torch.uint8)
        kmin_w, kmax_w = kmin.clone(), kmax.clone()
        newest = write_loop(kv, bt, seq, k.view(torch.uint8), v.view(torch.uint8), dst, dst_page,
                            kmin_w, kmax_w, torch.full_like(q_page, -1))
        assert torch.equal(u8(got[0]), kv) and torch.equal(u8(got[1]), dst)
        assert torch.equal(got[4], newest)
        loop_min, loop_max = kmin.clone(), kmax.clone()
        write_loop(kv.clone(), bt, seq, k.float(), v.float(), dst.clone(), torch.full_like(
            dst_page, -1), loop_min, loop_max, q_page)
        assert torch.equal(got[2], loop_min) and torch.equal(got[3], loop_max)


def test_quest_update_cpu_path_on_fp8_keys():
    from vllm_hisparse.ops.quest_update import quest_update_pages
    for dt in (torch.float32, torch.bfloat16):
        check_quest_update(dt, 4, quest_update_pages)


def check_write_score(case, gen):
    from test_write_score import compare, inputs
    from vllm_hisparse.ops import triton_quest, triton_write_score
    t = inputs(*case, gen)
    to8 = lambda x: (x * KV_SPREAD).to(FP8)              # noqa: E731
    for i in (0, 3, 4, 5):                               # kv, k, v, dst
        t[i] = to8(t[i])
    compare_fp8(t, triton_write_score.write_score, triton_quest.quest_scores_rows)


def compare_fp8(t, fused, quest_scores):
    """test_write_score.compare with byte comparisons of the fp8 tensors."""
    from test_write_score import run, two_launches
    got = run(fused, t)
    written = run_write(reference.decode_write, t[:10])
    for name, a, b in zip(("kv", "dst", "kmin", "kmax", "newest"), written, got):
        eq = torch.equal(u8(a), u8(b)) if a.dtype == FP8 else torch.equal(a, b)
        assert eq, f"{name} differs from reference.decode_write"
    want = run(two_launches(quest_scores), t)[5]
    s, full, U = got[5], t[12], t[7].shape[1]
    live = torch.arange(U)[None, :] < full[:, None]
    assert torch.equal(s, want), "scores differ from the standalone Quest kernel"
    _, _, kmin, kmax, _ = written
    ref = reference.quest_scores(t[10].float(), kmin[t[11]].float(), kmax[t[11]].float(), full)
    torch.testing.assert_close(s[live], ref[live], rtol=1e-5, atol=1e-4)


def check_select(case, gen):
    """select_resolve's RESOLVE over an fp8 cache and host pool: the Triton kernel moves the same
    bytes as the reference, step after step."""
    from test_decode_ops import clone_state, random_scores, run_select, select_inputs
    from vllm_hisparse.ops import triton_select
    N, P, Hkv, D, U, k, S = case
    a = select_inputs(*case, gen)
    a["kv"], a["host"] = a["kv"].to(FP8), (a["host"] * KV_SPREAD).to(FP8)
    b = {n: (clone_state(v) if n == "state" else v.clone()) for n, v in a.items()}
    work = tuple(torch.zeros(s, dtype=torch.int32) for s in decode_ops.workspace_shapes(N, k, S))

    def tri(scores, seq, full, k, bt, sel, locs, work, **kw):
        triton_select.select_resolve(scores, seq, full, k, bt, sel, locs, *work, **kw)

    for step in range(3):
        scores = random_scores(N, U, gen, "cpu")
        want = run_select(reference.select_resolve, a, scores, k)
        got = run_select(tri, b, scores, k, work)
        assert torch.equal(want[1], got[1]), f"step {step}: locs"
        assert torch.equal(u8(a["kv"]), u8(b["kv"])), f"step {step}: the cache's bytes differ"
    assert int(a["counts"][1]) > 0, "no miss: nothing was fetched"


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from test_decode_ops import SELECT_CASES, WRITE_CASES
    from test_write_score import CASES as SCORE_CASES
    from vllm_hisparse.ops import triton_decode_write, triton_quest_update
    for i, case in enumerate(ATTN_CASES):
        for qdt in QDTYPES:
            gen = torch.Generator().manual_seed(90 + i)
            check_sparse(case, qdt, gen)
            check_dense(case, qdt, gen)
            check_fused_with_misses(case, qdt, gen)
        check_two(QDTYPES[i], torch.Generator().manual_seed(95 + i))
    for dt in (torch.float32, torch.float16):
        check_quest_update(dt, 7, lambda kmin, kmax, page, new, tp, k: triton_quest_update.
                           quest_update_pages(kmin, kmax, page, new, tp, k))
        check_write(WRITE_CASES[0], torch.Generator().manual_seed(11), triton_decode_write.
                    decode_write, dt)
    check_write_score(SCORE_CASES[0], torch.Generator().manual_seed(12))
    check_select(SELECT_CASES[0], torch.Generator().manual_seed(13))
    print("interpreter ok")


def test_fp8_kernels_in_interpreter():
    run_cases("test_fp8_kernels")


@pytest.mark.cuda
@pytest.mark.parametrize("case", ATTN_CASES)
@pytest.mark.parametrize("qdt", [torch.bfloat16, torch.float16])
def test_gpu_fp8_attention_within_torch_error(case, qdt):
    gen = torch.Generator().manual_seed(sum(case))
    check_sparse(case, qdt, gen, "cuda")
    check_dense(case, qdt, gen, "cuda")
