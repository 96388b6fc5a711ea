"""fp8 (e4m3) KV moves between tiers as bytes: write-through into the host pool, the paged-cache
write of a prefill, RESOLVE's fetch of missed pages from the host into hot slots, the marked
misses' fetch, the host pool's own write and read, and the dense layers' scratch copy from the
host. Each is checked with torch.equal on the uint8 view, outputs pre-filled with poison bytes and
every row not written checked unchanged. The K/V are random bytes over the whole e4m3 range, NaN
encodings (0x7f / 0xff) included: a copy that converted values instead of moving bytes would
change a NaN's sign or payload. CUDA variants run the extension's ops (write_through, resolve_lru)
on the GPU."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.sparse_layer import gather_pages, write_kv
from vllm_hisparse.ops import kernels, reference
from vllm_hisparse.ops.fp8 import FP8
from vllm_hisparse.ops.write_through import write_through

POISON = 0x5A                          # an fp8 byte (3.25) no random draw is forced to hit
# (pages, P, Hkv, D, T tokens)
CASES = [(9, 4, 2, 16, 7), (5, 16, 1, 32, 33), (3, 1, 4, 8, 1)]


def rand8(*shape, gen) -> torch.Tensor:
    """Random bytes as fp8, every encoding possible (NaNs and -0 included)."""
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(FP8)


def poisoned(*shape) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=torch.uint8).view(FP8)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _dests(pages, P, T, gen):
    """T distinct (page, off) destinations, one padding entry (page -1) when T > 1."""
    flat = torch.randperm(pages * P, generator=gen)[:T]
    page, off = flat // P, flat % P
    if T > 1:
        page[T // 2] = -1
    tok = torch.randperm(T, generator=gen)
    return tok, page, off


def _expected_host(host, k, v, tok, page, off):
    want = u8(host).clone()
    for t, p, o in zip(tok.tolist(), page.tolist(), off.tolist()):
        if p >= 0:
            want[p, 0, o], want[p, 1, o] = u8(k[t]), u8(v[t])
    return want


@pytest.mark.parametrize("case", CASES)
def test_write_through_moves_fp8_bytes(case):
    pages, P, Hkv, D, T = case
    gen = torch.Generator().manual_seed(sum(case))
    host = poisoned(pages, 2, P, Hkv, D)
    k, v = rand8(T, Hkv, D, gen=gen), rand8(T, Hkv, D, gen=gen)
    tok, page, off = _dests(pages, P, T, gen)
    want = _expected_host(host, k, v, tok, page, off)
    write_through(host, k, v, tok, page, off)
    assert torch.equal(u8(host), want)


@pytest.mark.parametrize("case", CASES)
def test_prefill_write_kv_moves_fp8_bytes(case):
    """sparse_layer.write_kv (the paged cache's prefill write): the index_copy path (contiguous
    cache) and the indexed path (a strided view) give the same bytes as the loop."""
    pages, P, Hkv, D, T = case
    gen = torch.Generator().manual_seed(7 + sum(case))
    k, v = rand8(T, Hkv, D, gen=gen), rand8(T, Hkv, D, gen=gen)
    flat = torch.randperm(pages * P, generator=gen)[:T]
    blk, off = flat // P, flat % P
    want = u8(poisoned(pages, 2, P, Hkv, D)).clone()
    for t in range(T):
        want[blk[t], 0, off[t]], want[blk[t], 1, off[t]] = u8(k[t]), u8(v[t])
    kv = poisoned(pages, 2, P, Hkv, D)
    write_kv(kv, blk, off, None, k, v)
    assert torch.equal(u8(kv), want)
    wide = poisoned(pages, 2, P, Hkv, D + 3)
    strided = wide[..., :D]                    # not contiguous: the indexed assignment
    write_kv(strided, blk, off, None, k, v)
    assert torch.equal(u8(strided), want) and (u8(wide[..., D:]) == POISON).all()


def test_host_pool_write_read_and_dense_scratch_move_fp8_bytes():
    gen = torch.Generator().manual_seed(3)
    pool = HostKVPool(2, 6, 4, 2, 8, FP8, pin=False)
    assert pool.data.dtype == FP8
    pool.data.view(torch.uint8).fill_(POISON)
    pool.ensure("r", 13)
    pos = torch.tensor([0, 5, 12, 3])
    k, v = rand8(4, 2, 8, gen=gen), rand8(4, 2, 8, gen=gen)
    pool.write("r", 1, pos, k, v)
    rk, rv = pool.read("r", 1, pos)
    assert torch.equal(u8(rk), u8(k)) and torch.equal(u8(rv), u8(v))
    assert (u8(pool.data[0]) == POISON).all(), "another layer was written"
    # dense layers' scratch: resident pages from the cache, freed ones [1, 3) from the host
    kv = rand8(10, 2, 4, 2, 8, gen=gen)
    host = rand8(7, 2, 4, 2, 8, gen=gen)
    row = torch.tensor([4, 2, 9, 0], dtype=torch.int32)
    hp = torch.tensor([6, 1, 3, 5], dtype=torch.int32)
    pages, table = gather_pages(kv, host, [row], [hp], [15], [(1, 3)])
    assert pages.dtype == FP8
    want = torch.stack([u8(kv[4]), u8(host[1]), u8(host[3]), u8(kv[0])])
    assert torch.equal(u8(pages), want) and table[0].tolist() == [0, 1, 2, 3]


def _resolve_inputs(R, S, U, k, P, Hkv, D, gen, dev="cpu"):
    N = R * S + 2
    buffer = poisoned(N, 2, P, Hkv, D).to(dev)
    host = rand8(R * U + 3, 2, P, Hkv, D, gen=gen)
    host_pt = torch.stack([torch.randperm(R * U + 3, generator=gen)[:U] for _ in range(R)]).int()
    slot_map = torch.randperm(N, generator=gen)[:R * S].view(R, S).int()
    sel = torch.stack([torch.randperm(U, generator=gen)[:k] for _ in range(R)]).int()
    sel[0, k // 2:] = -1
    st = dict(slot_unit=torch.full((R, S), -1, dtype=torch.int32),
              unit_slot=torch.full((R, U), -1, dtype=torch.int32),
              lru=torch.arange(S, dtype=torch.int32).repeat(R, 1))
    return buffer, host, host_pt, slot_map, sel, st


def _check_fetched(buffer, host, host_pt, sel, locs, before):
    got = u8(buffer)
    ok = sel >= 0
    r, j = torch.nonzero(ok, as_tuple=True)
    assert torch.equal(got[locs[r, j].long()], u8(host)[host_pt[r, sel[r, j].long()].long()])
    written = torch.zeros(buffer.shape[0], dtype=torch.bool)
    written[locs[ok].long()] = True
    assert torch.equal(got[~written], u8(before)[~written]), "a slot not selected was written"
    assert (locs[~ok] == -1).all()


@pytest.mark.parametrize("R,S,U,k", [(3, 6, 20, 5), (2, 4, 9, 4)])
def test_resolve_fetches_fp8_pages_as_bytes(R, S, U, k):
    gen = torch.Generator().manual_seed(R * 10 + k)
    buffer, host, host_pt, slot_map, sel, st = _resolve_inputs(R, S, U, k, 4, 2, 8, gen)
    before = buffer.clone()
    locs = torch.full((R, k), -7, dtype=torch.int32)
    reference.resolve_lru(sel, st["slot_unit"], st["unit_slot"], st["lru"], slot_map, buffer,
                          host, host_pt, locs)
    _check_fetched(buffer, host, host_pt, sel, locs, before)


def test_fetch_marked_moves_fp8_bytes():
    gen = torch.Generator().manual_seed(9)
    kv = poisoned(12, 2, 4, 2, 8)
    host = rand8(10, 2, 4, 2, 8, gen=gen)
    host_pt = torch.randperm(10, generator=gen)[:8].view(2, 4).int()
    units = torch.tensor([[0, 3, 1], [2, 1, 3]], dtype=torch.int32)
    locs = torch.tensor([[-2 - 5, 7, -2 - 1], [-2 - 9, -1, 4]], dtype=torch.int32)
    seq = torch.tensor([9, 9])
    rows = torch.tensor([1, 0])
    before = kv.clone()
    out = reference.fetch_marked(kv, locs, units, seq, rows, host_pt, host)
    assert out.tolist() == [[5, 7, 1], [9, -1, 4]]
    for b, (r, j) in {5: (0, 0), 1: (0, 2), 9: (1, 0)}.items():
        assert torch.equal(u8(kv[b]), u8(host[host_pt[rows[r], units[r, j]]]))
    rest = [b for b in range(12) if b not in (5, 1, 9)]
    assert torch.equal(u8(kv[rest]), u8(before[rest]))


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_gpu_write_through_moves_fp8_bytes(case):
    pages, P, Hkv, D, T = case
    gen = torch.Generator().manual_seed(sum(case))
    host = poisoned(pages, 2, P, Hkv, D).pin_memory()
    k, v = rand8(T, Hkv, D, gen=gen), rand8(T, Hkv, D, gen=gen)
    tok, page, off = _dests(pages, P, T, gen)
    want = _expected_host(host, k, v, tok, page, off)
    write_through(host, k.cuda(), v.cuda(), tok.cuda(), page.cuda(), off.cuda())
    torch.cuda.synchronize()
    assert torch.equal(u8(host), want)


@pytest.mark.cuda
def test_gpu_resolve_fetches_fp8_pages_as_bytes():
    if not kernels.available():
        pytest.skip(f"extension not built: {kernels.import_error()}")
    R, S, U, k = 3, 6, 20, 5
    gen = torch.Generator().manual_seed(1)
    buffer, host, host_pt, slot_map, sel, st = _resolve_inputs(R, S, U, k, 4, 2, 8, gen, "cuda")
    before = buffer.cpu()
    locs = torch.full((R, k), -7, dtype=torch.int32, device="cuda")
    kernels.resolve_lru(sel.cuda(), st["slot_unit"].cuda(), st["unit_slot"].cuda(),
                        st["lru"].cuda(), slot_map.cuda(), buffer, host.pin_memory(),
                        host_pt.cuda(), locs)
    _check_fetched(buffer.cpu(), host, host_pt, sel, locs.cpu(), before)
