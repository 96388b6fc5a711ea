"""ops/stable_topk.py (indexer "dsa_stable"): the top-k of the DSA indexer's logits by (score
descending, column ascending; written in column order), against a per-row sort in Python, with
ties planted at the k-th score; and vllm/topk_swap.py, which installs it in place of vLLM's top-k kernels."""
from __future__ import annotations

import math
import types

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import indexers
from vllm_hisparse.ops import stable_topk as st

# (rows, columns W, k): k at 1, warp-ish 31/32/33, k == W, k > W, W == 0
SHAPES = [(7, 50, 8), (9, 64, 32), (5, 33, 31), (6, 97, 33), (4, 40, 40), (3, 20, 32), (2, 0, 4),
          (12, 300, 1)]


def _rule(row: list[float], lo: int, hi: int, k: int, relative: bool) -> list[int]:
    """The reference: columns [lo, hi) ordered by score descending (+0.0 above -0.0, as the
    fp32 bits rank them), then column ascending; the first k, in column order, -1 after them."""
    def key(c):
        v = row[c]
        return (-v, 0 if math.copysign(1.0, v) > 0 else 1, c)
    cols = sorted(sorted(range(max(lo, 0), min(hi, len(row))), key=key)[:k])
    cols = [c - lo if relative else c for c in cols]
    return cols + [-1] * (k - len(cols))


def _planted(g, R, W, k):
    """(R, W) fp32 logits of few distinct values (so ties are everywhere), each row's k-th largest
    in range copied to other columns of its range, some -0.0 / +0.0 and negative scores, and
    per-row ranges [ks, ke) (an empty one, a full one, short ones of fewer than k candidates)."""
    x = torch.randint(-4, 4, (R, W), generator=g).float() * 0.25
    x[torch.rand(R, W, generator=g) < 0.1] = 0.0
    x[torch.rand(R, W, generator=g) < 0.1] = -0.0
    ks = torch.randint(0, max(W, 1), (R,), generator=g)
    ke = torch.minimum(ks + torch.randint(0, W + 1, (R,), generator=g), torch.tensor(W))
    if R > 2:
        ks[0], ke[0] = 0, W               # the whole row
        ks[1], ke[1] = W // 2, W // 2     # no candidate
    for r in range(R):
        lo, hi = int(ks[r]), int(ke[r])
        if hi - lo > k:
            kth = x[r, lo:hi].sort(descending=True).values[k - 1]
            spots = torch.randint(lo, hi, (3,), generator=g)
            x[r, spots] = kth              # more columns tied at the boundary
    return x, ks.int(), ke.int()


@pytest.mark.parametrize("R,W,k", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_equals_the_sort_rule_with_ties_at_the_boundary(R, W, k, seed):
    g = torch.Generator().manual_seed(seed * 100 + W)
    x, ks, ke = _planted(g, R, W, k)
    out = torch.full((R, k), 7777, dtype=torch.int32)                 # poison
    st.top_k_per_row_prefill(x, ks, ke, out, R, x.stride(0), x.stride(1), k)
    want = [_rule(x[r].tolist(), int(ks[r]), int(ke[r]), k, True) for r in range(R)]
    assert out.dtype == torch.int32 and out.tolist() == want


def test_the_planted_rows_do_tie_at_the_boundary():
    """The cases above must contain ties across the k-th score (else they test nothing)."""
    g = torch.Generator().manual_seed(64)
    x, ks, ke = _planted(g, 9, 64, 32)
    r = 0                                             # the full row
    s = x[r].sort(descending=True).values
    assert s[31] == s[32]


def test_chunks_of_rows_give_the_same_rows(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x, ks, ke = _planted(g, 11, 70, 16)
    whole = torch.empty(11, 16, dtype=torch.int32)
    st.top_k_per_row_prefill(x, ks, ke, whole, 11, 70, 1, 16)
    monkeypatch.setattr(st, "CHUNK_ELEMS", 150)                # 2 rows a chunk
    chunked = torch.empty(11, 16, dtype=torch.int32)
    st.top_k_per_row_prefill(x, ks, ke, chunked, 11, 70, 1, 16)
    assert torch.equal(whole, chunked)


def test_a_strided_view_and_a_wider_buffer():
    """vLLM passes ``topk_indices_buffer[a:b, :k]``: a view of a wider buffer; columns beyond k
    and rows beyond num_rows stay as they were."""
    g = torch.Generator().manual_seed(6)
    x, ks, ke = _planted(g, 8, 60, 12)
    buf = torch.full((10, 20), 5555, dtype=torch.int32)
    st.top_k_per_row_prefill(x, ks, ke, buf[:, :12], 8, 60, 1, 12)
    want = [_rule(x[r].tolist(), int(ks[r]), int(ke[r]), 12, True) for r in range(8)]
    assert buf[:8, :12].tolist() == want
    assert (buf[:, 12:] == 5555).all() and (buf[8:] == 5555).all()


@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_entries_equal_the_sort_rule(next_n):
    g = torch.Generator().manual_seed(7 + next_n)
    B, W, k = 5, 90, 33
    x, _, _ = _planted(g, B * next_n, W, k)
    L = torch.tensor([90, 0, 33, 10, 60], dtype=torch.int32)           # a padding row (0)
    per_token = (L[:, None] - next_n + 1 + torch.arange(next_n)).clamp(min=0).int()   # (B, next_n)
    want = [_rule(x[r].tolist(), 0, int(per_token.reshape(-1)[r]), k, False)
            for r in range(B * next_n)]
    for name in ("persistent_topk", "cooperative_topk"):
        out = torch.full((B * next_n, k), 7777, dtype=torch.int32)
        getattr(st, name)(x, per_token.contiguous(), out, torch.empty(8, dtype=torch.uint8), k, W)
        assert out.tolist() == want, name
    for lens in (per_token, L):                       # 2-D per token, and 1-D per sequence
        out = torch.full((B * next_n, k), 7777, dtype=torch.int32)
        st.top_k_per_row_decode(x, next_n, lens, out, B * next_n, W, 1, k)
        assert out.tolist() == want


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_ties_the_set_is_torch_topk(seed):
    g = torch.Generator().manual_seed(seed)
    R, W, k = 16, 500, 64
    x = torch.randn(R, W, generator=g)
    assert x.unique().numel() == R * W
    got = st.stable_topk(x, torch.zeros(R, dtype=torch.int32), torch.full((R,), W), k)
    ref = x.topk(k, dim=1).indices
    assert all(set(a) == set(b) for a, b in zip(got.tolist(), ref.tolist()))
    assert torch.equal(got.long(), ref.sort(dim=1).values)     # in column order


def test_the_tie_rule_is_not_what_a_kernel_may_do():
    """The control: among tied scores the set depends on the rule; the lowest columns win here,
    so a selection keeping the highest tied columns (an atomics order could) differs."""
    x = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5]])
    got = st.stable_topk(x, torch.tensor([0]), torch.tensor([5]), 2)
    assert got.tolist() == [[1, 2]]
    assert set(got[0].tolist()) != {2, 3}
    zeros = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0]])         # +0.0 ranks above -0.0
    assert st.stable_topk(zeros, torch.tensor([0]), torch.tensor([5]), 3).tolist() == [[0, 1, 3]]
    neg = torch.tensor([[-3.0, -1.0, -2.0, -1.0]])
    assert st.stable_topk(neg, torch.tensor([1]), torch.tensor([4]), 2).tolist() == [[1, 3]]


def test_registry_and_config_name_dsa_stable():
    cls = indexers.get("dsa_stable")
    assert cls.name == "dsa_stable" and cls.serves == "mla" and cls.stable_topk
    assert issubclass(cls, indexers.get("dsa_sorted"))
    assert "dsa_stable" in indexers.serving("mla")
    cfg = HiSparseConfig(indexer="dsa_stable", top_k=64, device_buffer_size=64, dense_layers=())
    assert cfg.indexer == "dsa_stable" and cls.unit_tokens(cfg) == 1
    buf = torch.tensor([[5, -1, 2, 9], [-1, -1, 3, 0]], dtype=torch.int32)
    assert cls.mla_selection(buf, 2, 0).tolist() == [[2, 5, 9, -1], [0, 3, -1, -1]]
    for other in ("dsa", "dsa_sorted", "quest"):
        assert not getattr(indexers.get(other), "stable_topk", False)


def _fakes(swaps):
    """A fake ``vllm._custom_ops`` and ``torch.ops._C``: the four kernels and one bystander each."""
    orig = {n: (lambda *a, _n=n: _n) for _, n in swaps}
    mod = types.SimpleNamespace(top_k_per_row_prefill=orig["top_k_per_row_prefill"],
                                top_k_per_row_decode=orig["top_k_per_row_decode"], other=len)
    ns = types.SimpleNamespace(cooperative_topk=orig["cooperative_topk"],
                               persistent_topk=orig["persistent_topk"], other=abs)
    return mod, ns, orig


def test_the_swap_replaces_exactly_the_four_kernels_and_only_for_dsa_stable():
    from vllm_hisparse.vllm import topk_swap

    mod, ns, orig = _fakes(topk_swap.SWAPS)
    t = {"custom_ops": mod, "C": ns}
    for name in ("dsa", "dsa_sorted"):
        assert not topk_swap.install_for(indexers.get(name), t)
        assert mod.top_k_per_row_prefill is orig["top_k_per_row_prefill"]
    before_mod, before_ns = dict(vars(mod)), dict(vars(ns))
    try:
        assert topk_swap.install_for(indexers.get("dsa_stable"), t)
        assert topk_swap.install_for(indexers.get("dsa_stable"), t)      # idempotent
        changed = {k for k in vars(mod) if k in before_mod and vars(mod)[k] is not before_mod[k]}
        changed |= {k for k in vars(ns) if k in before_ns and vars(ns)[k] is not before_ns[k]}
        assert changed == {n for _, n in topk_swap.SWAPS}
        added = (set(vars(mod)) - set(before_mod)) | (set(vars(ns)) - set(before_ns))
        assert added == {topk_swap.ORIG + n for _, n in topk_swap.SWAPS}   # the originals kept
        assert mod.top_k_per_row_prefill is st.top_k_per_row_prefill
        assert mod.top_k_per_row_decode is st.top_k_per_row_decode
        assert ns.cooperative_topk is st.cooperative_topk
        assert ns.persistent_topk is st.persistent_topk
    finally:
        topk_swap.uninstall(t)
    assert vars(mod) == before_mod and vars(ns) == before_ns


def test_the_swap_on_vllms_own_objects():
    """The real ``vllm._custom_ops`` module and ``torch.ops._C`` namespace, as sparse_attn_indexer
    reads them at call time (``ops.top_k_per_row_prefill``, ``torch.ops._C.persistent_topk``)."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops

    from vllm_hisparse.vllm import topk_swap

    was = ops.top_k_per_row_prefill, ops.top_k_per_row_decode
    try:
        assert topk_swap.install_for(indexers.get("dsa_stable"))
        assert ops.top_k_per_row_prefill is st.top_k_per_row_prefill
        assert ops.top_k_per_row_decode is st.top_k_per_row_decode
        assert torch.ops._C.persistent_topk is st.persistent_topk
        assert torch.ops._C.cooperative_topk is st.cooperative_topk
    finally:
        topk_swap.uninstall()
    assert (ops.top_k_per_row_prefill, ops.top_k_per_row_decode) == was
    assert getattr(torch.ops._C, "persistent_topk", None) is not st.persistent_topk
