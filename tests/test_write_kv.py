"""core.sparse_layer.write_kv stores each token's K and V at (block, offset) of the paged cache, and
nothing else: compared byte for byte with plain advanced-index assignment on a poisoned cache, for
contiguous caches (the index_copy_ path) and strided views (the fallback), with and without a token
subset."""
import pytest
import torch

from vllm_hisparse.core.sparse_layer import write_kv

# (blocks, page, Hkv, D, tokens written)
CASES = [(5, 4, 2, 8, 7), (1, 16, 1, 4, 16), (9, 8, 4, 16, 1), (3, 2, 2, 8, 0)]


def check(dev, dtype):
    for case in CASES:
        N, P, Hkv, D, n = case
        g = torch.Generator().manual_seed(sum(case))
        T = n + 3
        k = torch.randn(T, Hkv, D, generator=g).to(dev, dtype)
        v = torch.randn(T, Hkv, D, generator=g).to(dev, dtype)
        slots = torch.randperm(N * P, generator=g)[:n].to(dev)
        blk, off = slots // P, slots % P
        tok = torch.randperm(T, generator=g)[:n].to(dev)
        for use_tok in (True, False):
            if use_tok:                      # tokens tok of all T
                blk_, off_, t, kk, vv = blk, off, tok, k, v
            else:                            # all n tokens in order
                blk_, off_, t, kk, vv = blk, off, None, k[:n], v[:n]
            for strided in (False, True):
                base = torch.full((N, 2, P, Hkv, D + 2 * strided), float("nan"), dtype=dtype,
                                  device=dev)
                kv = base[..., :D] if strided else base
                want = base.clone()
                wv = want[..., :D] if strided else want
                src_k, src_v = (kk[t], vv[t]) if t is not None else (kk, vv)
                wv[blk_, 0, off_] = src_k
                wv[blk_, 1, off_] = src_v
                assert kv.is_contiguous() != strided
                write_kv(kv, blk_, off_, t, kk, vv)
                assert torch.equal(base.isnan(), want.isnan()), case   # nothing else touched
                assert torch.equal(base.nan_to_num(7.0), want.nan_to_num(7.0)), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cpu(dtype):
    check("cpu", dtype)


@pytest.mark.cuda
def test_write_kv_gpu():
    check("cuda", torch.bfloat16)
