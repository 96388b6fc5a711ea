"""HostKVPool: paged accounting (never a page twice, never a leak) and byte-exact rows."""
import random

import pytest
import torch

from vllm_hisparse.core.host_pool import HostKVPool, HostPoolFull


def make_pool(pages=64, page=4, layers=2, heads=2, dim=8, dtype=torch.float32):
    return HostKVPool(layers, pages, page, heads, dim, dtype=dtype, pin=False)


def test_random_alloc_free_never_double_never_leak():
    pool = make_pool(pages=50)
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    live = {}
    for step in range(2000):
        if live and rng.random() < 0.35:
            key = rng.choice(list(live))
            assert pool.free(key) == len(live.pop(key))
        else:
            key = rng.randrange(30)
            tokens = rng.randrange(1, 40)
            try:
                pages = pool.ensure(key, tokens)
                live[key] = list(pages)
            except HostPoolFull:
                assert not pool.can_hold(key, tokens)
        owned = [p for ps in live.values() for p in ps]
        assert len(owned) == len(set(owned)), "a page handed out twice"
        assert pool.used_pages == len(owned) and pool.free_pages + pool.used_pages == 50
    for key in list(live):
        pool.free(key)
    assert pool.used_pages == 0 and pool.free_pages == 50 and pool.owners() == []


def test_ensure_hands_out_the_pages_one_pop_at_a_time_would():
    """ensure takes the free list's tail in one slice: the pages and their order are what
    popping them one at a time gives (runs that compare engines rely on the same page ids)."""
    pool = make_pool(pages=60)
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    free = list(pool._free)
    for key in range(12):
        tokens = rng.randrange(1, 20)
        want = [free.pop() for _ in range(pool.pages_for(tokens))]
        assert pool.ensure(key, tokens) == want and pool._free == free
        if rng.random() < 0.4:
            free.extend(reversed(pool._owned[key]))
            pool.free(key)


def test_assigned_pages_counted_once_however_many_hold_them():
    """Scheduler-assigned lists (pages shared between keys, lists replaced): used_pages == the
    distinct pages the live keys hold (a plain set here), kept as lists come and go."""
    pool = make_pool(pages=50)
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    live = {}
    for step in range(1500):
        if live and rng.random() < 0.3:
            key = rng.choice(list(live))
            assert pool.free(key) == len(live.pop(key))
        else:
            key = rng.randrange(20)
            pages = rng.sample(range(50), rng.randrange(0, 12))
            pool.assign(key, pages)
            live[key] = pages
        assert pool.used_pages == len({p for ps in live.values() for p in ps})
    for key in list(live):
        pool.free(key)
    assert pool.used_pages == 0 and pool.owners() == []


def test_ensure_is_all_or_nothing_and_message():
    pool = make_pool(pages=3, page=4)
    pool.ensure("a", 8)
    with pytest.raises(HostPoolFull, match="needs 2 more pages of 4 tokens, 1 free of 3"):
        pool.ensure("b", 8)
    assert pool.page_table("b") == [] and pool.free_pages == 1
    pool.ensure("a", 12)
    assert len(pool.page_table("a")) == 3 and pool.free_pages == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_read_bytes_exact(dtype):
    pool = make_pool(pages=20, page=4, dtype=dtype)
    pool.ensure("r", 37)
    pos = torch.randperm(37)
    k = torch.randn(37, 2, 8).to(dtype)
    v = torch.randn(37, 2, 8).to(dtype)
    pool.write("r", 1, pos, k, v)
    k2, v2 = pool.read("r", 1, pos)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # a page is contiguous K block then V block: position p lives at data[l, pt[p//4], :, p%4]
    pt = pool.page_table("r")
    p = int(pos[0])
    assert torch.equal(pool.data[1, pt[p // 4], 0, p % 4], k[0])
    with pytest.raises(IndexError, match="beyond the 10 pages"):
        pool.read("r", 0, torch.tensor([40]))


def test_page_table_tensor_padding():
    pool = make_pool(pages=8, page=4)
    pool.ensure("a", 9)
    t = pool.page_table_tensor(["a", None, "zzz"], width=4)
    assert t.dtype == torch.int32 and t.shape == (3, 4)
    assert t[0, :3].tolist() == pool.page_table("a") and t[0, 3] == -1
    assert (t[1:] == -1).all()
