"""The sparse layer's attention in one launch (ops/triton_decode_attention.py): sparse rows, dense
rows and padding rows of one decode batch get exactly the bits that the two kernels it replaces
give them (triton_attention.sparse_decode_attention_newest and
triton_dense_decode.dense_decode_attention, each over its own rows, each a split and a combine
launch), padding rows keep their out rows, and the per-(row, KV head) counters of the combine are
zeros again after every call, so calls in a row can share them — in Triton's interpreter on the CPU
(its programs run one after the other) and on the GPU. The CPU dispatcher is the two
references."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import kernels, reference

# (R, Hq, Hkv, D, P, k, max dense seq)
CASES = [(5, 8, 2, 64, 4, 5, 700), (4, 4, 4, 64, 16, 40, 1500), (3, 16, 2, 128, 8, 9, 33)]
# rows' kinds (0 sparse, 1 dense, 2 padding) of CASES[0]-shaped batches: padding first and last,
# one kind only, every row padding (the launch must leave out and the counters as they are)
KINDS = [[2, 0, 1, 2, 2], [2, 1, 1, 0, 2], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]]
# (case, kinds) of calls sharing one counter buffer, one after the other
IN_A_ROW = [(CASES[0], None), (CASES[0], None), ((3, 8, 4, 64, 4, 5, 300), [1, 0, 1]),
            (CASES[0], KINDS[0])]
GPU_CASES = [(8, 32, 8, 128, 16, 128, 33000), (1, 32, 8, 128, 16, 128, 4096),
             (32, 32, 8, 128, 16, 128, 4096)]


def mixed_batch(R, Hq, Hkv, D, P, k, max_seq, dt, gen, dev="cpu", kind=None):
    """kind (R,) 0: sparse (locs into a shuffled cache, their newest page a block of it), 1: dense
    (a block table over the same cache), 2: padding; default rows 0, 3, 6..: sparse, 1, 4, ..:
    dense, 2, 5, ..: padding."""
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
    default = kind is None
    kind = torch.arange(R) % 3 if default else torch.as_tensor(kind)
    sp_seq = torch.where(kind == 0, torch.randint(P, 3 * k * P, (R,), generator=gen), 0).int()
    dn_seq = torch.where(kind == 1, torch.randint(1, max_seq + 1, (R,), generator=gen), 0).int()
    if R > 1 and default:                       # one dense row at the longest length
        dn_seq[1] = max_seq
    newest[kind != 0] = -1
    out = torch.randn(R, Hq, D, generator=gen).to(dt)
    t = (q, kv, bt, locs, units, sp_seq, newest, dn_seq, out)
    return [x.to(dev) for x in t]


def separate(q, kv, bt, locs, units, sp_seq, newest, dn_seq, out, scale):
    """The two kernels the fused launch replaces, each over its own rows."""
    from vllm_hisparse.ops import triton_attention as ta, triton_dense_decode as td
    R, Hq, D = q.shape
    ps = ta.partials_shape(R, Hq, kv.shape[3], locs.shape[1] * kv.shape[2] + kv.shape[2], D)
    sw = tuple(torch.empty(s, dtype=torch.float32, device=q.device) for s in ps)
    ta.sparse_decode_attention_newest(q, kv, locs, units, sp_seq, newest, scale, out, work=sw)
    dw = tuple(torch.empty(n, dtype=torch.float32, device=q.device)
               for n in td.partials_numel(R, Hq, D))
    td.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, dn_seq, scale, out, work=dw)
    return out


def counters_for(R, Hkv, dev, spare=0):
    """Zeroed combine counters of a call (R * Hkv), then ``spare`` more set to -7 (not its)."""
    return torch.cat([torch.zeros(R * Hkv, dtype=torch.int32),
                      torch.full((spare,), -7, dtype=torch.int32)]).to(dev)


def fused(q, kv, bt, locs, units, sp_seq, newest, dn_seq, out, scale, counters=None):
    """decode_attention with partials poisoned with NaN (a combine that reads a split before its
    program stored it shows) and the given counters (default: fresh zeros)."""
    from vllm_hisparse.ops import triton_decode_attention as tda
    R, Hq, D = q.shape
    po, pml = (torch.full((n,), float("nan"), device=q.device)
               for n in tda.partials_numel(R, Hq, kv.shape[3], locs.shape[1], kv.shape[2], D))
    cnt = counters_for(R, kv.shape[3], q.device) if counters is None else counters
    return tda.decode_attention(q, kv, bt, locs, units, sp_seq, newest, dn_seq, scale, out,
                                (po, pml, cnt))


def check_case(case, dt, gen, dev, kind=None, counters=None):
    """One mixed batch through decode_attention == the two kernels; padding rows untouched; the
    counters' first R * Hkv zeros again and the rest as they were."""
    t = mixed_batch(*case, dt, gen, dev, kind=kind)
    scale = case[3] ** -0.5
    before = t[-1].clone()
    cnt = counters_for(case[0], case[2], dev) if counters is None else counters
    cnt_before = cnt.clone()
    a = separate(*t[:-1], t[-1].clone(), scale)
    b = fused(*t[:-1], t[-1].clone(), scale, cnt)
    assert torch.equal(a, b), f"{case} {dt}: the fused launch differs from the two kernels"
    pad = (t[5] == 0) & (t[7] == 0)
    assert torch.equal(b[pad], before[pad]), "a padding row's out was written"
    assert pad.all() or not torch.equal(b[~pad], before[~pad]), "nothing was computed"
    n = case[0] * case[2]
    assert not cnt[:n].any(), f"counters left {cnt[:n].tolist()}"
    assert torch.equal(cnt[n:], cnt_before[n:]), "a counter past R * Hkv was touched"


def check_in_a_row(dev):
    """Calls one after the other on fresh inputs sharing one counter buffer (sized for the
    largest call): each equal to the two kernels on its inputs, the counters zeros after each."""
    counters = torch.zeros(16, dtype=torch.int32, device=dev)
    for i, (case, kind) in enumerate(IN_A_ROW):
        check_case(case, torch.float32, torch.Generator().manual_seed(40 + i), dev, kind, counters)


def check_kinds(dev, dt):
    for i, kind in enumerate(KINDS):
        check_case(CASES[0], dt, torch.Generator().manual_seed(30 + i), dev, kind,
                   counters_for(CASES[0][0], CASES[0][2], dev, spare=3))


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


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    for i, case in enumerate(CASES):
        for dt in (torch.float16, torch.float32):
            check_case(case, dt, torch.Generator().manual_seed(20 + i), "cpu")
    print("interpreter ok")


def run_kinds():
    check_kinds("cpu", torch.float16)
    print("interpreter ok")


def run_in_a_row():
    check_in_a_row("cpu")
    print("interpreter ok")


def test_fused_equals_the_two_kernels_in_interpreter():
    run_cases("test_decode_attention")


def test_padding_rows_and_row_kinds_in_interpreter():
    run_cases("test_decode_attention", "run_kinds")


def test_calls_in_a_row_share_the_counters_in_interpreter():
    run_cases("test_decode_attention", "run_in_a_row")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES + GPU_CASES)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gpu_fused_equals_the_two_kernels(case, dt):
    check_case(case, dt, torch.Generator().manual_seed(sum(case)), "cuda")


@pytest.mark.cuda
def test_gpu_padding_rows_and_row_kinds():
    check_kinds("cuda", torch.bfloat16)


@pytest.mark.cuda
def test_gpu_calls_in_a_row_share_the_counters():
    check_in_a_row("cuda")
