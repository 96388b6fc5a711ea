"""RESOLVE of a given selection (ops/resolve_given.py): the reference checked against the
properties RESOLVE must have (not its own code), and the Triton kernel (through Triton's
interpreter on the CPU, for real with -m cuda) equal to the reference bit for bit over several
steps of shared state: locs, the hot buffer's bytes, the slot state, the hit/miss counts."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases
from vllm_hisparse.ops import resolve_given as rg

ROW = 576                        # an MLA latent row (opaque to RESOLVE)
# (N rows, runtime rows M, slots S, units U, K selected, steps)
CASES = [(1, 2, 8, 20, 8, 3), (3, 5, 16, 50, 12, 4), (4, 6, 33, 97, 32, 3), (2, 3, 5, 5, 5, 2)]


def make(N, M, S, U, K, gen, dev="cpu"):
    rows = torch.randperm(M, generator=gen)[:N].long()
    host = torch.randn(M * U, ROW, generator=gen).to(torch.bfloat16)
    host_pt = torch.randperm(M * U, generator=gen).int().view(M, U)
    kv = (torch.randn(N * S + 3, ROW, generator=gen) * 50).to(torch.bfloat16)
    bt = torch.randperm(N * S, generator=gen).int().view(N, S)
    seq = torch.full((N,), U, dtype=torch.int64)
    hot = torch.ones(N, dtype=torch.int64)
    if N > 2:
        seq[1] = 0                                       # padding row
        hot[2] = 0                                       # a resident row: not this op's
    state = (torch.full((M, S), -1, dtype=torch.int32), torch.full((M, U), -1, dtype=torch.int32),
             torch.arange(S, dtype=torch.int32).repeat(M, 1))
    t = dict(rows=rows, host=host, host_pt=host_pt, kv=kv, bt=bt, seq=seq, hot=hot,
             counts=torch.zeros(2, dtype=torch.int64))
    t = {k: v.to(dev) for k, v in t.items()}
    t["state"] = tuple(s.to(dev) for s in state)
    return t


def selection(N, U, K, gen):
    """Unique units per row in a random order, -1 at random places."""
    sel = torch.stack([torch.randperm(U, generator=gen)[:K] for _ in range(N)]).int()
    sel[torch.rand(N, K, generator=gen) < 0.2] = -1
    return sel


def step(fn, t, sel):
    locs = torch.full(sel.shape, -7, dtype=torch.int32, device=sel.device)
    fn(sel, t["seq"], t["bt"], locs, t["hot"], t["rows"], t["state"], t["host_pt"], t["host"],
       t["kv"], t["counts"])
    return locs


@pytest.mark.parametrize("case", CASES)
def test_reference_properties(case):
    N, M, S, U, K, steps = case
    g = torch.Generator().manual_seed(sum(case))
    t = make(N, M, S, U, K, g)
    su, us, lru = t["state"]
    spare = t["kv"][N * S:].clone()
    valid_total = 0
    for _ in range(steps):
        sel = selection(N, U, K, g)
        locs = step(rg.resolve_given_reference, t, sel)
        for r in range(N):
            if t["seq"][r] == 0 or t["hot"][r] == 0:
                assert (locs[r] == -7).all(), "a row this op does not own was written"
                continue
            valid_total += int((sel[r] >= 0).sum())
            row = int(t["rows"][r])
            for j, u in enumerate(sel[r].tolist()):
                if u < 0:
                    assert locs[r, j] == -1
                    continue
                slot = int(us[row, u])
                assert slot >= 0 and int(su[row, slot]) == u
                assert int(locs[r, j]) == int(t["bt"][r, slot])
                assert torch.equal(t["kv"][locs[r, j]], t["host"][t["host_pt"][row, u]])
            assert sorted(lru[row].tolist()) == list(range(S))
    assert int(t["counts"].sum()) == valid_total
    assert torch.equal(t["kv"][N * S:], spare)


def compare(case, gen, fn):
    """fn and the reference from the same start over the case's steps (CPU tensors)."""
    N, M, S, U, K, steps = case
    a = make(N, M, S, U, K, gen)
    b = {k: (tuple(x.clone() for x in v) if isinstance(v, tuple) else v.clone())
         for k, v in a.items()}
    for _ in range(steps):
        sel = selection(N, U, K, gen)
        want = step(rg.resolve_given_reference, b, sel)
        assert torch.equal(step(fn, a, sel), want)
        for name in ("kv", "counts"):
            assert torch.equal(a[name], b[name]), name
        for x, y in zip(a["state"], b["state"]):
            assert torch.equal(x, y)


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_resolve_given as trg

    def tri(sel, seq, bt, locs, hot, rows, state, host_pt, host, kv, counts):
        work = tuple(torch.empty(s, dtype=torch.int32)
                     for s in rg.workspace_shapes(sel.shape[0], sel.shape[1], state[0].shape[1]))
        trg.resolve_given(sel, seq, bt, locs, *work, hot, rows, state, host_pt, host, kv, counts)

    for i, case in enumerate(CASES):
        compare(case, torch.Generator().manual_seed(80 + i), tri)
    print("interpreter ok")


def test_kernel_in_interpreter():
    run_cases("test_resolve_given")


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("case", CASES + [(4, 8, 2560, 32768, 2048, 1)])
def test_gpu_resolve_given_first_step(case):
    """First step on the GPU (host pool pinned): locs equal the reference's."""
    g = torch.Generator().manual_seed(90 + sum(case))
    N, M, S, U, K, _ = case
    t = make(N, M, S, U, K, g, "cuda")
    t["host"] = t["host"].cpu().pin_memory()
    ref = {k: (tuple(s.cpu() for s in v) if isinstance(v, tuple) else v.cpu())
           for k, v in t.items()}
    sel = selection(N, U, K, g)
    want = step(rg.resolve_given_reference, ref, sel)
    got = step(rg.resolve_given, t, sel.cuda())
    assert torch.equal(got.cpu(), want) and torch.equal(t["kv"].cpu(), ref["kv"])
