"""The sparse layer's attention in two launches (ops/triton_decode_attention.py): sparse rows,
dense rows and padding rows of one decode batch get exactly the bits that the two kernels it
replaces give them (triton_attention.sparse_decode_attention_newest and
triton_dense_decode.dense_decode_attention, each over its own rows), and padding rows keep their
out rows — in Triton's interpreter on the CPU and on the GPU. The CPU dispatcher is the two
references."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import kernels, reference

# (R, Hq, Hkv, D, P, k, max dense seq)
CASES = [(5, 8, 2, 64, 4, 5, 700), (4, 4, 4, 64, 16, 40, 1500), (3, 16, 2, 128, 8, 9, 33)]
GPU_CASES = [(8, 32, 8, 128, 16, 128, 33000), (1, 32, 8, 128, 16, 128, 4096),
             (32, 32, 8, 128, 16, 128, 4096)]


def mixed_batch(R, Hq, Hkv, D, P, k, max_seq, dt, gen, dev="cpu"):
    """Rows 0, 3, 6..: sparse (locs into a shuffled cache, their newest page a block of it); rows
    1, 4, ..: dense (a block table over the same cache); rows 2, 5, ..: padding."""
    W = -(-max_seq // P)
    N = R * (W + k + 1) + 3
    kv = torch.randn(N, 2, P, Hkv, D, generator=gen).to(dt)
    q = torch.randn(R, Hq, D, generator=gen).to(dt)
    perm = torch.randperm(N, generator=gen)
    bt = perm[:R * W].view(R, W).int()
    locs = perm[R * W:R * W + R * k].view(R, k).int()
    newest = perm[R * W + R * k:R * W + R * k + R].int()
    units = torch.stack([torch.randperm(3 * k, generator=gen)[:k] for _ in range(R)]).int()
    locs[torch.rand(R, k, generator=gen) < 0.1] = -1
    kind = torch.arange(R) % 3
    sp_seq = torch.where(kind == 0, torch.randint(P, 3 * k * P, (R,), generator=gen), 0).int()
    dn_seq = torch.where(kind == 1, torch.randint(1, max_seq + 1, (R,), generator=gen), 0).int()
    if R > 1:
        dn_seq[1] = max_seq
    newest[kind != 0] = -1
    out = torch.randn(R, Hq, D, generator=gen).to(dt)
    t = (q, kv, bt, locs, units, sp_seq, newest, dn_seq, out)
    return [x.to(dev) for x in t]


def separate(q, kv, bt, locs, units, sp_seq, newest, dn_seq, out, scale):
    """The two kernels the fused pair replaces, each over its own rows."""
    from vllm_hisparse.ops import triton_attention as ta, triton_dense_decode as td
    R, Hq, D = q.shape
    ps = ta.partials_shape(R, Hq, kv.shape[3], locs.shape[1] * kv.shape[2] + kv.shape[2], D)
    sw = tuple(torch.empty(s, dtype=torch.float32, device=q.device) for s in ps)
    ta.sparse_decode_attention_newest(q, kv, locs, units, sp_seq, newest, scale, out, work=sw)
    dw = tuple(torch.empty(n, dtype=torch.float32, device=q.device)
               for n in td.partials_numel(R, Hq, D))
    td.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, dn_seq, scale, out, work=dw)
    return out


def fused(q, kv, bt, locs, units, sp_seq, newest, dn_seq, out, scale):
    from vllm_hisparse.ops import triton_decode_attention as tda
    R, Hq, D = q.shape
    work = tuple(torch.empty(n, dtype=torch.float32, device=q.device)
                 for n in tda.partials_numel(R, Hq, kv.shape[3], locs.shape[1], kv.shape[2], D))
    return tda.decode_attention(q, kv, bt, locs, units, sp_seq, newest, dn_seq, scale, out, work)


def check_case(case, dt, gen, dev):
    t = mixed_batch(*case, dt, gen, dev)
    scale = case[3] ** -0.5
    before = t[-1].clone()
    a = separate(*t[:-1], t[-1].clone(), scale)
    b = fused(*t[:-1], t[-1].clone(), scale)
    assert torch.equal(a, b), f"{case} {dt}: the fused pair differs from the two kernels"
    pad = (t[5] == 0) & (t[7] == 0)
    assert torch.equal(b[pad], before[pad]), "a padding row's out was written"
    assert not torch.equal(b[~pad], before[~pad]), "nothing was computed"


def test_cpu_dispatch_is_the_two_references():
    gen = torch.Generator().manual_seed(1)
    q, kv, bt, locs, units, sp_seq, newest, dn_seq, out = mixed_batch(*CASES[0], torch.float32, gen)
    got = kernels.decode_attention(q, kv, bt, locs, units, sp_seq, newest, dn_seq, 0.1,
                                   out.clone(), ())
    want = out.clone()
    P = kv.shape[2]
    for r in range(q.shape[0]):
        if sp_seq[r] > 0:
            extra = kv[newest[r].long()].transpose(0, 1)[None]          # (1, P, 2, Hkv, D)
            elen = ((sp_seq[r:r + 1].long() - 1) % P + 1).int()
            want[r] = reference.sparse_decode_attention(q[r:r + 1], kv, locs[r:r + 1],
                                                        units[r:r + 1], sp_seq[r:r + 1], 0.1,
                                                        extra, elen)[0]
        elif dn_seq[r] > 0:
            want[r] = reference.dense_decode_attention(q[r:r + 1], kv[:, 0], kv[:, 1],
                                                       bt[r:r + 1], dn_seq[r:r + 1], 0.1)[0]
    assert torch.equal(got, want)


def with_misses(t, gen, frac=0.3):
    """A copy of mixed_batch's tensors where about frac of the sparse rows' selected pages missed:
    their locs entry marked -2 - block, the block poisoned with NaN, its true bytes in a host pool
    page (a permutation: host_pt[rows[r], units[r, j]]); dense rows' locs get marks as well, which
    must be ignored (their pages hold other bytes). Returns (tensors, (rows, host_pt, host,
    missed)), missed[r] = 1 where row r holds a mark (what the select reports)."""
    q, kv, bt, locs, units, sp_seq, newest, dn_seq, out = t
    R, k = locs.shape
    U = int(units.max()) + 1
    M = R + 2
    rows = torch.randperm(M, generator=gen)[:R]
    npages = M * U + 3
    host_pt = torch.randperm(npages, generator=gen)[:M * U].view(M, U).int()   # no page shared
    host = torch.randn(npages, *kv.shape[1:], generator=gen).to(kv.dtype)
    kv, locs = kv.clone().cpu(), locs.clone().cpu()
    sp = (sp_seq.cpu() > 0)[:, None]
    hit = locs >= 0
    pick = (torch.rand(R, k, generator=gen) < frac) & hit
    for r, j in zip(*torch.nonzero(pick & sp, as_tuple=True)):
        b = int(locs[r, j])
        host[int(host_pt[rows[r], units[r, j]])] = kv[b]
        kv[b] = float("nan")
    locs = torch.where(pick, -2 - locs, locs)         # dense rows' marks: not theirs to follow
    dev = q.device
    missed = (locs <= -2).any(1).to(torch.int32)
    return ((q, kv.to(dev), bt, locs.to(dev), units, sp_seq, newest, dn_seq, out),
            (rows.to(dev), host_pt.to(dev), host, missed.to(dev)))


def check_misses(case, dt, gen, dev, triton_path=True, pinned=False, flag_zero=False):
    """Misses read by the split launch from the host pool (and stored into their blocks): the
    same bits as with every page resident, and the blocks end up holding the pages' bytes.
    flag_zero: every row's missed flag 0 instead: the split must then skip its misses (their
    poisoned blocks read as they are), so the output differs."""
    t = mixed_batch(*case, dt, gen, dev)
    scale = case[3] ** -0.5
    if triton_path:
        want = fused(*t[:-1], t[-1].clone(), scale)
    else:
        want = kernels.decode_attention(*t[:-1], scale, t[-1].clone(), ())
    m, (rows, host_pt, host, missed) = with_misses(t, gen)
    assert bool((m[3] <= -2).any()), "no miss in the case"
    if flag_zero:
        missed = torch.zeros_like(missed)
    host = host.pin_memory() if pinned else host.to(dev)
    kv = m[1]
    if not triton_path:                              # the dispatcher's CPU path
        got = kernels.decode_attention(*m[:-1], scale, m[-1].clone(), (),
                                       (rows, host_pt, host, missed))
    else:
        from vllm_hisparse.ops import triton_decode_attention as tda
        R, Hq, D = t[0].shape
        work = tuple(torch.empty(n, dtype=torch.float32, device=dev)
                     for n in tda.partials_numel(R, Hq, kv.shape[3], t[3].shape[1], kv.shape[2], D))
        alias = kernels.device_alias(host, kv.device) if pinned else host
        got = tda.decode_attention(*m[:-1], scale, m[-1].clone(), work,
                                   (rows, host_pt, alias, missed))
    if flag_zero:
        assert not torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), \
            f"{case} {dt}: rows flagged without a miss still fetched their marked pages"
        return
    assert torch.equal(got, want), f"{case} {dt}: misses read from the host change the output"
    assert torch.equal(kv, t[1]), f"{case} {dt}: the missed blocks do not hold their pages"


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    for i, case in enumerate(CASES):
        for dt in (torch.float16, torch.float32):
            check_case(case, dt, torch.Generator().manual_seed(20 + i), "cpu")
        # the misses' path once per case (its dtype only changes the loads' width)
        check_misses(case, (torch.float16, torch.float32)[i % 2],
                     torch.Generator().manual_seed(30 + i), "cpu")
    check_misses(CASES[0], torch.float32, torch.Generator().manual_seed(29), "cpu", flag_zero=True)
    print("interpreter ok")


def test_cpu_dispatch_fetches_marked_misses():
    for i, case in enumerate(CASES):
        check_misses(case, torch.float32, torch.Generator().manual_seed(10 + i), "cpu",
                     triton_path=False)


def test_fused_equals_the_two_kernels_in_interpreter():
    run_cases("test_decode_attention")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES + GPU_CASES)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gpu_fused_equals_the_two_kernels(case, dt):
    check_case(case, dt, torch.Generator().manual_seed(sum(case)), "cuda")


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("case", CASES + GPU_CASES)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gpu_misses_read_from_the_pinned_pool(case, dt):
    check_misses(case, dt, torch.Generator().manual_seed(5 + sum(case)), "cuda", pinned=True)
