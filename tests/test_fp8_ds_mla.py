"""fp8_ds_mla rows (ops/fp8_ds_mla.py): the layout byte by byte (512 fp8 nope | 4 fp32 scales |
64 bf16 rope), the scale rule (amax / 448 per 128-value tile, FLT_MIN for an all-zero tile), the
round trip within e4m3's error, refusals in one line; on the GPU, vLLM's own packing kernel
(``concat_and_cache_mla`` with kv_cache_dtype fp8_ds_mla, what the served path uses) writes the
reference packer's bytes on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.ops import fp8_ds_mla as F
from vllm_hisparse.ops.fp8 import FP8


def rows(T: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    kv_c = (torch.randn(T, 512, generator=g) * torch.rand(T, 1, generator=g) * 8).bfloat16()
    k_pe = torch.randn(T, 64, generator=g).bfloat16()
    return kv_c.to(device), k_pe.to(device)


HALF_STEP = 16 * (1 + 1e-5)   # half an e4m3 step at 448 (in units of the tile's scale), and float32's
# rounding of v / scale and q x scale: a value at a tie sits at 16 x scale up to that rounding


@pytest.mark.parametrize("T,seed", [(9, 0), (97, 0), (97, 1)])
def test_layout_scale_rule_and_round_trip(T, seed):
    kv_c, k_pe = rows(T, seed)
    kv_c[4, 128:256] = 0                               # an all-zero tile
    out = F.pack(kv_c, k_pe)
    assert out.shape == (T, F.ROW_BYTES) == (T, 656) and out.dtype == torch.uint8
    assert F.row_bytes() == 656 and F.row_bytes(256, 32) == 256 + 8 + 64
    scale = out[:, 512:528].contiguous().view(torch.float32)
    want = kv_c.float().view(T, 4, 128).abs().amax(-1) / 448.0
    assert torch.equal(scale[4, 1], torch.tensor(torch.finfo(torch.float32).tiny))
    want[4, 1] = torch.finfo(torch.float32).tiny
    assert torch.equal(scale, want)
    assert torch.equal(out[:, 528:].contiguous().view(torch.bfloat16), k_pe)     # rope as it came
    nope = out[:, :512].contiguous().view(FP8).float().view(T, 4, 128)
    assert nope.abs().amax(-1)[want > 1e-30].eq(448.0).all()      # each tile's max at e4m3's max
    back = F.unpack(out)
    assert torch.equal(back[:, 512:], k_pe.float())
    err = (back[:, :512] - kv_c.float()).abs().view(T, 4, 128)
    assert (err <= want[..., None] * HALF_STEP + 1e-30).all()
    assert back[4, 128:256].eq(0).all()


def test_refusals_name_the_shapes():
    kv_c, k_pe = rows(2, 1)
    with pytest.raises(ValueError, match=r"kv_c \(T, 512\) and k_pe \(T, 64\)"):
        F.pack(kv_c[:, :256], k_pe)
    with pytest.raises(ValueError, match="rope part in bf16"):
        F.pack(kv_c, k_pe.half())
    with pytest.raises(ValueError, match=r"\(M, 656\) uint8"):
        F.unpack(torch.zeros(2, 576, dtype=torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_vllm_packing_kernel_is_read_by_the_reference(seed):
    """vLLM's ``concat_and_cache_mla`` (fp8_ds_mla: what the served path packs with, stock's
    bytes) writes the reference packer's bytes (H100, 2026-12-07, ninth box: none differ in 97
    rows, seeds 0 and 1; an all-zero tile included), and ``unpack`` reads them within half an e4m3
    step; the message counts differing bytes by segment."""
    from vllm import _custom_ops as ops

    kv_c, k_pe = rows(97, seed, "cuda")
    kv_c[3, :128] = 0
    cache = torch.full((4, 64, F.ROW_BYTES), 0xEE, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(4 * 64, device="cuda")[:97]
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla",
                             torch.ones((), dtype=torch.float32, device="cuda"))
    got = cache.view(-1, F.ROW_BYTES)[slots].cpu()
    want = F.pack(kv_c.cpu(), k_pe.cpu())
    seg = {name: int((got[:, a:b] != want[:, a:b]).sum()) for name, a, b in
           (("nope", 0, F.SCALE_AT), ("scales", F.SCALE_AT, F.ROPE_AT), ("rope", F.ROPE_AT, None))}
    assert seg == {"nope": 0, "scales": 0, "rope": 0}, \
        f"bytes differing from the reference packer by segment: {seg}"
    scale = got[:, F.SCALE_AT:F.ROPE_AT].contiguous().view(torch.float32)
    err = (F.unpack(got)[:, :512] - kv_c.cpu().float()).abs().view(97, 4, 128)
    assert (err <= scale[..., None] * HALF_STEP + 1e-30).all()
