"""WRITE-BEHIND (core/write_behind.py): the prefill's host write-through on a side stream, read from
the paged cache and joined before anything reads the host pool.

On the CPU a deferred twin stands in for the side stream: its writes run only at ``join``, reading
the cache then (as the stream would, later). The test driver ends each step as the adapter does
(``end_step``: vLLM's wait_for_save) and poisons the blocks the scheduler frees after the next
step's plan. Every layer's output of every step must equal resident mode's bit for bit. Negative
controls: the same twin with the step's end joining nothing and the freed blocks poisoned right
after it (a write that reads the cache too late), and a twin whose join does nothing (readers
before the writes): both must differ. On the GPU: the side stream's bytes against the reference,
with the cache produced late on the compute stream and the index tensors' memory reused at once.
"""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.core import sparse_runtime
from vllm_hisparse.core import write_behind as wb
from vllm_hisparse.ops import reference
from test_sparse_runtime_exact import SPILLS, Driver, run, shared_run


class Deferred(wb.WriteBehind):
    """The side stream's twin on the CPU: writes queued, run at join (never: ``joins_run`` off)."""
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
        self.late += self.freed_blocks(ids)


class EarlyFree(Driver):
    """Freed blocks poisoned right after the step, the step's end joining nothing."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rt.end_step = lambda: None


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
    """The deferred writes with the blocks poisoned right after the step: the host copy gets
    NaN."""
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


def test_knob_turns_it_off(monkeypatch):
    """HISPARSE_WRITE_BEHIND=0: no side stream anywhere (the CPU has none either way)."""
    monkeypatch.setenv(wb.ENV, "0")
    assert not wb.enabled() and wb.WriteBehind("cpu").stream is None
    monkeypatch.delenv(wb.ENV)
    assert wb.enabled()


def test_knob_refuses_other_values(monkeypatch):
    monkeypatch.setenv(wb.ENV, "yes")
    with pytest.raises(ValueError, match=r"HISPARSE_WRITE_BEHIND='yes': use 1 .* or 0"):
        wb.WriteBehind("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 37, 5000])
def test_cuda_side_stream_bytes_equal_reference(n):
    """The side stream's write from the cache rows equals the reference's from k / v, bytes exact,
    after join. The cache is filled late on the compute stream (behind a ~20 ms spin), so a side
    stream that did not wait for it would copy zeros; the index tensors are dropped and their
    memory filled with junk right after the write, so one the allocator handed back too early
    would send rows elsewhere."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    N, P, Hkv, D, pages = 64, 16, 8, 128, 512
    data = torch.randn(N, 2, P, Hkv, D, generator=g).to(torch.bfloat16)
    slot = torch.randperm(N * P, generator=g)[:n]              # the tokens' cache slots
    k, v = data[slot // P, 0, slot % P], data[slot // P, 1, slot % P]
    dst = torch.randperm(pages * P, generator=g)[:n]
    page, off = dst // P, dst % P
    ref = torch.full((pages, 2, P, Hkv, D), 7, dtype=torch.bfloat16)
    reference.write_through(ref, k, v, torch.arange(n), page, off)
    host = torch.full_like(ref, 7).pin_memory()
    kv = torch.zeros(N, 2, P, Hkv, D, dtype=torch.bfloat16, device="cuda")
    staged = data.cuda()
    idx = [(slot + slot // P * P).cuda(), page.cuda(), off.cuda()]
    torch.cuda.synchronize()
    w = wb.WriteBehind("cuda", on=True)
    torch.cuda._sleep(40_000_000)                      # the compute stream busy for a while
    kv.copy_(staged)
    w.write(host, kv, idx[0], None, None, None, idx[1], idx[2])
    assert w.pending and w.writes == 1
    del idx
    junk = [torch.full((n,), 3, dtype=torch.int64, device="cuda") for _ in range(3)]
    w.join()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host.view(torch.int16), ref.view(torch.int16))
    assert all(int(j[0]) == 3 for j in junk)


def test_connector_wait_for_save_ends_the_step():
    """vLLM calls the KV connector's wait_for_save as each step's forward context exits: that is
    where the GQA worker joins the write-behind (SparseRuntime.end_step)."""
    from types import SimpleNamespace

    from vllm_hisparse.vllm.connector_worker import ConnectorWorker
    ended = []
    cw = ConnectorWorker.__new__(ConnectorWorker)
    rt = SimpleNamespace(end_step=lambda: ended.append(1))
    cw.worker = SimpleNamespace(get_runtime=lambda: rt)
    cw.wait_for_save()
    assert ended == [1]
