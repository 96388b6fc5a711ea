"""Triton sparse decode attention vs the fp32 reference (error <= 2x torch's own error in the same
dtype), and bit-exactness of HiSparse (hot-buffer locs) vs resident (full-cache locs). The newest-page
entry (sparse_decode_attention_newest, extra rows read from kv by block index) is bit-identical to
gathering them into extra_kv; checked on the GPU and, on CPU, through Triton's interpreter (fp16 and
fp32: the interpreter's bf16 is not faithful)."""

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import kernels, reference

# (R, Hq, Hkv, D, unit, k, E)
CASES = [(1, 8, 8, 64, 1, 1, 0), (3, 32, 8, 128, 1, 31, 0), (4, 32, 8, 128, 1, 2048, 0),
         (2, 16, 2, 128, 16, 33, 5), (5, 8, 1, 256, 4, 64, 3), (2, 64, 8, 128, 1, 1025, 1),
         (3, 4, 4, 64, 32, 32, 16), (1, 28, 4, 128, 16, 128, 2)]
DTYPES = [torch.bfloat16, torch.float16]
# newest-page path (R, Hq, Hkv, D, unit, k): unit 1 (token units), pages of 4, 16, 32
NEWEST_CASES = [(3, 32, 8, 128, 1, 31), (2, 16, 2, 128, 16, 33), (5, 8, 1, 256, 4, 64),
                (3, 4, 4, 64, 32, 32), (8, 32, 8, 128, 16, 127)]
INTERP_CASES = [(3, 8, 2, 64, 4, 5), (2, 4, 4, 64, 16, 3), (1, 8, 8, 64, 1, 1), (4, 16, 2, 128, 8, 9)]
INTERP_DTYPES = [torch.float16, torch.float32]


def _inputs(R, Hq, Hkv, D, unit, k, E, dt, gen, dev="cuda"):
    U = 3 * k + 2
    N = R * k + 11
    q = torch.randn(R, Hq, D, generator=gen).to(dt).to(dev)
    kv = torch.randn(N, 2, unit, Hkv, D, generator=gen).to(dt).to(dev)
    locs = torch.stack([torch.randperm(N, generator=gen)[:k] for _ in range(R)]).int()
    units = torch.stack([torch.randperm(U, generator=gen)[:k] for _ in range(R)]).int()
    locs[torch.rand(R, k, generator=gen) < 0.1] = -1
    seq = torch.randint(1, U * unit + 1, (R,), generator=gen).int()
    if R > 1:
        seq[-1] = 0                                           # nothing selected attendable
        locs[0] = -1                                          # an all-padding row
    # rows never attended hold NaN: they must not leak into the result
    pos = units.long()[:, :, None] * unit + torch.arange(unit)
    ok = (locs[:, :, None] >= 0) & (pos < seq.long()[:, None, None])
    flat = (locs.clamp(min=0).long()[:, :, None] * unit + torch.arange(unit))[ok]
    attended = torch.zeros(N * unit).index_add_(0, flat, torch.ones(len(flat))).view(N, unit) > 0
    kv.transpose(1, 2)[~attended.to(dev)] = float("nan")   # (N, unit) mask over (N, 2, unit, ...)
    extra = elen = None
    if E:
        extra = torch.randn(R, E, 2, Hkv, D, generator=gen).to(dt).to(dev)
        elen = torch.randint(0, E + 1, (R,), generator=gen).int().to(dev)
        elen[0] = E
        for r in range(R):
            extra[r, int(elen[r]):] = float("nan")
    return q, kv, locs.to(dev), units.to(dev), seq.to(dev), extra, elen


def _newest_inputs(R, Hq, Hkv, D, unit, k, dt, gen, dev="cuda"):
    """_inputs plus each row's newest page as a block of kv (rows past (seq-1) % unit + 1 NaN, the
    last row's seq 0 -> a full page, as torch's floor modulo gives), in shuffled block order; and
    the same rows gathered into extra_kv / extra_lens as sparse_layer did before."""
    q, kv, locs, units, seq, _, _ = _inputs(R, Hq, Hkv, D, unit, k, 0, dt, gen, dev)
    N = kv.shape[0]
    newest = (N + torch.randperm(R, generator=gen)).to(dev)
    pages = torch.randn(R, 2, unit, Hkv, D, generator=gen).to(dt).to(dev)
    elen = ((seq.long() - 1) % unit + 1).int()
    for r in range(R):
        pages[r, :, int(elen[r]):] = float("nan")
    kv = torch.cat([kv, torch.empty_like(pages)])
    kv[newest] = pages
    extra = kv[newest].transpose(1, 2).contiguous()
    return q, kv, locs, units, seq, newest, extra, elen


def _torch_lowp(q, kv, locs, units, seq, scale, extra, elen):
    """The same attention with torch in the inputs' dtype (matmuls in bf16/fp16)."""
    R, Hq, D = q.shape
    unit, Hkv = kv.shape[2], kv.shape[3]
    k = locs.shape[1]
    g = kv[locs.clamp(min=0).long()].transpose(2, 3).reshape(R, k * unit, 2, Hkv, D)
    pos = units.long()[:, :, None] * unit + torch.arange(unit, device=q.device)
    valid = ((locs[:, :, None] >= 0) & (pos < seq.long()[:, None, None])).reshape(R, k * unit)
    if extra is not None:
        g = torch.cat([g, extra], 1)
        valid = torch.cat([valid, torch.arange(extra.shape[1], device=q.device)[None] < elen[:, None]], 1)
    g = g.masked_fill(~valid[:, :, None, None, None], 0)
    qv = q.view(R, Hkv, Hq // Hkv, D)
    s = torch.einsum("rhgd,rthd->rhgt", qv, g[:, :, 0]) * scale
    s = s.float().masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("rhgt,rthd->rhgd", p, g[:, :, 1]).reshape(R, Hq, D)


def _check_vs_reference(out, q, kv, locs, units, seq, scale, extra, elen):
    ref = reference.sparse_decode_attention(q.double(), kv.double(), locs, units, seq, scale,
                                            None if extra is None else extra.double(), elen)
    low = _torch_lowp(q, kv, locs, units, seq, scale, extra, elen)
    assert not out.isnan().any()
    err = (out.double() - ref).abs().max().item()
    err_pt = (low.double() - ref).abs().max().item()
    assert err <= 2 * err_pt + 1e-4, f"kernel err {err} vs torch {q.dtype} err {err_pt}"


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dt", DTYPES)
def test_attention_vs_reference(case, dt):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    q, kv, locs, units, seq, extra, elen = _inputs(*case, dt, gen)
    scale = case[3] ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels.sparse_decode_attention(q, kv, locs, units, seq, scale, extra, elen, out=out)
    _check_vs_reference(out, q, kv, locs, units, seq, scale, extra, elen)
    if len(q) > 1 and extra is None:
        assert (out[-1] == 0).all()                           # seq_len 0, no extras -> zeros


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES[:5])
def test_hisparse_equals_resident_bitwise(case):
    """Same selection, values gathered from a hot buffer at arbitrary slots vs a full cache."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    R, Hq, Hkv, D, unit, k, E = case
    dt = torch.bfloat16
    q, kv, locs, units, seq, extra, elen = _inputs(*case, dt, gen)
    # resident: unit u of row r at full[r*U + u]; hot: a random permutation of slots of a buffer
    U = 3 * k + 2
    full = torch.randn(R * U, 2, unit, Hkv, D, generator=gen).to(dt).cuda()
    res_locs = torch.where(units >= 0, torch.arange(R, device="cuda")[:, None] * U + units, -1)
    res_locs = torch.where(locs >= 0, res_locs, -1).int()
    hot = torch.full((R * k + 5, 2, unit, Hkv, D), float("nan"), dtype=dt, device="cuda")
    hot_locs = torch.randperm(R * k + 5, device="cuda")[: R * k].view(R, k).int()
    hot[hot_locs.long()] = full[res_locs.clamp(min=0).long()]
    hot_locs = torch.where(res_locs >= 0, hot_locs, -1).int()
    a = kernels.sparse_decode_attention(q, full, res_locs, units, seq, D ** -0.5, extra, elen)
    b = kernels.sparse_decode_attention(q, hot, hot_locs, units, seq, D ** -0.5, extra, elen)
    assert torch.equal(a, b)


# ---- newest page read from kv by block index -----------------------------------------------------
def check_newest(case, dt, gen, dev, newest_fn, gathered_fn):
    """newest_fn (block-index path) == gathered_fn (extra_kv path) bit for bit, both within the
    reference's tolerance; a padding row (newest block -1) attends no extra rows."""
    q, kv, locs, units, seq, newest, extra, elen = _newest_inputs(*case, dt, gen, dev)
    scale = case[3] ** -0.5
    a = torch.full_like(q, float("nan"))
    newest_fn(q, kv, locs, units, seq, newest, scale, out=a)
    b = gathered_fn(q, kv, locs, units, seq, scale, extra, elen)
    assert torch.equal(a, b), f"{case} {dt}: newest-page path differs from the gathered path"
    _check_vs_reference(a, q, kv, locs, units, seq, scale, extra, elen)
    newest[0] = -1
    a = newest_fn(q, kv, locs, units, seq, newest, scale)
    elen[0] = 0
    assert torch.equal(a, gathered_fn(q, kv, locs, units, seq, scale, extra, elen))


def test_newest_cpu_is_the_gathered_reference():
    gen = torch.Generator().manual_seed(4)
    q, kv, locs, units, seq, newest, extra, elen = _newest_inputs(3, 8, 2, 64, 4, 5, torch.float32,
                                                                   gen, "cpu")
    a = kernels.sparse_decode_attention_newest(q, kv, locs, units, seq, newest, 0.125)
    assert torch.equal(a, reference.sparse_decode_attention(q, kv, locs, units, seq, 0.125, extra, elen))


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_attention as ta
    for i, case in enumerate(INTERP_CASES):
        for dt in INTERP_DTYPES:
            gen = torch.Generator().manual_seed(40 + i)
            check_newest(case, dt, gen, "cpu", ta.sparse_decode_attention_newest,
                         ta.sparse_decode_attention)
    print("interpreter ok")


def test_newest_triton_kernel_in_interpreter():
    run_cases("test_kernels_attention")


@pytest.mark.cuda
@pytest.mark.parametrize("case", NEWEST_CASES)
@pytest.mark.parametrize("dt", DTYPES)
def test_newest_gpu_equals_gathered_bitwise(case, dt):
    gen = torch.Generator().manual_seed(sum(case))
    check_newest(case, dt, gen, "cuda", kernels.sparse_decode_attention_newest,
                 kernels.sparse_decode_attention)


@pytest.mark.cuda
def test_newest_gpu_cuda_graph():
    gen = torch.Generator().manual_seed(9)
    q, kv, locs, units, seq, newest, extra, elen = _newest_inputs(4, 32, 8, 128, 16, 64,
                                                                   torch.bfloat16, gen)
    want = kernels.sparse_decode_attention(q, kv, locs, units, seq, 0.1, extra, elen)
    out = torch.full_like(q, float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernels.sparse_decode_attention_newest(q, kv, locs, units, seq, newest, 0.1, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
