"""RESOLVE of a given selection (ops/resolve_given.py): the reference checked against the
properties RESOLVE must have (not its own code), and the Triton kernel (through Triton's
interpreter on the CPU, for real with -m cuda) equal to the reference bit for bit over several
steps of shared state: locs, the hot buffer's bytes, the slot state, the hit/miss counts; under
each policy the kernel has a branch for (lru, crf)."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases
from vllm_hisparse.ops import resolve_given as rg
from vllm_hisparse.slots import HotBufferState
from vllm_hisparse.slots.crf import HIT

ROW = 576                        # an MLA latent row (opaque to RESOLVE)
# (N rows, runtime rows M, slots S, units U, K selected, steps)
CASES = [(1, 2, 8, 20, 8, 3), (3, 5, 16, 50, 12, 4), (4, 6, 33, 97, 32, 3), (2, 3, 5, 5, 5, 2),
         (3, 4, 48, 120, 37, 3)]   # K = 37: the miss-copy's last block of 16 partial
POLICIES = ["lru", "crf"]        # the policies the kernel has a branch for (slots.served())


def make(N, M, S, U, K, gen, policy="lru", dev="cpu"):
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
    t = dict(rows=rows, host=host, host_pt=host_pt, kv=kv, bt=bt, seq=seq, hot=hot,
             counts=torch.zeros(2, dtype=torch.int64))
    t = {k: v.to(dev) for k, v in t.items()}
    t["state"] = HotBufferState.create(M, S, U, policy, dev)
    return t


def copy(t, dev="cpu"):
    """A deep copy of make's tensors on dev (the state over copies of its tensors)."""
    st = t["state"]
    out = {k: v.to(dev, copy=True) for k, v in t.items() if k != "state"}
    out["state"] = HotBufferState.wrap(st.slot_unit.to(dev, copy=True),
                                       st.unit_slot.to(dev, copy=True),
                                       {k: v.to(dev, copy=True) for k, v in st.pstate.items()},
                                       st.policy)
    return out


def state_tensors(st):
    return [st.slot_unit, st.unit_slot, *st.pstate.values()]


def selection(N, U, K, gen, blank=False):
    """Unique units per row in a random order, -1 at random places (blank: row 0 all -1, which
    RESOLVE must leave alone: no policy update)."""
    sel = torch.stack([torch.randperm(U, generator=gen)[:K] for _ in range(N)]).int()
    sel[torch.rand(N, K, generator=gen) < 0.2] = -1
    if blank:
        sel[0] = -1
    return sel


def step(fn, t, sel):
    locs = torch.full(sel.shape, -7, dtype=torch.int32, device=sel.device)
    fn(sel, t["seq"], t["bt"], locs, t["hot"], t["rows"], t["state"], t["host_pt"], t["host"],
       t["kv"], t["counts"])
    return locs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_reference_properties(case, policy):
    N, M, S, U, K, steps = case
    g = torch.Generator().manual_seed(sum(case))
    t = make(N, M, S, U, K, g, policy)
    su, us, pol = t["state"].kernel_state()
    spare = t["kv"][N * S:].clone()
    valid_total = 0
    for i in range(steps):
        sel = selection(N, U, K, g, blank=i == 1)
        before = pol.clone()
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
            if policy == "lru":                          # a recency order of every slot
                assert sorted(pol[row].tolist()) == list(range(S))
            else:                                        # a value on each occupied slot only
                assert torch.equal(pol[row] >= 0, su[row] >= 0) and (pol[row] < 16 * HIT).all()
            if not (sel[r] >= 0).any():
                assert torch.equal(pol[row], before[row]), "an all -1 row changed its state"
    assert int(t["counts"].sum()) == valid_total
    assert torch.equal(t["kv"][N * S:], spare)


def compare(case, gen, fn, policy):
    """fn and the reference from the same start over the case's steps (CPU tensors); misses
    happen."""
    N, M, S, U, K, steps = case
    a = make(N, M, S, U, K, gen, policy)
    b = copy(a)
    for i in range(steps):
        sel = selection(N, U, K, gen, blank=i == 1)
        want = step(rg.resolve_given_reference, b, sel)
        assert torch.equal(step(fn, a, sel), want), (policy, case, i)
        for name in ("kv", "counts"):
            assert torch.equal(a[name], b[name]), (policy, case, i, name)
        for x, y in zip(state_tensors(a["state"]), state_tensors(b["state"])):
            assert torch.equal(x, y), (policy, case, i)
    assert int(b["counts"][1]) > 0


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_resolve_given as trg

    def tri(sel, seq, bt, locs, hot, rows, state, host_pt, host, kv, counts):
        work = tuple(torch.empty(s, dtype=torch.int32)
                     for s in rg.workspace_shapes(sel.shape[0], sel.shape[1], state.slots))
        trg.resolve_given(sel, seq, bt, locs, *work, hot, rows, state, host_pt, host, kv, counts)

    for policy in POLICIES:
        for i, case in enumerate(CASES):
            compare(case, torch.Generator().manual_seed(80 + i), tri, policy)
    print("interpreter ok")


def test_kernel_in_interpreter():
    run_cases("test_resolve_given")


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES + [(4, 8, 2560, 32768, 2048, 3)])
def test_gpu_resolve_given_steps(case, policy):
    """The case's steps on the GPU (host pool pinned) from one start as the reference on the CPU:
    locs, bytes, state and counts equal after every step."""
    g = torch.Generator().manual_seed(90 + sum(case))
    N, M, S, U, K, steps = case
    t = make(N, M, S, U, K, g, policy, "cuda")
    t["host"] = t["host"].cpu().pin_memory()
    ref = copy(t)
    for i in range(steps):
        sel = selection(N, U, K, g, blank=i == 1)
        want = step(rg.resolve_given_reference, ref, sel)
        got = step(rg.resolve_given, t, sel.cuda())
        assert torch.equal(got.cpu(), want) and torch.equal(t["kv"].cpu(), ref["kv"]), i
        assert torch.equal(t["counts"].cpu(), ref["counts"]), i
        for x, y in zip(state_tensors(t["state"]), state_tensors(ref["state"])):
            assert torch.equal(x.cpu(), y), i
