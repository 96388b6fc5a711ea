"""Dense decode attention (ops/triton_dense_decode.py): the Triton kernel vs the fp32 reference
(error <= 2x torch's own error in the same dtype on the GPU), and the property it exists for — a
row's output is bit-identical whatever the other rows of the call, the call's size and the block
table's width — on the GPU and, on CPU, through Triton's interpreter. The reference itself agrees
with the paged dense attention the runtime uses for every other dense row."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.core.sparse_layer import paged_dense_reference
from vllm_hisparse.ops import kernels, reference

# (R, Hq, Hkv, D, P, max_seq)
CASES = [(1, 32, 8, 128, 16, 4096), (3, 32, 8, 128, 16, 33000), (5, 8, 1, 256, 4, 700),
         (4, 16, 2, 64, 32, 1025), (8, 28, 4, 128, 16, 513)]
INTERP_CASES = [(3, 8, 2, 64, 16, 1200), (2, 4, 4, 64, 4, 513)]


def _inputs(R, Hq, Hkv, D, P, max_seq, dt, gen, dev, extra_width=3):
    """Random rows (one of them seq 0 when R > 2, one of exactly max_seq) over a shuffled cache;
    keys past each row's seq_k are NaN (they must not leak)."""
    W = -(-max_seq // P) + extra_width
    N = R * W + 5
    q = torch.randn(R, Hq, D, generator=gen).to(dt)
    kv = torch.randn(N, 2, P, Hkv, D, generator=gen).to(dt)
    bt = torch.randperm(N, generator=gen)[:R * W].view(R, W).int()
    seq = torch.randint(1, max_seq + 1, (R,), generator=gen).int()
    seq[0] = max_seq
    if R > 2:
        seq[1] = 0
    for r in range(R):
        n = int(seq[r])
        blocks = bt[r].long()
        flat = kv[blocks].transpose(1, 2).reshape(W * P, 2, Hkv, D)
        flat[n:] = float("nan")
        kv[blocks] = flat.view(W, P, 2, Hkv, D).transpose(1, 2)
    return q.to(dev), kv.to(dev), bt.to(dev), seq.to(dev)


def check_invariance(case, dt, gen, dev, fn):
    """Row r alone, in the full call, in a call with a wider table and with the grid sized by the
    longest row (max_k): the same bits."""
    q, kv, bt, seq = _inputs(*case, dt, gen, dev)
    R = q.shape[0]
    full = fn(q, kv[:, 0], kv[:, 1], bt, seq, 0.1)
    wide = torch.cat([bt, torch.zeros(R, 37, dtype=bt.dtype, device=bt.device)], 1)
    for r in range(R):
        alone = fn(q[r:r + 1], kv[:, 0], kv[:, 1], bt[r:r + 1].contiguous(), seq[r:r + 1], 0.1)
        assert torch.equal(alone[0], full[r]), f"row {r}: differs alone vs in the batch"
    assert torch.equal(fn(q, kv[:, 0], kv[:, 1], wide, seq, 0.1), full), "table width changed it"
    tight = fn(q, kv[:, 0], kv[:, 1], wide, seq, 0.1, max_k=int(seq.max()))
    assert torch.equal(tight, full), "the grid bound max_k changed it"
    assert not torch.isnan(full).any()
    if R > 2:
        assert torch.equal(full[1], torch.zeros_like(full[1])), "seq 0 must give zeros"
    return q, kv, bt, seq, full


def test_reference_equals_paged_dense_reference():
    gen = torch.Generator().manual_seed(0)
    q, kv, bt, seq = _inputs(4, 16, 2, 64, 16, 900, torch.float32, gen, "cpu")
    want = torch.empty_like(q)
    R = q.shape[0]
    paged_dense_reference(q, kv[:, 0], kv[:, 1], bt, torch.arange(R + 1, dtype=torch.int32), seq,
                          1, 900, 0.1, want)
    got = reference.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(kernels.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.1), got)


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_dense_decode as td
    for i, case in enumerate(INTERP_CASES):
        for dt in (torch.float16, torch.float32):
            gen = torch.Generator().manual_seed(70 + i)
            q, kv, bt, seq, got = check_invariance(case, dt, gen, "cpu", td.dense_decode_attention)
            want = reference.dense_decode_attention(q.float(), kv[:, 0].float(), kv[:, 1].float(),
                                                    bt, seq, 0.1)
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    print("interpreter ok")


def test_triton_kernel_in_interpreter():
    run_cases("test_dense_decode")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference_and_is_batch_invariant(case, dt):
    gen = torch.Generator().manual_seed(sum(case))
    q, kv, bt, seq, got = check_invariance(case, dt, gen, "cuda", kernels.dense_decode_attention)
    want = reference.dense_decode_attention(q.float(), kv[:, 0].float(), kv[:, 1].float(), bt, seq,
                                            0.1)
    own = reference.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.1)  # torch in dt
    err, base = (got.float() - want).abs().max(), (own.float() - want).abs().max()
    assert err <= 2 * base + 1e-3, (float(err), float(base))


@pytest.mark.cuda
def test_gpu_cuda_graph_replay():
    gen = torch.Generator().manual_seed(5)
    q, kv, bt, seq = _inputs(4, 32, 8, 128, 16, 5000, torch.bfloat16, gen, "cuda")
    want = kernels.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.1)
    out = torch.full_like(q, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernels.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.1, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernels.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.1, out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("seq", [1, 127, 128, 129, 4096, 4097, 32768, 131072, 200001])
def test_split_len_is_the_smallest_multiple_that_fits(seq):
    """A row's split length: a multiple of MIN_SPLIT whose splits cover the row in at most SPLITS
    programs, and the smallest such (one MIN_SPLIT less would need more than SPLITS)."""
    from vllm_hisparse.ops import triton_dense_decode as td
    n = td.split_len(seq)
    assert n % td.MIN_SPLIT == 0 and n >= td.MIN_SPLIT
    assert -(-seq // n) <= td.SPLITS
    if n > td.MIN_SPLIT:
        assert -(-seq // (n - td.MIN_SPLIT)) > td.SPLITS
