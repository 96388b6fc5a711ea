"""The union of a request's query tokens' selections (ops/selection_union.py) against its loop
reference on fresh random inputs (overlaps, -1 anywhere, positions past a token's own, padding
tokens), what the union must be (each causal position once, at its first occurrence; every entry
finds its position through ``first``), the capacity rule of DSA verify rows
(core/latent_spec.py: device_buffer_size >= (k + 1) x top_k) refused in one line at each door, and
unions through the existing Triton RESOLVE kernel (ops/triton_resolve_given.py, Triton's
interpreter on the CPU) == its reference, with B = n x K exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_interpreter import run_cases
from vllm_hisparse.core import latent_spec
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.latent_admission import LatentAdmission
from vllm_hisparse.core.latent_pool import LatentPool
from vllm_hisparse.core.latent_step import LatentStep
from vllm_hisparse.ops.selection_union import selection_union, selection_union_reference
from vllm_hisparse.ops.sparse_mla import LATENT_ROW

SHAPES = [(0, 2, 4), (1, 1, 1), (3, 1, 7), (4, 2, 16), (5, 4, 33), (2, 5, 32)]   # R, n, K
SEEDS = [0, 1, 2]


def random_inputs(R, n, K, seed):
    """Selections from a small range (overlaps within and across tokens), some past the token's
    position, -1 anywhere; token positions increasing per request, some tokens padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    span = max(2, K + K // 2)
    sel = torch.randint(-1, span, (R, n, K), generator=g).int()
    p0 = torch.randint(0, span, (R, 1), generator=g)
    pos = p0 + torch.arange(n)[None]
    pos[torch.rand(R, n, generator=g) < 0.2] = -1
    return sel, pos


@pytest.mark.parametrize("R, n, K", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_union_equals_the_reference(R, n, K, seed):
    sel, pos = random_inputs(R, n, K, seed)
    union, first = selection_union(sel, pos)
    ru, rf = selection_union_reference(sel, pos)
    assert union.dtype == ru.dtype == torch.int32 and first.dtype == rf.dtype == torch.int64
    assert torch.equal(union, ru) and torch.equal(first, rf)
    for r in range(R):                                  # what the union must be, from scratch
        want = {int(u) for j in range(n) for u in sel[r, j]
                if int(pos[r, j]) >= 0 and 0 <= int(u) <= int(pos[r, j])}
        got = union[r][union[r] >= 0].tolist()
        assert len(got) == len(set(got)) and set(got) == want
        flat = sel[r].reshape(-1).long()
        live = (pos[r].repeat_interleave(K) >= 0) & (flat >= 0) & (flat <= pos[r].repeat_interleave(K))
        assert torch.equal(union[r][first[r]][live].long(), flat[live])
        assert (first[r] <= torch.arange(n * K)).all()


def test_union_of_one_token_is_its_selection():
    g = torch.Generator().manual_seed(3)
    sel = torch.stack([torch.randperm(50, generator=g)[:12] for _ in range(4)])[:, None].int()
    sel[1, 0, 9:] = -1
    pos = torch.full((4, 1), 60)
    union, first = selection_union(sel, pos)
    assert torch.equal(union, sel[:, 0]) and torch.equal(first, torch.arange(12).expand(4, 12))


def test_union_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"sel must be \(R, n, K\)"):
        selection_union(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3))


# ---- the capacity rule --------------------------------------------------------------------------
@pytest.mark.parametrize("B, top_k, k, ok", [(2048, 2048, 0, True), (4095, 2048, 1, False),
                                             (4096, 2048, 1, True), (8191, 2048, 3, False),
                                             (33, 11, 2, True)])
def test_buffer_rule(B, top_k, k, ok):
    assert latent_spec.buffer_needed(top_k, k) == (k + 1) * top_k
    if ok:
        latent_spec.check_buffer(B, top_k, k)
    else:
        with pytest.raises(ValueError, match=rf"device_buffer_size={B} must be >= .* = "
                                             rf"{(k + 1) * top_k} .*device_buffer_size="
                                             rf"{(k + 1) * top_k}$"):
            latent_spec.check_buffer(B, top_k, k)


def decoding(B=8):
    pool = LatentPool(1, 64, B, 1, 1)
    host = HostKVPool(1, 64, 1, 1, LATENT_ROW // 2, torch.bfloat16, pin=False)
    adm = LatentAdmission(pool, host)
    adm.admit("a", 10, 10)
    adm.prompt_done("a")
    return adm


def test_plan_and_convert_refuse_past_the_rule():
    adm = decoding(B=8)
    with pytest.raises(ValueError, match="one token a step"):          # today's path unchanged
        LatentStep.plan(adm, ["a"], [0, 0], [10, 11])
    with pytest.raises(ValueError, match="at most verify_tokens=2"):
        LatentStep.plan(adm, ["a"], [0, 0, 0], [10, 11, 12], verify_tokens=2)
    with pytest.raises(ValueError, match="verify_tokens=0 must be None or >= 1"):
        LatentStep.plan(adm, ["a"], [0], [10], verify_tokens=0)
    step = LatentStep.plan(adm, ["a"], np.zeros(2, np.int64), [10, 11], verify_tokens=2)
    assert step.verify is not None and step.dec_tok.numel() == 0
    with pytest.raises(ValueError, match=r"device_buffer_size=8 must be >= .* = 10"):
        step.convert(0, torch.full((2, 5), -1, dtype=torch.int32))      # 2 x 5 > B = 8
    out, valid = step.convert(0, torch.tensor([[3, 10, -1, 11], [11, 2, 3, -1]]).int())
    assert valid.tolist() == [2, 3]                 # 11 is past token 0's position: masked
    assert out[0, 0] == out[1, 2] and out[0, 2] == out[0, 3] == out[1, 3] == -1
    assert len({int(x) for x in out[out >= 0]}) == 4          # positions 3, 10, 11, 2


# ---- the union through the Triton RESOLVE kernel (interpreter on the CPU) ------------------------
# (N rows, runtime rows M, tokens n, top_k K, units U, steps): slots S = n x K, the rule's least
UNION_CASES = [(3, 5, 2, 8, 40, 3), (2, 3, 4, 5, 30, 3), (4, 6, 1, 12, 50, 2)]


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1: unions of random token selections (with
    overlaps and causal masking) through ops/triton_resolve_given.py == resolve_given_reference,
    step by step over shared state: locs, the hot buffer's bytes, the state, the counts; rows of
    bf16 values and of fp8_ds_mla's 656 bytes (uint8: the kernel's copy moves opaque elements)."""
    import test_resolve_given as base

    from vllm_hisparse.ops import resolve_given as rg
    from vllm_hisparse.ops import triton_resolve_given as trg

    def tri(sel, seq, bt, locs, hot, rows, state, host_pt, host, kv, counts):
        work = tuple(torch.empty(s, dtype=torch.int32)
                     for s in rg.workspace_shapes(sel.shape[0], sel.shape[1], state.slots))
        trg.resolve_given(sel, seq, bt, locs, *work, hot, rows, state, host_pt, host, kv, counts)

    cases = [(p, i, c, fp8) for p in base.POLICIES for i, c in enumerate(UNION_CASES)
             for fp8 in (False, True)]
    for policy, i, (N, M, n, K, U, steps), fp8 in cases:
        g = torch.Generator().manual_seed(70 + i)
        a = base.make(N, M, n * K, U, n * K, g, policy)
        if fp8:                                   # 656-byte rows (ops/fp8_ds_mla.py)
            for k in ("host", "kv"):
                a[k] = torch.randint(0, 256, (a[k].shape[0], 656), generator=g,
                                     dtype=torch.uint8)
        b = base.copy(a)
        for s in range(steps):
            sel = torch.randint(0, U, (N, n, K), generator=g).int()
            pos = U - n + torch.arange(n).repeat(N, 1) - torch.randint(0, 3, (N, 1), generator=g)
            union, _ = selection_union(sel, pos)
            want = base.step(rg.resolve_given_reference, b, union)
            assert torch.equal(base.step(tri, a, union), want), (policy, i, s)
            assert torch.equal(a["kv"], b["kv"]) and torch.equal(a["counts"], b["counts"])
            for x, y in zip(base.state_tensors(a["state"]), base.state_tensors(b["state"])):
                assert torch.equal(x, y), (policy, i, s)
        assert int(b["counts"][1]) > 0 and int(b["counts"][0]) > 0
    print("interpreter ok")


def test_union_through_the_kernel_in_interpreter():
    run_cases("test_dsa_spec_union")


# (N rows, runtime rows M, tokens n, top_k K, units U, steps): DeepSeek-V3.2's top_k at B = n x K
GPU_UNION_CASES = [(4, 8, 2, 2048, 32768, 3), (4, 8, 4, 2048, 32768, 3)]


def gpu_union_steps(case, policy):
    """The union through the Triton kernel on the GPU (the host pool copied to the GPU: no UVA,
    no extension) from one start as the reference on the CPU: equal after every step."""
    import test_resolve_given as base

    from vllm_hisparse.ops import resolve_given as rg

    N, M, n, K, U, steps = case
    g = torch.Generator().manual_seed(60 + n)
    t = base.make(N, M, n * K, U, n * K, g, policy, "cuda")
    ref = base.copy(t)
    for s in range(steps):
        sel = torch.randint(0, U, (N, n, K), generator=g).int()
        pos = U - n + torch.arange(n).repeat(N, 1)
        union, _ = selection_union(sel, pos)
        want = base.step(rg.resolve_given_reference, ref, union)
        got = base.step(rg.resolve_given, t, union.cuda())
        assert torch.equal(got.cpu(), want) and torch.equal(t["kv"].cpu(), ref["kv"]), s
        assert torch.equal(t["counts"].cpu(), ref["counts"]), s
        for x, y in zip(base.state_tensors(t["state"]), base.state_tensors(ref["state"])):
            assert torch.equal(x.cpu(), y), s
    assert int(ref["counts"][0]) > 0 and int(ref["counts"][1]) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["lru", "crf"])
@pytest.mark.parametrize("case", GPU_UNION_CASES)
def test_gpu_union_through_resolve_given(case, policy):
    gpu_union_steps(case, policy)
