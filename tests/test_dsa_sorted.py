"""indexer "dsa_sorted" (core/indexers/dsa/sorted.py): DSA's selection, each token's row sorted by
position with its -1s last, so the sparse-MLA sum's order depends on the selected set alone."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import indexers
from vllm_hisparse.core.indexers.dsa.sorted import sorted_selection
from vllm_hisparse.ops.sparse_mla import sparse_mla_decode


def _rows(g, T, K, n):
    """(T, K) int32: distinct positions < n at random columns, -1 anywhere (a full row, an empty
    row and a row of -1s between positions included)."""
    sel = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        m = [K, 0, K // 2][t] if t < 3 else int(torch.randint(0, K + 1, (1,), generator=g))
        cols = torch.randperm(K, generator=g)[:m]
        sel[t, cols] = torch.randperm(n, generator=g)[:m].int()
    return sel


def _reference(sel):
    out = []
    for row in sel.tolist():
        pos = sorted(p for p in row if p >= 0)
        out.append(pos + [-1] * (len(row) - len(pos)))
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sorted_selection_equals_the_plain_reference(seed):
    g = torch.Generator().manual_seed(seed)
    sel = _rows(g, 9, 64, 500)
    before = sel.clone()
    got = sorted_selection(sel)
    assert got.dtype == torch.int32 and torch.equal(got, _reference(sel))
    assert torch.equal(sel, before)                       # a new tensor: vLLM's buffer untouched


def test_the_registry_serves_it_on_mla_models_only():
    cls = indexers.get("dsa_sorted")
    assert cls.name == "dsa_sorted" and cls.serves == "mla"
    assert "dsa_sorted" in indexers.serving("mla") and "dsa_sorted" not in indexers.serving("gqa")
    assert cls.unit_tokens(HiSparseConfig(indexer="dsa_sorted", top_k=64,
                                          device_buffer_size=64, dense_layers=())) == 1
    buf = _rows(torch.Generator().manual_seed(3), 12, 64, 300)
    got = cls.mla_selection(buf, 5, layer=0)                 # the step's first 5 tokens only
    assert got.shape == (5, 64) and torch.equal(got, _reference(buf[:5]))
    assert torch.equal(indexers.get("dsa").mla_selection(buf, 5, 0), buf[:5])   # dsa: as written


def test_the_attention_no_longer_depends_on_the_order_written():
    """Two orders of the same selected sets: sorted, the fp32 sums agree bit for bit; as written
    (the control), at least one row differs in its last bits, so the test could fail."""
    g = torch.Generator().manual_seed(4)
    R, H, L, Rd, K, M = 6, 4, 512, 64, 256, 2000
    ql, qpe = torch.randn(R, H, L, generator=g), torch.randn(R, H, Rd, generator=g)
    kv = torch.randn(M, L + Rd, generator=g)
    a = _rows(g, R, K, M)
    b = torch.stack([row[torch.randperm(K, generator=g)] for row in a])    # same sets, reordered
    run = lambda idx: sparse_mla_decode(ql, qpe, kv, idx, 0.05)            # noqa: E731
    assert torch.equal(run(sorted_selection(a)), run(sorted_selection(b)))
    assert not torch.equal(run(a), run(b))
    assert torch.allclose(run(a), run(b), atol=1e-5)                      # the same math
