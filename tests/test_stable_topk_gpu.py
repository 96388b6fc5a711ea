"""On a GPU: the stand-ins of ops/stable_topk.py select what vLLM 0.26's own top-k kernels select
when no two scores tie (fp32 randn: ties at the k-th score practically never occur), with the
arguments vLLM's sparse_attn_indexer passes them. The contract the stand-ins were written from
(relative prefill indices, decode lengths one per row, rows shorter than k) was read from the
Python call sites and upstream sources, not run: this is where it is checked. Compared as sets per
row (vLLM's kernels leave their order unspecified; the stand-ins write position order)."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.ops import stable_topk as st

pytestmark = pytest.mark.cuda
K = 2048


def _rows_as_sets(out: torch.Tensor) -> list[list[int]]:
    return [sorted(int(i) for i in row if int(i) >= 0) for row in out.cpu()]


def _gen():
    return torch.Generator().manual_seed(0)


def test_prefill_equals_vllms_kernel():
    ops = pytest.importorskip("vllm._custom_ops")
    g = _gen()
    R, W = 48, 6000
    x = torch.randn(R, W, generator=g).cuda()
    ks = torch.randint(0, 1500, (R,), generator=g).int()
    ke = torch.minimum(ks + torch.randint(200, 4500, (R,), generator=g).int(), torch.tensor(W))
    ks, ke = ks.int().cuda(), ke.int().cuda()          # some rows shorter than K
    a = torch.full((R, K), -7, dtype=torch.int32, device="cuda")
    b = a.clone()
    ops.top_k_per_row_prefill(x, ks, ke, a, R, x.stride(0), x.stride(1), K)
    st.top_k_per_row_prefill(x, ks, ke, b, R, x.stride(0), x.stride(1), K)
    assert (ke - ks < K).any() and (ke - ks > K).any()
    assert _rows_as_sets(a) == _rows_as_sets(b)
    assert ((a == -1).sum(1) == (b == -1).sum(1)).all()


@pytest.mark.parametrize("rows", [8, 40])          # cooperative_topk takes <= 32 rows
def test_decode_entries_equal_vllms_kernels(rows):
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.model_executor.layers.sparse_attn_indexer import RADIX_TOPK_WORKSPACE_SIZE

    g = _gen()
    W = 8192
    x = torch.randn(rows, W, generator=g).cuda()
    lens = torch.randint(100, W, (rows, 1), generator=g).int().cuda()   # (B, next_n = 1)
    lens[0, 0] = 0                                                      # a padding row
    ws = torch.empty(RADIX_TOPK_WORKSPACE_SIZE, dtype=torch.uint8, device="cuda")
    got = {}
    for name in ("persistent_topk", "cooperative_topk"):
        if name == "cooperative_topk" and rows > 32:
            continue
        o = torch.full((rows, K), -7, dtype=torch.int32, device="cuda")
        getattr(torch.ops._C, name)(x, lens, o, ws, K, W)
        s = torch.full((rows, K), -7, dtype=torch.int32, device="cuda")
        getattr(st, name)(x, lens, s, ws, K, W)
        got[name] = (_rows_as_sets(o), _rows_as_sets(s))
    o = torch.full((rows, K), -7, dtype=torch.int32, device="cuda")
    ops.top_k_per_row_decode(x, 1, lens, o, rows, x.stride(0), x.stride(1), K)
    s = torch.full((rows, K), -7, dtype=torch.int32, device="cuda")
    st.top_k_per_row_decode(x, 1, lens, s, rows, x.stride(0), x.stride(1), K)
    got["top_k_per_row_decode"] = (_rows_as_sets(o), _rows_as_sets(s))
    for name, (theirs, ours) in got.items():
        assert theirs == ours, name
    assert got["persistent_topk"][1][0] == []                       # the padding row: nothing
