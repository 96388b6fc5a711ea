"""Triton sparse decode attention vs the fp32 reference (error <= 2x torch's own error in the same
dtype), and bit-exactness of HiSparse (hot-buffer locs) vs resident (full-cache locs)."""
import pytest
import torch

from vllm_hisparse.ops import kernels, reference

pytestmark = pytest.mark.cuda

# (R, Hq, Hkv, D, unit, k, E)
CASES = [(1, 8, 8, 64, 1, 1, 0), (3, 32, 8, 128, 1, 31, 0), (4, 32, 8, 128, 1, 2048, 0),
         (2, 16, 2, 128, 16, 33, 5), (5, 8, 1, 256, 4, 64, 3), (2, 64, 8, 128, 1, 1025, 1),
         (3, 4, 4, 64, 32, 32, 16), (1, 28, 4, 128, 16, 128, 2)]
DTYPES = [torch.bfloat16, torch.float16]


def _inputs(R, Hq, Hkv, D, unit, k, E, dt, gen):
    U = 3 * k + 2
    N = R * k + 11
    q = torch.randn(R, Hq, D, generator=gen).to(dt).cuda()
    kv = torch.randn(N, 2, unit, Hkv, D, generator=gen).to(dt).cuda()
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
    kv.transpose(1, 2)[~attended.cuda()] = float("nan")     # (N, unit) mask over (N, 2, unit, ...)
    extra = elen = None
    if E:
        extra = torch.randn(R, E, 2, Hkv, D, generator=gen).to(dt).cuda()
        elen = torch.randint(0, E + 1, (R,), generator=gen).int().cuda()
        elen[0] = E
        for r in range(R):
            extra[r, int(elen[r]):] = float("nan")
    return q, kv, locs.cuda(), units.cuda(), seq.cuda(), extra, elen


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
    ref = reference.sparse_decode_attention(q.double(), kv.double(), locs, units, seq, scale,
                                            None if extra is None else extra.double(), elen)
    low = _torch_lowp(q, kv, locs, units, seq, scale, extra, elen)
    assert not out.isnan().any()
    err = (out.double() - ref).abs().max().item()
    err_pt = (low.double() - ref).abs().max().item()
    assert err <= 2 * err_pt + 1e-4, f"kernel err {err} vs torch {dt} err {err_pt}"
    if len(q) > 1 and extra is None:
        assert (out[-1] == 0).all()                           # seq_len 0, no extras -> zeros


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
