"""ops/triton_latent_index.py and ops/triton_latent_write.py, the DSA path's per-layer kernels,
against their plain-torch references (ops/latent_index.py, ops/latent_write.py) on fresh random
inputs, bit for bit, under Triton's interpreter on the CPU (for real with -m cuda):

- ``convert_rows`` (the region rows, RESOLVE of the decode entries' selections, their rows and
  counts, the misses' copy) over several steps of shared slot state, under each policy with a
  kernel branch: out, valid, the latent pool's bytes, the state, the hit/miss counts; region
  tokens, padding tokens, decode tokens (base -2), padding decode entries (seq 0, scattered to
  the spare row), an entry RESOLVE skips (hot 0: its row empty), a selection buffer with a row
  stride wider than K, entries out of range;
- ``region_rows`` (no decode entries: a -2 token is -1 there) and ``valid_counts``;
- ``write_latent_rows``: bf16 rows from two strided parts, fp8_ds_mla's packed bytes as one
  part, into the host rows and the pool rows (-1 = none): the bytes of both."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases
from test_resolve_given import POLICIES, copy, make, state_tensors
from vllm_hisparse.ops import latent_index as li
from vllm_hisparse.ops import latent_write as lw

# (T tokens, n decode entries, runtime rows M, slots S, units U, K selected, steps)
CASES = [(3, 1, 2, 8, 20, 8, 3), (7, 3, 5, 16, 50, 12, 3), (9, 4, 6, 48, 97, 37, 3),
         (4, 2, 3, 5, 5, 5, 2)]


def plan(T, n, U, g):
    """A step's token roles: n decode entries (entry 1 a padding entry when n > 2), the rest
    region tokens (base a multiple of U) or padding (-1). (base, gather, scatter, seq)."""
    base = torch.where(torch.rand(T, generator=g) < 0.6,
                       torch.randint(0, 6, (T,), generator=g) * U, -1).long()
    toks = torch.randperm(T, generator=g)[:n].long()
    gather, scatter = toks.clone(), toks.clone()
    seq = torch.full((n,), U, dtype=torch.int64)
    base[toks] = -2
    if n > 2:                                   # a padding entry: any token, the spare row
        seq[1], scatter[1] = 0, T
        base[toks[1]] = torch.randint(0, 6, (1,), generator=g).item() * U
        gather[1] = T + 2                       # past T: clipped
    return base, gather, scatter, seq


def selections(T, U, K, g):
    """(T, K) int32, unique units a row (RESOLVE's contract), -1 and out-of-range entries, as a
    view of a wider buffer (vLLM's topk_indices_buffer rows are strided)."""
    wide = torch.full((T, K + 5), -1, dtype=torch.int32)
    for t in range(T):
        wide[t, :K] = torch.randperm(U + 3, generator=g)[:K].int()       # >= U: out of range
    wide[:, :K][torch.rand(T, K, generator=g) < 0.2] = -1
    return wide[:, :K]


def convert(fn, t, topk, base, gather, scatter, seq, U, dev):
    T, K = topk.shape
    n = gather.shape[0]
    out = torch.full((T + 1, K), 7, dtype=torch.int32, device=dev)
    valid = torch.full((T,), 7, dtype=torch.int32, device=dev)
    sel, locs = (torch.zeros(n, K, dtype=torch.int32, device=dev) for _ in range(2))
    d = {k: v.to(dev) for k, v in dict(base=base, gather=gather, scatter=scatter,
                                       seq=seq).items()}
    fn(topk.to(dev), d["base"], U, d["gather"], d["scatter"], d["seq"], t["bt"], t["hot"],
       t["rows"], t["state"], t["host_pt"], t["host"], t["kv"], t["counts"], sel, locs, out,
       valid)
    return out[:T].cpu(), valid.cpu()


def compare_convert(fn, case, policy, seed, dev="cpu") -> None:
    T, n, M, S, U, K, steps = case
    g = torch.Generator().manual_seed(seed)
    ref = make(n, M, S, U, K, g, policy)
    ref["bt"] = ref["bt"][:, :S].contiguous()
    got = copy(ref, dev)
    if dev != "cpu":
        got["host"] = got["host"].cpu().pin_memory()
    misses = 0
    for i in range(steps):
        base, gather, scatter, seq = plan(T, n, U, g)
        topk = selections(T, U, K, g)
        want = convert(li.convert_rows, ref, topk, base, gather, scatter, seq, U, "cpu")
        have = convert(fn, got, topk, base, gather, scatter, seq, U, dev)
        assert torch.equal(have[0], want[0]), (case, policy, i, "out")
        assert torch.equal(have[1], want[1]), (case, policy, i, "valid")
        assert torch.equal(got["kv"].cpu(), ref["kv"]), (case, policy, i, "kv bytes")
        assert torch.equal(got["counts"].cpu(), ref["counts"]), (case, policy, i, "counts")
        for x, y in zip(state_tensors(got["state"]), state_tensors(ref["state"])):
            assert torch.equal(x.cpu(), y), (case, policy, i, "state")
        assert (want[0] >= 0).any() and (want[0] == -1).any()
        misses = int(ref["counts"][1])
    assert misses > 0, "the case must miss"


def compare_region(fn, T, K, U, seed, dev="cpu") -> None:
    g = torch.Generator().manual_seed(seed)
    base, _, _, _ = plan(T, min(T, 2), U, g)            # -2 tokens: -1 rows here
    topk = selections(T, U, K, g)
    outs = []
    for f, d in ((li.region_rows, "cpu"), (fn, dev)):
        out = torch.full((T, K), 7, dtype=torch.int32, device=d)
        valid = torch.full((T,), 7, dtype=torch.int32, device=d)
        f(topk.to(d), base.to(d), U, out, valid)
        outs.append((out.cpu(), valid.cpu()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert (outs[0][0] >= 0).any() and (outs[0][1] == 0).any()
    rows = torch.randint(-2, 3, (T, K), generator=g, dtype=torch.int32)
    counts = []
    for f, d in ((li.valid_counts, "cpu"), (fn_valid(dev), dev)):
        v = torch.zeros(T, dtype=torch.int32, device=d)
        f(rows.to(d), v)
        counts.append(v.cpu())
    assert torch.equal(*counts)


def fn_valid(dev):
    from vllm_hisparse.ops import triton_latent_index as tli
    return tli.valid_counts


def compare_write(fn, seed, dev="cpu") -> None:
    """bf16 [kv_c, k_pe] from strided views, and 656-byte packed rows as one part."""
    g = torch.Generator().manual_seed(seed)
    T, P, M = 9, 20, 30
    for L, R, dtype in ((512, 64, torch.bfloat16), (656, 0, torch.uint8)):
        W = L + R
        src = (torch.randn(T, W + 8, generator=g) * 9).to(dtype) if dtype != torch.uint8 else \
            torch.randint(0, 256, (T, W + 8), generator=g, dtype=torch.uint8)
        a, b = src[:, :L], (src[:, L + 3:L + 3 + R] if R else None)
        host_row = torch.where(torch.rand(T, generator=g) < 0.7, torch.randperm(P, generator=g)[:T],
                               -1).long()
        pool_row = torch.where(torch.rand(T, generator=g) < 0.5, torch.randperm(M, generator=g)[:T],
                               -1).long()
        host0 = torch.randint(0, 256, (P, W * src.element_size()), generator=g,
                              dtype=torch.uint8).view(dtype)
        pool0 = torch.randint(0, 256, (M, W * src.element_size()), generator=g,
                              dtype=torch.uint8).view(dtype)
        res = []
        for f, d in ((lw.write_latent_rows, "cpu"), (fn, dev)):
            host = host0.clone() if d == "cpu" else host0.clone().pin_memory()
            pool = pool0.clone().to(d)
            f(a.to(d), None if b is None else b.to(d), host, host_row.to(d), pool, pool_row.to(d))
            if d != "cpu":
                torch.cuda.synchronize()
            res.append((host.view(torch.uint8).clone(), pool.cpu().view(torch.uint8)))
        assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1]), dtype
        assert not torch.equal(res[0][0], host0.view(torch.uint8)), "some host row written"


def run_interpreter_cases():
    from vllm_hisparse.ops import triton_latent_index as tli
    from vllm_hisparse.ops import triton_latent_write as tlw

    def tri_convert(topk, base, L, gather, scatter, seq, bt, hot, rows, state, host_pt, host,
                    kv, counts, sel, locs, out, valid):
        work = tuple(torch.empty(s, dtype=torch.int32)
                     for s in li.workspace_shapes(gather.shape[0], topk.shape[1], state.slots))
        tli.convert_rows(topk, base, L, gather, scatter, seq, bt, hot, rows, state, host_pt,
                         host, kv, counts, sel, locs, out, valid, *work)

    for policy in POLICIES:
        for i, case in enumerate(CASES):
            compare_convert(tri_convert, case, policy, 300 + i)
    compare_region(tli.region_rows, 7, 37, 50, 5)
    compare_write(lambda a, b, h, hr, p, pr: tlw.write_rows(a, b, h, hr, p, pr), 11)
    print("interpreter ok")


def test_kernels_equal_the_references_in_the_interpreter():
    run_cases("test_latent_index_kernels")


def test_reference_of_convert_rows_against_a_loop():
    """The reference itself on a step that resolves nothing (no decode entries: every token a
    region or padding token) against the rule written as a loop, and the decode token's row
    against RESOLVE's own reference."""
    T, n, M, S, U, K = 6, 2, 3, 8, 30, 6
    g = torch.Generator().manual_seed(7)
    t = make(n, M, S, U, K, g)
    t["bt"] = t["bt"][:, :S].contiguous()
    base, gather, scatter, seq = plan(T, n, U, g)
    topk = selections(T, U, K, g)
    out, valid = convert(li.convert_rows, t, topk, base, gather, scatter, seq, U, "cpu")
    for tk in range(T):
        b = int(base[tk])
        if b == -2:
            d = int((gather == tk).nonzero()[0])
            row = out[tk]
            assert [int(x) >= 0 for x in row] == [0 <= int(u) < U for u in topk[tk]], d
            assert set(int(x) for x in row if x >= 0) <= set(t["bt"][d].tolist())
        else:
            for j in range(K):
                u = int(topk[tk, j])
                assert int(out[tk, j]) == (b + u if b >= 0 and 0 <= u < U else -1)
        assert int(valid[tk]) == sum(int(x) >= 0 for x in out[tk])


def test_a_doctored_kernel_is_caught():
    """The compare must fail on a wrong kernel (an off-by-one region row)."""
    def wrong(topk, base, L, gather, scatter, seq, bt, hot, rows, state, host_pt, host, kv,
              counts, sel, locs, out, valid):
        li.convert_rows(topk, base, L, gather, scatter, seq, bt, hot, rows, state, host_pt, host,
                        kv, counts, sel, locs, out, valid)
        out[:topk.shape[0]][out[:topk.shape[0]] > 0] += 1
    with pytest.raises(AssertionError):
        compare_convert(wrong, CASES[1], "lru", 5)


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES + [(64, 16, 20, 2560, 32768, 2048, 3)])
def test_kernels_on_the_gpu(case, policy):
    """convert_rows on the GPU (host pool pinned, read over UVA) from one start as the reference
    on the CPU; region_rows, valid_counts and write_latent_rows too."""
    compare_convert(li.convert_rows, case, policy, 400 + sum(case), "cuda")
    if policy == "lru" and case is CASES[0]:
        from vllm_hisparse.ops import triton_latent_index as tli
        compare_region(tli.region_rows, 64, 2048, 4096, 9, "cuda")
        compare_write(lw.write_latent_rows, 12, "cuda")
