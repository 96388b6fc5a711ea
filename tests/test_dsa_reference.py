"""The DSA plain-torch references (ops/sparse_mla.py, ops/dsa_indexer.py) and the DSA indexer
behind the indexer interface, each against a different computation:

- sparse MLA decode (absorbed query, latent rows, c as the value) == attention of the original
  un-absorbed heads over decompressed K/V (k_nope = W_UK c, v = W_UV c), up-projected, in fp64;
- the lightning indexer's logits == a per-token loop over dequantized keys, its top-k == the
  positions a full sort of that loop's logits puts first;
- the DSA indexer's state, filled chunk by chunk through plan_tokens/update, scores exactly as the
  logits of keys quantized in one go."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import indexers
from vllm_hisparse.ops.dsa_indexer import (indexer_logits, indexer_topk, k_token_bytes,
                                           quantize_k)
from vllm_hisparse.ops.sparse_mla import LATENT_ROW_BYTES, sparse_mla_decode

CASES = [(1, 1, 2), (3, 4, 31), (2, 16, 64), (4, 8, 33)]     # (rows, heads, selected per row)


def test_sizes():
    assert LATENT_ROW_BYTES == 1152 and k_token_bytes(128) == 132


@pytest.mark.parametrize("R,H,K", CASES)
def test_sparse_mla_equals_unabsorbed_attention(R, H, K):
    g = torch.Generator().manual_seed(R * 100 + K)
    N, L, Rd, P, V = 200, 512, 64, 128, 128
    c = torch.randn(N, L, generator=g, dtype=torch.float64) / 8
    kpe = torch.randn(N, Rd, generator=g, dtype=torch.float64)
    w_uk = torch.randn(H, P, L, generator=g, dtype=torch.float64) / 16     # k_nope = W_UK c
    w_uv = torch.randn(H, L, V, generator=g, dtype=torch.float64) / 16     # v = c W_UV
    q_nope = torch.randn(R, H, P, generator=g, dtype=torch.float64)
    q_pe = torch.randn(R, H, Rd, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(R)]).int()
    idx[0, K // 2:] = -1                                 # padding in row 0
    scale = 192 ** -0.5
    # un-absorbed: per head, keys [W_UK c ; k_pe] and values c W_UV of the selected tokens
    want = torch.zeros(R, H, V, dtype=torch.float64)
    for r in range(R):
        j = idx[r][idx[r] >= 0].long()
        for h in range(H):
            k = torch.cat([c[j] @ w_uk[h].T, kpe[j]], 1)
            s = (k @ torch.cat([q_nope[r, h], q_pe[r, h]])) * scale
            want[r, h] = torch.softmax(s, 0) @ (c[j] @ w_uv[h])
    ql = torch.einsum("rhp,hpl->rhl", q_nope, w_uk)      # vLLM's W_UK_T absorption
    kv = torch.cat([c, kpe], 1)
    lat = sparse_mla_decode(ql.float(), q_pe.float(), kv.float(), idx, scale)
    got = torch.einsum("rhl,hlv->rhv", lat.double(), w_uv)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # bf16 rows: within bf16 rounding of the fp64 answer
    lat16 = sparse_mla_decode(ql.bfloat16(), q_pe.bfloat16(), kv.bfloat16(), idx, scale)
    got16 = torch.einsum("rhl,hlv->rhv", lat16.double(), w_uv)
    assert (got16 - want).abs().max() < 0.05 * want.abs().max()


def test_sparse_mla_no_index_is_zero():
    q = torch.randn(2, 2, 512)
    out = sparse_mla_decode(q, torch.randn(2, 2, 64), torch.randn(5, 576),
                            torch.tensor([[-1, -1], [0, -1]], dtype=torch.int32), 0.1)
    assert torch.equal(out[0], torch.zeros(2, 512)) and out[1].abs().sum() > 0
    with pytest.raises(ValueError, match="kv must be"):
        sparse_mla_decode(q, torch.randn(2, 2, 64), torch.randn(5, 512), torch.zeros(2, 1).int(), 1)


@pytest.mark.parametrize("R,N,top_k", [(1, 5, 8), (3, 300, 64), (2, 129, 128)])
def test_indexer_logits_and_topk_equal_a_loop(R, N, top_k):
    g = torch.Generator().manual_seed(N)
    H, D = 4, 128
    q = torch.randn(R, H, D, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(R, H, generator=g)
    k8, ks = quantize_k(torch.randn(N, D, generator=g) * 3)
    seq = torch.randint(1, N + 1, (R,), generator=g)
    seq[0] = N
    logits = indexer_logits(q, w, k8, ks, seq)
    for r in range(R):
        for j in range(N):
            want = (float("-inf") if j >= seq[r] else
                    sum(float(w[r, h]) * max(float(q[r, h].double() @ (k8[j].double())), 0.0)
                        for h in range(H)) * float(ks[j]))
            assert logits[r, j].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    sel = indexer_topk(logits, seq, top_k)
    for r in range(R):
        n = min(top_k, int(seq[r]))
        order = np.argsort(-logits[r, :int(seq[r])].double().numpy(), kind="stable")[:n]
        assert sorted(sel[r, :n].tolist()) == sorted(order.tolist())
        assert (sel[r, n:] == -1).all()


def test_quantize_k_scales_are_powers_of_two_and_bound_the_error():
    k = torch.randn(50, 128) * torch.logspace(-3, 3, 50)[:, None]
    k8, s = quantize_k(k)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert (k8.float().abs().amax(1) <= 448).all()
    assert ((k8.float() * s[:, None] - k).abs() <= k.abs().amax(1, keepdim=True) / 8).all()


def test_dsa_indexer_through_the_interface():
    g = torch.Generator().manual_seed(5)
    cfg = HiSparseConfig(indexer="dsa", top_k=16, device_buffer_size=32, dense_layers=(0,))
    ix = indexers.get("dsa")(cfg, 2, 3, 40, 1, 128, torch.bfloat16, "cpu")
    assert ix.P == 1 and ix.U == 40 and ix.state[0][0] is None and ix.scratch == 3
    assert ix.row_bytes(1, 1, 128, 2, 40, 16) == 40 * 132
    keys = torch.randn(2, 40, 128, generator=g)
    rows = np.array([2, 0])
    for lo, hi in [((0, 0), (17, 9)), ((17, 9), (18, 30)), ((18, 30), (40, 31))]:
        lo, hi = np.array(lo), np.array(hi)
        upd = ix.plan_tokens(lo, hi, rows)
        k = torch.cat([keys[i, lo[i]:hi[i]] for i in range(2)])
        ix.update(1, ix.device_update({n: torch.from_numpy(a) for n, a in upd.items()}), k[:, None])
    q, w = torch.randn(2, 8, 128, generator=g), torch.rand(2, 8, generator=g)
    seq = torch.tensor([40, 31])
    out = torch.empty(2, 40)
    ix.score(1, (q, w), torch.from_numpy(rows), seq, out)
    for i in range(2):
        k8, ks = quantize_k(keys[i])
        assert torch.equal(out[i], indexer_logits(q[i:i + 1], w[i:i + 1], k8, ks, seq[i:i + 1])[0])
    assert ix.decode_unit(2, 40) == 2 * 40 + 39
    with pytest.raises(NotImplementedError, match="indexer='quest'"):
        ix.decode_write_kwargs(1, None)
