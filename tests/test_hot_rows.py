"""The gathers/scatters around RESOLVE: resolve_hot_into / resolve_hot (core/sparse_layer.py) leave
exactly what the torch code before them left (kept below as old_*): device slots, hot-slot state,
hot buffer, hit/miss counts, over multi-step episodes with hits, misses, evictions, padding and
the hot rows given as all rows, indices (the eager runtime) or a bool mask (the decode graph). The
Triton take/put kernels (ops/triton_hot_rows.py) equal the references on CPU through Triton's
interpreter; the whole path is checked on the GPU with the extension."""

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.ops import kernels, reference

# (runtime rows N, decode rows Rd, k, S, U, hot rows as "all" / "index" / "mask")
EPISODES = [(6, 4, 3, 5, 12, "index"), (3, 3, 4, 4, 9, "all"), (8, 5, 1, 1, 4, "index"),
            (5, 2, 6, 10, 40, "index"), (6, 4, 3, 5, 12, "mask"), (7, 5, 2, 3, 8, "mask")]
UNIT = (2, 2, 1, 4)                                       # (2, P, Hkv, D) of one page


def old_resolve_hot(sel, state, rows, slot_map, kv, host, host_pt):
    su, us, lru = state.slot_unit[rows], state.unit_slot[rows], state.lru[rows]
    valid = sel >= 0
    was = torch.gather(us, 1, sel.long().clamp(min=0)) >= 0
    counts = torch.stack([(valid & was).sum(), (valid & ~was).sum()])
    locs = torch.empty_like(sel)
    kernels.resolve_lru(sel, su, us, lru, slot_map.to(torch.int32), kv, host, host_pt, locs)
    state.slot_unit[rows], state.unit_slot[rows], state.lru[rows] = su, us, lru
    return locs, counts


class Episode:
    def __init__(self, N, Rd, k, S, U, mode, dev, seed):
        g = torch.Generator().manual_seed(seed)
        self.g, self.k, self.U, self.dev = g, k, U, dev
        self.rows = torch.randperm(N, generator=g)[:Rd].to(dev)
        sub = torch.randperm(Rd, generator=g)[:max(1, Rd - 2)].sort().values
        self.hot = {"all": None, "index": sub.to(dev),
                    "mask": torch.zeros(Rd, dtype=torch.bool).index_fill_(0, sub, True).to(dev)}[mode]
        Rh = len(sub) if mode == "index" else Rd
        self.state = sl.HotSlots(N, S, U, dev)
        self.kv = torch.full((Rh * S + 3, *UNIT), float("nan"), device=dev)
        self.host = torch.randn(Rh * U, *UNIT, generator=g).to(dev)
        self.host_pt = torch.randperm(Rh * U, generator=g).view(Rh, U).int().to(dev)
        self.slot_map = torch.randperm(Rh * S + 3, generator=g)[:Rh * S].view(Rh, S).int().to(dev)
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)

    def clone(self):
        c = Episode.__new__(Episode)
        c.__dict__.update(self.__dict__)
        c.state = sl.HotSlots.__new__(sl.HotSlots)
        c.state.slot_unit, c.state.unit_slot, c.state.lru = (
            t.clone() for t in (self.state.slot_unit, self.state.unit_slot, self.state.lru))
        c.kv, c.counts = self.kv.clone(), self.counts.clone()
        return c

    def selection(self):
        """(Rd, k) int32 distinct units from a small window (so some repeat: hits), -1 padding."""
        Rd, k = len(self.rows), self.k
        sel = torch.stack([torch.randperm(min(self.U, 2 * k + 1), generator=self.g)[:k]
                           for _ in range(Rd)]).int()
        sel[torch.rand(Rd, k, generator=self.g) < 0.2] = -1
        sel[0] = -1 if Rd > 2 else sel[0]                  # an all-padding row
        return sel.to(self.dev)

    def same(self, other):
        for name in ("slot_unit", "unit_slot", "lru"):
            assert torch.equal(getattr(self.state, name), getattr(other.state, name)), name
        assert torch.equal(self.counts, other.counts)
        assert torch.equal(self.kv.isnan(), other.kv.isnan())
        assert torch.equal(self.kv.nan_to_num(7.0), other.kv.nan_to_num(7.0))


def run_episode(case, dev, steps=6, seed=0):
    new = Episode(*case, dev, seed)
    old = new.clone()
    for _ in range(steps):
        sel = new.selection()
        locs_new = torch.full(sel.shape, 99, dtype=torch.int32, device=dev)
        locs_old = locs_new.clone()
        sl.resolve_hot_into(locs_new, sel, new.hot, new.rows, new.state, new.slot_map, new.kv, new.host,
                            new.host_pt, new.counts)
        if old.hot is not None and old.hot.dtype == torch.bool:     # the decode graph's code
            hot = old.hot[:, None]
            hot_locs, c = old_resolve_hot(torch.where(hot, sel, -1), old.state, old.rows, old.slot_map,
                                          old.kv, old.host, old.host_pt)
            locs_old = torch.where(hot, hot_locs, locs_old)
        else:                                                       # the eager runtime's code
            hot = torch.arange(len(sel), device=dev) if old.hot is None else old.hot
            hot_locs, c = old_resolve_hot(sel[hot], old.state, old.rows[hot], old.slot_map, old.kv,
                                          old.host, old.host_pt)
            locs_old[hot] = hot_locs
        old.counts += c
        assert torch.equal(locs_new, locs_old)
        new.same(old)
    assert int(new.counts[0]) > 0 and int(new.counts[1]) > 0, new.counts    # hits and misses seen
    # the old signature still works: fresh counts, same slots
    sel = new.selection()
    rows = new.rows if new.hot is None or new.hot.dtype == torch.bool else new.rows[new.hot]
    sel_h = sel if new.hot is None or new.hot.dtype == torch.bool else sel[new.hot]
    a, ca = sl.resolve_hot(sel_h, new.state, rows, new.slot_map, new.kv, new.host, new.host_pt)
    b, cb = old_resolve_hot(sel_h, old.state, rows, old.slot_map, old.kv, old.host, old.host_pt)
    assert torch.equal(a, b) and torch.equal(ca, cb)
    old.counts.zero_()
    new.counts.zero_()
    new.same(old)


@pytest.mark.parametrize("case", EPISODES)
def test_cpu_equals_old_code(case):
    run_episode(case, "cpu", seed=sum(case[:5]))


# ---- the Triton kernels on CPU through Triton's interpreter --------------------------------------
def check_take_put(take, put, dev="cpu"):
    """take/put vs reference.take_hot_rows/put_hot_rows on random state; column counts across the
    1024-column program blocks (U 2500, S 1100, k 1030)."""
    for i, (N, Rd, k, S, U, mode) in enumerate([(7, 4, 5, 6, 20, "index"), (5, 5, 1030, 1100, 2500, "all"),
                                                (4, 3, 3, 3, 3, "index"), (6, 4, 1030, 1100, 1500, "mask"),
                                                (5, 3, 4, 5, 9, "mask")]):
        g = torch.Generator().manual_seed(60 + i)
        st = [torch.randint(-1, 50, (N, w), generator=g, dtype=torch.int32).to(dev) for w in (S, U, S)]
        rows = torch.randperm(N, generator=g)[:Rd].to(dev)
        hot = {"all": None, "index": torch.randperm(Rd, generator=g)[:Rd - 1].to(dev),
               "mask": (torch.rand(Rd, generator=g) < 0.6).to(dev)}[mode]
        sel = torch.stack([torch.randperm(U, generator=g)[:k] for _ in range(Rd)]).int()
        sel[torch.rand(Rd, k, generator=g) < 0.3] = -1
        sel = sel.to(dev)
        c_ref = torch.tensor([3, 4], device=dev)
        c = c_ref.clone()
        want = reference.take_hot_rows(sel, hot, rows, *st, c_ref)
        got = take(sel, hot, rows, *st, c)
        assert torch.equal(c, c_ref) and all(torch.equal(a, b) for a, b in zip(got, want))
        Rh = got[0].shape[0]
        new = [torch.randint(-1, 50, t.shape, generator=g, dtype=torch.int32).to(dev)
               for t in (got[0], got[1], got[2], got[3])]
        locs = torch.full((Rd, k), 99, dtype=torch.int32, device=dev)
        st2, locs2 = [t.clone() for t in st], locs.clone()
        reference.put_hot_rows(locs2, hot, rows, *new, *st2)
        put(locs, hot, rows, *new, *st)
        assert Rh and torch.equal(locs, locs2) and all(torch.equal(a, b) for a, b in zip(st, st2))


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_hot_rows
    check_take_put(triton_hot_rows.take_hot_rows, triton_hot_rows.put_hot_rows)
    print("interpreter ok")


def test_triton_kernels_in_interpreter():
    run_cases("test_hot_rows")


# ---- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.cuda
def test_gpu_take_put_equal_reference():
    from vllm_hisparse.ops import hot_rows
    check_take_put(hot_rows.take_hot_rows, hot_rows.put_hot_rows, "cuda")


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("case", EPISODES)
def test_gpu_equals_old_code(case):
    run_episode(case, "cuda", seed=sum(case[:5]))
