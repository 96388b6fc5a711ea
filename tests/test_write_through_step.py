"""HISPARSE_WRITE_THROUGH=step: the decode rows' new tokens of every sparse layer copied from the
layers' caches into the host pool in one launch at the last sparse layer (core/step_write.py).
The reference against an explicit per-token loop; the Triton kernel in the interpreter against the
reference (bytes, caches in separate allocations, host layers out of order, padding rows and rows
without a host page untouched); its sm_90 compile; the runtime with it against the per-layer
write-through: the same outputs (resident mode's), the same host pool bytes, with misses, spills
and FULL-graph steps."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.ops import reference
from vllm_hisparse.ops import write_through as wt

import test_sparse_runtime_exact as ex
from triton_interpreter import run_cases

SENTINEL = -7.0


def case(gen, N=6, L=3, P=8, Hkv=2, D=8, blocks=20, pages=12, dt=torch.float32):
    """Separate caches of random bytes, a sentinel-filled host pool of L + 1 layers, the rows'
    newest blocks, seqs (one padding row) and host pages (one row without)."""
    kvs = [torch.randn(blocks, 2, P, Hkv, D, generator=gen).to(dt) for _ in range(L)]
    host = torch.full((L + 1, pages, 2, P, Hkv, D), SENTINEL, dtype=dt)
    hidx = torch.randperm(L + 1, generator=gen)[:L]
    newest = torch.randperm(blocks, generator=gen)[:N].to(torch.int32)
    seq = torch.randint(1, 200, (N,), generator=gen)
    seq[1] = 0                                       # vLLM's padding row
    host_page = torch.randperm(pages, generator=gen)[:N]
    host_page[3] = -1                                # a row with no host page (a dense row)
    return host, kvs, hidx, newest, seq, host_page


def loop_reference(host, kvs, hidx, newest, seq, host_page):
    """Token by token, the other way round from reference.write_through_step."""
    out = host.clone()
    P = host.shape[3]
    for r in range(seq.shape[0]):
        if seq[r] <= 0 or host_page[r] < 0:
            continue
        off = int(seq[r] - 1) % P
        for kv, i in zip(kvs, hidx.tolist()):
            for c in range(2):
                out[i, int(host_page[r]), c, off] = kv[int(newest[r]), c, off]
    return out


def test_reference_equals_loop():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    host, kvs, hidx, newest, seq, host_page = case(gen)
    want = loop_reference(host, kvs, hidx, newest, seq, host_page)
    reference.write_through_step(host, kvs, hidx.tolist(), newest, seq, host_page)
    assert torch.equal(host, want)
    assert (host == SENTINEL).sum() == want.eq(SENTINEL).sum() > 0     # the rest untouched


def run_interpreter_cases():
    """TRITON_INTERPRET=1 (tests/triton_interpreter.py): the kernel against the reference."""
    from vllm_hisparse.ops import triton_write_through_step as tk
    for seed, dt in ((1, torch.float32), (2, torch.bfloat16), (3, torch.float16)):
        gen = torch.Generator().manual_seed(seed)
        host, kvs, hidx, newest, seq, host_page = case(gen, Hkv=3, D=5, dt=dt)  # masked lanes
        want = host.clone()
        reference.write_through_step(want, kvs, hidx.tolist(), newest, seq, host_page)
        ptrs = torch.tensor([c.data_ptr() for c in kvs], dtype=torch.int64)
        tk.write_through_step(host, kvs[0], ptrs, hidx, newest, seq, host_page)
        assert torch.equal(host.view(torch.uint8), want.view(torch.uint8)), (seed, dt)
    print("interpreter ok")


def test_kernel_in_interpreter():
    run_cases("test_write_through_step")


def test_kernel_compiles_for_sm90():
    from triton_sm90 import compile_only, ptxas_available
    if not ptxas_available():
        pytest.skip("Triton's ptxas is not installed")
    from vllm_hisparse.ops import triton_write_through_step as tk
    host, kvs, hidx, newest, seq, host_page = case(torch.Generator().manual_seed(4), P=16, Hkv=8,
                                                    D=128, dt=torch.bfloat16)
    ptrs = torch.tensor([c.data_ptr() for c in kvs], dtype=torch.int64)
    with compile_only() as seen:
        tk.write_through_step(host, kvs[0], ptrs, hidx, newest, seq, host_page)
    assert seen == {"_write_through_step_kernel"}


def drive(d, prompts: dict, chunks: list, steps: int, spills: dict | None = None):
    """Driver d (test_sparse_runtime_exact's) through its prompts (chunks: the prefill steps),
    then `steps` decode steps of every request (spills: {decode step: what the scheduler spills
    before it}); the outputs of every layer and step, the stats and the host pool's bytes."""
    d.rt.pool.data.fill_(SENTINEL)                   # (allocated uninitialised)
    for rid, n in prompts.items():
        d.add(rid, n)
    for c in chunks:
        d.step(c)
    for i in range(steps):
        for rid in (spills or {}).get(i, ()):
            d.spill(*((rid,) if isinstance(rid, str) else rid))
        d.step({rid: 1 for rid in prompts})
    if d.dev.type == "cuda":
        torch.cuda.synchronize()
    return d.outs, d.rt.stats_dict(), d.rt.pool.data.clone()


def drive_cpu(full: bool, spills: dict):
    """test_sparse_runtime_exact's scenario, shortened: 24 decode steps."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=ex.P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01, resident_first=bool(spills))
    return drive(ex.Driver(cfg, rows=4, full=full), {"a": 150, "b": 93, "c": 61},
                 [{"a": 64, "b": 93}, {"a": 86, "b": 1, "c": 61}], 24, spills)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("spills", [{}, {2: [("a", 3)], 9: ["b", "a"]}])
def test_runtime_step_equals_layer_write_through(full, spills, monkeypatch):
    monkeypatch.setattr(wt, "STEP", False)
    outs, stats, pool = drive_cpu(full, spills)
    monkeypatch.setattr(wt, "STEP", True)
    s_outs, s_stats, s_pool = drive_cpu(full, spills)
    assert stats["misses"] > 0 and s_stats["misses"] == stats["misses"]
    for i, (a, b) in enumerate(zip(outs, s_outs, strict=True)):
        assert not torch.isnan(a).any() and torch.equal(a, b), f"step/layer {i} differs"
    assert torch.equal(pool.view(torch.uint8), s_pool.view(torch.uint8))


def test_runtime_without_bound_caches_names_the_fix(monkeypatch):
    monkeypatch.setattr(wt, "STEP", True)
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=ex.P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01)
    d = ex.Driver(cfg, rows=2)
    d.rt.bind_kv_caches([None] * ex.L)
    d.add("a", 93)
    d.step({"a": 93})
    with pytest.raises(RuntimeError, match="bind_kv_caches"):
        d.step({"a": 1})


def test_unknown_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("HISPARSE_WRITE_THROUGH", "later")
    with pytest.raises(ValueError, match="HISPARSE_WRITE_THROUGH='later'"):
        wt._mode()


@pytest.mark.cuda
@pytest.mark.ext
def test_kernel_on_gpu_into_pinned_host_equals_reference():
    """The op on the GPU: caches on the device, the pool pinned (read through its UVA alias)."""
    from vllm_hisparse.core.pinned import pinned_empty
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    host, kvs, hidx, newest, seq, host_page = case(gen, N=40, P=16, Hkv=8, D=128, blocks=64,
                                                    pages=48, dt=torch.bfloat16)
    want = host.clone()
    reference.write_through_step(want, kvs, hidx.tolist(), newest, seq, host_page)
    pinned, unpin = pinned_empty(tuple(host.shape), host.dtype)
    try:
        pinned.copy_(host)
        g = [c.cuda() for c in kvs]
        ptrs = torch.tensor([c.data_ptr() for c in g], dtype=torch.int64, device="cuda")
        wt.write_through_step(pinned, g, ptrs, hidx.cuda(), newest.cuda(), seq.cuda(),
                              host_page.cuda())
        torch.cuda.synchronize()
        assert torch.equal(pinned.view(torch.uint8), want.view(torch.uint8))
    finally:
        unpin()


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_runtime_step_equals_layer_write_through(graphs, monkeypatch):
    """The decode body on the GPU, eager and replayed in FULL-style graphs: the step's launch
    gives the per-layer write-through's outputs and host pool bytes."""
    from test_decode_body_gpu import GraphDriver

    def go(step):
        monkeypatch.setattr(wt, "STEP", step)
        cfg = HiSparseConfig(top_k=48, device_buffer_size=64, page_size=16, dense_layers=(0,),
                             min_context=160, host_pool_gib=0.05, resident_first=False)
        cls = GraphDriver if graphs else (lambda *a, **k: ex.Driver(*a, full=True, **k))
        d = cls(cfg, rows=4, device="cuda", dtype=torch.bfloat16, dims=(8, 2, 64),
                shape=(16, 3, 40))
        return drive(d, {"a": 500, "b": 330, "c": 210},
                     [{"a": 256, "b": 330}, {"a": 244, "b": 1, "c": 210}], 30)

    outs, stats, pool = go(False)
    s_outs, s_stats, s_pool = go(True)
    assert stats["misses"] > 0 and stats["full_steps"] >= 30
    for i, (a, b) in enumerate(zip(outs, s_outs, strict=True)):
        assert not torch.isnan(a).any() and torch.equal(a, b), f"step/layer {i} differs"
    assert torch.equal(pool.view(torch.uint8), s_pool.view(torch.uint8))


def test_bind_checks_layouts_only_with_the_knob(monkeypatch):
    """The layer default keeps no table and checks nothing (a cache of another layout must not
    stop startup); with step, one of another layout or dtype is refused, naming the fix."""
    from vllm_hisparse.core.step_write import StepWrite
    sw = StepWrite([0, 1], {0: 0, 1: 1}, torch.device("cpu"), torch.float32)
    odd = [torch.zeros(4, 2, 8, 2, 8), torch.zeros(4, 2, 8, 2, 16)[..., :8]]
    monkeypatch.setattr(wt, "STEP", False)
    sw.bind(odd)
    assert sw.kvs is None
    monkeypatch.setattr(wt, "STEP", True)
    with pytest.raises(ValueError, match="HISPARSE_WRITE_THROUGH=layer"):
        sw.bind(odd)
    with pytest.raises(ValueError, match="float32"):
        sw.bind([torch.zeros(4, 2, 8, 2, 8, dtype=torch.float16)] * 2)
    same = [torch.zeros(4, 2, 8, 2, 8) for _ in range(2)]
    sw.bind(same)
    table = sw.ptrs
    sw.bind(same[::-1])                              # a second bind rewrites the same table
    assert sw.ptrs is table and sw.ptrs.tolist() == [c.data_ptr() for c in same[::-1]]
