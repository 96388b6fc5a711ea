"""WRITE-BEHIND (core/write_behind.py): the prefill's host write-through on a side stream, read from
the paged cache and joined before anything reads the host pool.

On the CPU a deferred twin stands in for the side stream: its writes run only at ``join``, reading
the cache then (as the stream would, later). The test driver poisons the blocks the scheduler frees
only after the next step's plan, where vLLM's next forward would first overwrite them. Every
layer's output of every step must equal resident mode's bit for bit. Negative controls: the same
twin with the freed blocks poisoned right after the step (a write that reads the cache too late),
and a twin whose join does nothing (readers before the writes): both must differ.
"""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.core import sparse_runtime
from vllm_hisparse.core import write_behind as wb
from vllm_hisparse.ops import reference
from test_sparse_runtime_exact import SPILLS, Driver, freed_pages, run, shared_run


class Deferred(wb.WriteBehind):
    """The side stream's twin on the CPU: writes queued, run at join (``joins=False``: never)."""
    joins_run = True

    def __init__(self, device, on=None):
        super().__init__(device, on=False)
        self.stream = "deferred"            # a stand-in, so plans name the cache rows (host_src)
        self.queue: list = []

    def _issue(self, host, k_rows, v_rows, src, page, off):
        self.queue.append((host, k_rows, v_rows, src, page, off))

    def join(self):
        if self.joins_run:
            for args in self.queue:
                reference.write_through(*args)
            self.queue.clear()
            self.pending = False


class NeverJoins(Deferred):
    joins_run = False


class LateFree(Driver):
    """Freed blocks poisoned after the next plan (where its forward would overwrite them)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.late: list[torch.Tensor] = []
        for name in ("plan", "plan_full"):
            setattr(self.rt, name, self._then_poison(getattr(self.rt, name)))

    def _then_poison(self, f):
        def planned(*a, **kw):
            out = f(*a, **kw)
            for blocks in self.late:
                for kv in self.kv:
                    kv[blocks] = float("nan")
            self.late.clear()
            return out
        return planned

    def free(self, ids):
        for rid in ids:
            keep = self.keep.get(rid) if self.cfg.resident_first else 0
            lo, hi = freed_pages(self.cfg, self.lens[rid], self.prompt[rid], keep)
            self.late.append(self.blocks[rid][lo:hi].long())


class EarlyFree(Driver):
    """Freed blocks poisoned right after the step, before the write-behind is joined."""

    def free(self, ids):
        pending = self.rt.write_behind.join
        self.rt.write_behind.join = lambda: None
        try:
            super().free(ids)
        finally:
            self.rt.write_behind.join = pending


def _differs(outs, ref) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(outs, ref, strict=True))


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("resident_first,spills", [(False, None), (True, SPILLS)])
def test_deferred_writes_equal_resident(monkeypatch, full, resident_first, spills):
    monkeypatch.setattr(sparse_runtime, "WriteBehind", Deferred)
    outs, stats = run(True, full=full, resident_first=resident_first, spills=spills,
                      driver=LateFree)
    res, _ = shared_run(False, full=full)
    for i, (a, b) in enumerate(zip(outs, res, strict=True)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN (a write read a freed block)"
        assert torch.equal(a, b), f"step/layer {i} differs"
    assert stats["write_behind_writes"] > 0 and stats["misses"] > 0


def test_control_write_reading_freed_blocks_differs(monkeypatch):
    """The deferred writes with the blocks poisoned right after the step: the host copy takes NaN."""
    monkeypatch.setattr(sparse_runtime, "WriteBehind", Deferred)
    outs, _ = run(True, driver=EarlyFree)
    res, _ = shared_run(False)
    assert _differs(outs, res) and any(torch.isnan(a).any() for a in outs)


def test_control_join_that_waits_for_nothing_differs(monkeypatch):
    """Writes that never land before the pool is read: misses fetch what the pool held before."""
    monkeypatch.setattr(sparse_runtime, "WriteBehind", NeverJoins)
    outs, stats = run(True, driver=LateFree)
    res, _ = shared_run(False)
    assert stats["misses"] > 0 and _differs(outs, res)


def test_synchronous_write_is_the_same_run(monkeypatch):
    """HISPARSE_WRITE_BEHIND=0 (and any CPU run): no side stream, nothing deferred, the outputs
    of the write-behind run's twin."""
    monkeypatch.setenv(wb.ENV, "0")
    outs, stats = run(True, driver=LateFree)
    res, _ = shared_run(False)
    assert not _differs(outs, res) and stats["write_behind_writes"] == 0


def test_knob_refuses_other_values(monkeypatch):
    monkeypatch.setenv(wb.ENV, "yes")
    with pytest.raises(ValueError, match=r"HISPARSE_WRITE_BEHIND='yes': use 1 .* or 0"):
        wb.WriteBehind("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 37, 5000])
def test_cuda_side_stream_bytes_equal_reference(n):
    """The side stream's write from the cache rows equals the reference's from k / v, bytes exact,
    after join; the compute stream's later work waits for it."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    N, P, Hkv, D, pages = 64, 16, 8, 128, 512
    kv = torch.randn(N, 2, P, Hkv, D, generator=g).to(torch.bfloat16).cuda()
    slot = torch.randperm(N * P, generator=g)[:n]              # the tokens' cache slots
    k, v = kv[slot // P, 0, slot % P], kv[slot // P, 1, slot % P]
    dst = torch.randperm(pages * P, generator=g)[:n]
    page, off = dst // P, dst % P
    ref = torch.full((pages, 2, P, Hkv, D), 7, dtype=torch.bfloat16)
    reference.write_through(ref, k.cpu(), v.cpu(), torch.arange(n), page, off)
    host = torch.full_like(ref, 7).pin_memory()
    w = wb.WriteBehind("cuda", on=True)
    src = (slot + slot // P * P).cuda()
    w.write(host, kv, src, k, v, torch.arange(n, device="cuda"), page.cuda(), off.cuda())
    assert w.pending and w.writes == 1
    w.join()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host.view(torch.int16), ref.view(torch.int16))
