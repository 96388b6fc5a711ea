"""CUDA RESOLVE vs the plain-torch reference: multi-step episodes, every output compared exactly
after every step (hot-buffer bytes, page table, slot owners, LRU order, device_locs), fresh random
inputs each run, outputs poisoned first; boundary sizes; CUDA-graph capture + replay."""
import pytest
import torch

from vllm_hisparse.ops import kernels, reference

pytestmark = [pytest.mark.cuda, pytest.mark.ext]

POISON = 0x7F7F7F7F
# (rows, k, S): k and S at 1, 31, 32, 33, warp/block multiples, S == k, S > k.
SIZES = [(1, 1, 1), (3, 1, 4), (2, 31, 31), (3, 32, 33), (2, 33, 64), (4, 32, 32), (2, 64, 100),
         (5, 1023, 1024), (2, 1024, 1025), (2, 1025, 4096), (3, 2048, 4096), (1, 4096, 4096), (2, 4096, 8192)]
# unit shapes of the byte rows: MLA-like 1152 B, GQA page (2, unit, Hkv, D), odd sizes (narrow vectors)
ROWS = [((576,), torch.bfloat16), ((2, 4, 2, 64), torch.bfloat16), ((3,), torch.int16),
        ((5,), torch.uint8), ((16,), torch.float32), ((2, 1, 8, 128), torch.float16)]
IO_CHUNKS = [16, 64, 256]


class Episode:
    """Kernel state and reference state side by side, same initial contents."""

    def __init__(self, R, k, S, U, shape, dtype, extra_phys=7):
        dev = "cuda"
        self.R, self.k, self.S, self.U = R, k, S, U
        N = R * S + extra_phys
        P = max(4, U // 2)
        self.su = torch.full((R, S), -1, dtype=torch.int32, device=dev)
        self.us = torch.full((R, U), -1, dtype=torch.int32, device=dev)
        self.lo = torch.arange(S, dtype=torch.int32, device=dev).repeat(R, 1)
        self.sm = torch.randperm(N, device=dev)[: R * S].view(R, S).int()
        self.buf = _rand((N, *shape), dtype, dev)           # random "stale" contents = poison
        self.host = _rand((P, *shape), dtype, "cpu").pin_memory()
        self.hpt = torch.randint(0, P, (R, U), dtype=torch.int32, device=dev)
        self.ref = {n: getattr(self, n).clone() for n in ("su", "us", "lo", "buf")}
        self.hpt_cpu = self.hpt.cpu()

    def step(self, sel, io_chunk_bytes=64):
        dl = torch.full((self.R, self.k), POISON, dtype=torch.int32, device="cuda")
        before = {n: getattr(self, n).clone() for n in ("su", "us", "lo")}
        kernels.resolve_lru(sel, self.su, self.us, self.lo, self.sm, self.buf, self.host, self.hpt, dl,
                            io_chunk_bytes)
        rdl = torch.full_like(dl, POISON)
        f = self.ref
        reference.resolve_lru(sel, f["su"], f["us"], f["lo"], self.sm, f["buf"], self.host, self.hpt_cpu, rdl)
        torch.cuda.synchronize()
        assert torch.equal(dl, rdl), _diff(dl, rdl)
        assert torch.equal(self.su, f["su"]), _diff(self.su, f["su"])
        assert torch.equal(self.us, f["us"]), _diff(self.us, f["us"])
        assert torch.equal(self.lo, f["lo"]), _diff(self.lo, f["lo"])
        assert torch.equal(self.buf.view(torch.uint8), f["buf"].view(torch.uint8)), "buffer bytes differ"
        pad = (sel < 0).all(1)
        for n, t in before.items():                          # padding rows untouched
            assert torch.equal(getattr(self, n)[pad], t[pad]), f"padding row changed {n}"
        assert (dl[pad] == -1).all()
        return dl

    def selection(self, gen, p_pad=0.1, pad_rows=()):
        return _selection(gen, self.R, self.k, self.U, p_pad, pad_rows)


def _rand(shape, dtype, dev):
    if dtype.is_floating_point:
        return torch.randn(shape, device=dev).to(dtype)
    return torch.randint(-100, 100, shape, device=dev).to(dtype)


def _selection(gen, R, k, U, p_pad, pad_rows=()):
    """(R, k) int32 unique units per row, -1 sprinkled anywhere, rows in pad_rows all -1."""
    sel = torch.stack([torch.randperm(U, generator=gen)[:k] for _ in range(R)]).int()
    sel[torch.rand(R, k, generator=gen) < p_pad] = -1
    for r in pad_rows:
        sel[r] = -1
    return sel.cuda()


def _diff(a, b):
    idx = (a != b).nonzero()
    return f"{len(idx)} mismatches, first at {idx[:5].tolist()}: {a[tuple(idx[0])].item()} vs {b[tuple(idx[0])].item()}"


def _gen():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print("seed", seed)
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("R,k,S", SIZES)
def test_resolve_episode_sizes(R, k, S):
    gen = _gen()
    U = max(2 * S, k + 1)
    ep = Episode(R, k, S, U, (24,), torch.bfloat16)
    for step in range(6):
        pad_rows = (R - 1,) if (R > 1 and step % 2) else ()
        ep.step(ep.selection(gen, p_pad=0.15 if step % 3 else 0.0, pad_rows=pad_rows))


@pytest.mark.parametrize("shape,dtype", ROWS)
@pytest.mark.parametrize("io_chunk_bytes", IO_CHUNKS)
def test_resolve_row_shapes(shape, dtype, io_chunk_bytes):
    gen = _gen()
    ep = Episode(3, 97, 160, 400, shape, dtype)
    for step in range(5):
        ep.step(ep.selection(gen, p_pad=0.1), io_chunk_bytes)


def test_resolve_all_hits_then_all_misses():
    gen = _gen()
    ep = Episode(2, 64, 128, 1000, (32,), torch.float32)
    sel = _selection(gen, 2, 64, 500, 0.0)
    ep.step(sel)
    ep.step(sel.flip(1).contiguous())                         # all hits, reversed order
    ep.step((sel + 500).contiguous())                         # all misses: evicts everything
    ep.step(torch.full_like(sel, -1))                         # whole batch is padding


def test_resolve_max_sizes():
    """B = 32768 slots, k = 8192 once."""
    gen = _gen()
    ep = Episode(2, 8192, 32768, 65536, (16,), torch.uint8)
    for step in range(3):
        ep.step(ep.selection(gen, p_pad=0.05))


def test_resolve_attention_cuda_graph():
    """resolve + attention captured once, replayed with new selections == eager reference, and
    bit-identical to the same attention over the fully resident cache."""
    gen = _gen()
    R, k, S, U, unit, Hkv, Hq, D = 4, 48, 96, 300, 4, 2, 8, 64
    dt = torch.bfloat16
    full_host = torch.randn(R * U, 2, unit, Hkv, D).to(dt).pin_memory()   # authoritative pool
    full_dev = full_host.cuda()                                             # resident mode cache
    ep = Episode(R, k, S, U, (2, unit, Hkv, D), dt)
    ep.host = full_host
    ep.hpt = (torch.arange(R, device="cuda")[:, None] * U + torch.arange(U, device="cuda")).int()
    ep.hpt_cpu = ep.hpt.cpu()
    q = torch.randn(R, Hq, D, device="cuda").to(dt)
    seq = torch.full((R,), U * unit - 3, dtype=torch.int32, device="cuda")
    extra = torch.randn(R, 3, 2, Hkv, D, device="cuda").to(dt)
    elen = torch.tensor([0, 1, 3, 2], dtype=torch.int32, device="cuda")
    sel_static = torch.full((R, k), -1, dtype=torch.int32, device="cuda")
    dl = torch.full((R, k), POISON, dtype=torch.int32, device="cuda")
    out = torch.empty(R, Hq, D, dtype=dt, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                                 # warm-up (Triton compile) off-graph
        kernels.resolve_lru(sel_static, ep.su, ep.us, ep.lo, ep.sm, ep.buf, ep.host, ep.hpt, dl)
        kernels.sparse_decode_attention(q, ep.buf, dl, sel_static, seq, 0.125, extra, elen, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernels.resolve_lru(sel_static, ep.su, ep.us, ep.lo, ep.sm, ep.buf, ep.host, ep.hpt, dl)
        kernels.sparse_decode_attention(q, ep.buf, dl, sel_static, seq, 0.125, extra, elen, out)
    for step in range(6):
        sel = ep.selection(gen, p_pad=0.1, pad_rows=(R - 1,) if step % 2 else ())
        sel_static.copy_(sel)
        dl.fill_(POISON)
        out.fill_(float("nan"))
        before = {n: getattr(ep, n).clone() for n in ("su", "us", "lo")}
        g.replay()
        rdl = torch.full_like(dl, POISON)
        f = ep.ref
        reference.resolve_lru(sel, f["su"], f["us"], f["lo"], ep.sm, f["buf"], ep.host, ep.hpt_cpu, rdl)
        torch.cuda.synchronize()
        assert torch.equal(dl, rdl), _diff(dl, rdl)
        for n in ("su", "us", "lo"):
            assert torch.equal(getattr(ep, n), f[n]), n
        assert torch.equal(ep.buf.view(torch.uint8), f["buf"].view(torch.uint8))
        pad = (sel < 0).all(1)
        for n, t in before.items():
            assert torch.equal(getattr(ep, n)[pad], t[pad])
        resident_locs = torch.where(sel >= 0, torch.arange(R, device="cuda")[:, None] * U + sel, -1).int()
        res = kernels.sparse_decode_attention(q, full_dev, resident_locs, sel, seq, 0.125, extra, elen)
        assert not out.isnan().any()
        assert torch.equal(out, res), "HiSparse (graph) vs resident attention not bit-identical"
        want = reference.sparse_decode_attention(q, full_dev, resident_locs, sel, seq, 0.125, extra, elen)
        assert (out.float() - want.float()).abs().max() < 0.05
