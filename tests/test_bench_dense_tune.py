"""The dense decode tuning bench (bench/dense_tune.py) on the CPU: its sweep in Triton's interpreter
on tiny shapes reports correct configs ok and broken ones (an output perturbed, rows left
unwritten, the last keys dropped, a launch that raises) not ok and untimed, and puts the module's
constants back; its invariance check tells a batch-invariant attention from one that is not; the
command runs end to end (a stand-in for FlashAttention: vLLM's needs a GPU); and every curated
config compiles for the H200 (sm_90) within its shared memory (compiled on the CPU by Triton's
NVIDIA backend, not run)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from triton_interpreter import run_cases
from triton_sm90 import compile_only, ptxas_available

from vllm_hisparse.bench import dense_tune as dt
from vllm_hisparse.bench.dense_tune_harness import TOL, rel_err
from vllm_hisparse.ops import triton_dense_decode as td

SHAPE = dict(hq=4, hkv=2, d=64, page=16)
CASES = [(2, 100)]
GOOD = dt.Cfg(8, 32, 32, 4, 1)
OTHER = dt.Cfg(4, 64, 64, 4, 2)
SMEM_SM90 = 232448                    # bytes of shared memory one CTA may use on an H100 / H200


def _sweep(bench, cfg, default):
    rows = []
    dt.run_config(bench, cfg, default, 1, None, rows.append)
    return rows


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.bench import dense_tune_invariance as inv
    from vllm_hisparse.bench.dense_tune_harness import Bench, Shape

    default = dt.current()
    b = Bench(Shape(**SHAPE), CASES, torch.device("cpu"), torch.float16, 2)
    dt.set_base(b, GOOD)            # the yardstick: few splits (the interpreter runs each program)
    for cfg in (GOOD, OTHER):
        for r in _sweep(b, cfg, GOOD):
            assert r["ok"] and r["us"] > 0 and float(r["err_vs_ref"]) < TOL, r
    assert dt.current() == default, "constants not restored"

    real = td.dense_decode_attention

    def perturbed(q, k, v, bt, seq, scale, out, **kw):
        real(q, k, v, bt, seq, scale, out, **kw)
        out[0, 0, 0] += 0.5 * out.float().abs().max().item()

    def unwritten(q, k, v, bt, seq, scale, out, **kw):
        real(q[1:], k, v, bt[1:], seq[1:], scale, out[1:], **kw)   # row 0 left as it was

    def short(q, k, v, bt, seq, scale, out, **kw):
        real(q, k, v, bt, seq - 32, scale, out, **kw)               # the last 32 keys dropped

    def raises(*a, **kw):
        raise RuntimeError("out of resources: shared memory")

    for broken in (perturbed, unwritten, short, raises):
        td.dense_decode_attention = broken
        try:
            rows = _sweep(b, OTHER, GOOD)
        finally:
            td.dense_decode_attention = real
        for r in rows:
            assert not r["ok"] and r.get("us") is None, (broken.__name__, r)
        assert dt.current() == default, f"{broken.__name__}: constants not restored"
    assert "shared memory" in rows[0]["error"]

    q, bt, seq = inv.inputs(b, 5, 20, 100)
    fair = inv.triton_attn(b)

    def batch_dependent(q, bt, seq):           # as a split count chosen from the batch would be
        return fair(q, bt, seq) + 1e-3 * (q.shape[0] > 1)

    with dt.use(GOOD):                         # 8 splits: a quarter of the default's programs
        res = inv.check(fair, q, bt, seq, chunk=2)
        assert res["invariant"] and res["alone_equal"] == 5, res
        res = inv.check(batch_dependent, q, bt, seq, chunk=2)
    assert not res["invariant"] and res["alone_equal"] == 0 and res["repeat_equal"] == 5, res
    _main_with_fake_fa()
    print("interpreter ok")


def _main_with_fake_fa():
    """The command end to end (two configs, tiny shapes) with the plain-torch reference standing in
    for vLLM's FlashAttention (it checks what it is given): both CSVs, every row ok."""
    import tempfile

    from vllm_hisparse.bench import dense_tune_invariance as inv
    from vllm_hisparse.ops import reference

    def fake_fa(q, k, v, bt, seq, cu, max_k, scale, out, num_splits):
        assert cu.tolist() == list(range(q.shape[0] + 1)) and max_k >= int(seq.max())
        assert num_splits in inv.FA_SPLITS and bt.dtype == torch.int32
        return reference.dense_decode_attention(q, k, v, bt, seq, scale, out)

    inv.load_fa = lambda: fake_fa
    with tempfile.TemporaryDirectory() as out:
        assert dt.main(["--device", "cpu", "--configs", "8:32:32:4:1", "--contexts", "128",
                        "--rows", "2", "--shape", "4,2,64", "--inv-rows", "3",
                        "--inv-min-len", "20", "--out", out]) == 0
        tune = open(os.path.join(out, "dense_tune.csv")).read().splitlines()
        invariance = open(os.path.join(out, "fa_invariance.csv")).read().splitlines()
    n_fa = len(inv.FA_SPLITS)
    assert len(tune) == 1 + 2 + n_fa, tune
    assert all(",True," in line for line in tune[1:]), tune
    assert sum(",fa," in line for line in tune) == n_fa, tune
    assert len(invariance) == 2 + n_fa, invariance
    assert all(line.split(",")[3:8] == ["3", "3", "3", "3", "0"] for line in invariance[1:]), \
        invariance


def test_sweep_flags_broken_configs_in_interpreter():
    run_cases("test_bench_dense_tune")


def test_cpu_without_interpreter_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.bench.dense_tune", "--device", "cpu",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr


def test_rel_err_flags_perturbation_and_nan():
    want = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    assert rel_err(want.clone(), want) == 0.0
    bumped = want.clone()
    bumped[1, 2, 3] += 0.05 * want.abs().max()
    assert rel_err(bumped, want) > TOL
    poisoned = want.clone()
    poisoned[2] = float("nan")
    assert rel_err(poisoned, want) == float("inf")


def test_configs_default_first_no_repeats_and_use_restores():
    default = dt.current()
    cfgs = dt.configs_for(default, False, None)
    assert cfgs[0] == default and len(set(cfgs)) == len(cfgs) and 25 <= len(cfgs) <= 35
    assert len(dt.configs_for(default, True, None)) == 1 + dt.QUICK
    assert dt.configs_for(default, False, "16:256:64:4:3") == [default, dt.Cfg(16, 256, 64, 4, 3)]
    with pytest.raises(ValueError, match="multiple of block_n"):
        dt.Cfg(32, 64, 128, 4, 2)
    with pytest.raises(KeyError):
        with dt.use(GOOD):
            assert (td.SPLITS, td.MIN_SPLIT, td.BLOCK_N, td.WARPS, td.STAGES) == \
                dataclasses.astuple(GOOD)
            raise KeyError("boom")
    assert dt.current() == default


@pytest.mark.skipif(not ptxas_available(), reason="Triton's ptxas is not installed")
def test_curated_configs_compile_for_sm90(tmp_path, monkeypatch):
    """Every curated config, Llama-3-8B's shape in bf16: a cubin within the CTA's shared memory."""
    from triton.runtime import jit

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bf = torch.bfloat16
    R, W = 2, 256
    k = torch.zeros(R * W, 16, 8, 128, dtype=bf)
    q = torch.zeros(R, 32, 128, dtype=bf)
    bt = torch.zeros(R, W, dtype=torch.int32)
    seq = torch.full((R,), 4096, dtype=torch.int32)
    smem = {}
    run = jit.JITFunction.run

    def record(self, *a, **kw):
        kernel = run(self, *a, **kw)
        smem[self.__name__] = kernel.metadata.shared
        return kernel

    monkeypatch.setattr(jit.JITFunction, "run", record)
    with compile_only():
        for cfg in dt.configs_for(dt.current(), False, None):
            with dt.use(cfg):
                work = tuple(torch.empty(n) for n in td.partials_numel(R, 32, 128))
                td.dense_decode_attention(q, k, k, bt, seq, 0.1, torch.empty_like(q), work=work)
            assert 0 < smem["_dense_split_kernel"] <= SMEM_SM90, (cfg, smem)
