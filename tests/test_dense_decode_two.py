"""A dense layer's rows over two paged caches in one launch pair (``dense_decode_two``): each row
gets the bits the two one-cache calls the dense layer made before give it (rows on vLLM's cache,
rows on the dense pool through their own table row), rows of neither keep their out row, and the
result agrees with the fp32 reference row by row over the row's own cache — on the GPU, on CPU
through Triton's interpreter, and for the CPU path."""
from __future__ import annotations

import pytest
import torch

from test_dense_decode import _inputs
from triton_interpreter import run_cases

from vllm_hisparse.ops import kernels, reference

# (R, Hq, Hkv, D, P, max_seq)
CASES = [(6, 32, 8, 128, 16, 5000), (7, 8, 1, 256, 4, 700), (5, 16, 2, 64, 32, 1025)]
INTERP_CASES = [(5, 8, 2, 64, 16, 700), (4, 4, 4, 64, 4, 300)]
FILL = 7.0


def _two_inputs(case, dt, gen, dev):
    """Rows by kind r % 3: 0 on the cache, 1 on the pool (through a shuffled pool table row),
    2 on neither; a pool table row may hold 0 keys (that row then reads nothing either)."""
    R = case[0]
    q, kv, bt, seq = _inputs(*case, dt, gen, "cpu")
    _, kv2, t2, s2 = _inputs(R + 2, *case[1:], dt, gen, "cpu")
    kind = torch.arange(R) % 3
    rows2 = torch.randperm(R + 2, generator=gen)[:R]
    seq_k = torch.where(kind == 0, seq, 0).int()
    seq2 = torch.where(kind == 1, s2[rows2], 0).long()
    to = (q, kv, bt, seq_k, kv2, t2, rows2, seq2)
    return tuple(t.to(dev) for t in to)


def _work(q):
    from vllm_hisparse.ops.triton_dense_decode import partials_numel
    return tuple(torch.full((n,), float("nan"), dtype=torch.float32, device=q.device)
                 for n in partials_numel(*q.shape))


def _row_reference(q, kv, bt, seq_k, kv2, t2, rows2, seq2):
    """fp32, one row at a time over its own cache; None for a row that reads neither."""
    want = []
    for r in range(q.shape[0]):
        if seq2[r] > 0:
            c, tbl, n = kv2, t2[rows2[r]:rows2[r] + 1], seq2[r:r + 1]
        elif seq_k[r] > 0:
            c, tbl, n = kv, bt[r:r + 1], seq_k[r:r + 1]
        else:
            want.append(None)
            continue
        want.append(reference.dense_decode_attention(q[r:r + 1].float(), c[:, 0].float(),
                                                     c[:, 1].float(), tbl, n.int(), 0.1)[0])
    return want


def check(case, dt, gen, dev, td, tol):
    x = _two_inputs(case, dt, gen, dev)
    q, kv, bt, seq_k, kv2, t2, rows2, seq2 = x
    got = torch.full_like(q, FILL)
    td.dense_decode_two(q, kv, bt, seq_k, kv2, t2, rows2, seq2, 0.1, got, _work(q))
    # the dense layer's former launches: the cache's rows, then the pool's
    two = torch.full_like(q, FILL)
    w = _work(q)
    td.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq_k, 0.1, two, work=w)
    td.dense_decode_attention(q, kv2[:, 0], kv2[:, 1], t2, seq2, 0.1, two, table_rows=rows2,
                              work=w)
    assert torch.equal(got, two), "one launch pair differs from the two calls"
    want = _row_reference(*x)
    assert sum(w is None for w in want) >= case[0] // 3
    for r, wr in enumerate(want):
        if wr is None:
            assert torch.equal(got[r], torch.full_like(got[r], FILL)), f"row {r} was written"
        else:
            err = (got[r].float() - wr).abs().max()
            assert err <= tol, (r, float(err))
    return x, got


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1."""
    from vllm_hisparse.ops import triton_dense_decode as td
    for i, case in enumerate(INTERP_CASES):
        check(case, torch.float32, torch.Generator().manual_seed(90 + i), "cpu", td, 1e-4)
    print("interpreter ok")


def test_triton_kernel_in_interpreter():
    run_cases("test_dense_decode_two")


@pytest.mark.parametrize("case", INTERP_CASES)
def test_cpu_path_matches_rows_reference(case):
    check(case, torch.float32, torch.Generator().manual_seed(sum(case)), "cpu", kernels, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gpu_matches_two_calls_and_reference(case, dt):
    from vllm_hisparse.ops import triton_dense_decode as td
    check(case, dt, torch.Generator().manual_seed(sum(case)), "cuda", td, 2e-2)


@pytest.mark.cuda
def test_gpu_cuda_graph_replay():
    from vllm_hisparse.ops import triton_dense_decode as td
    x, want = check(CASES[0], torch.bfloat16, torch.Generator().manual_seed(3), "cuda", td, 2e-2)
    q = x[0]
    out, work = torch.full_like(q, FILL), _work(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        td.dense_decode_two(*x, 0.1, out, work)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        td.dense_decode_two(*x, 0.1, out, work)
    out.fill_(FILL)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
