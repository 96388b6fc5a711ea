"""Tuning probe for the batch-invariant dense decode kernel (ops/triton_dense_decode.py) beside
vLLM's FlashAttention decode; Llama-3-8B's attention shape by default (32 query / 8 KV heads, D=128,
bf16, pages of 16).

    python -m vllm_hisparse.bench.dense_tune --out DIR [--contexts 4096,32768] [--rows 1,8,32,64]
                                             [--no-fa] [--quick]

1. Which launch constants make the kernel fastest per (context, rows): the module constants SPLITS,
   MIN_SPLIT, BLOCK_N, WARPS, STAGES are set to each config in turn (the module's current values
   first, then CURATED: moves of one constant around the defaults, then combinations aimed at few
   rows (more, shorter splits) and at many rows (fewer, longer splits, deeper pipelines)) and
   restored afterwards. FlashAttention is timed beside it as stock vLLM calls it (num_splits=0: its
   own heuristic) and with fixed num_splits. Every output is checked against the plain-torch
   reference (ops/reference.py) and against the default config's output: a config off by more
   than harness.TOL is reported not ok and is not timed.
2. Is FlashAttention batch-invariant with a fixed num_splits (bench/dense_tune_invariance.py).

The cases, the check and the timer: bench/dense_tune_harness.py.

Cases: --contexts x --rows, keeping those of at most --max-tokens keys per call (by default 4K x
1/8/32/64 and 32K x 1/8). Timing on CUDA: N_CALLS calls recorded into one CUDA graph, each through
its own random block table over one shared random cache (pages scattered; the calls together read
far more than the L2 holds, as a step's layers do), the graph replayed --reps times, CUDA events,
median per call. On CPU (--device cpu under TRITON_INTERPRET=1, tiny shapes: the CPU test) the wall
time of one pass. DIR/dense_tune.csv and DIR/fa_invariance.csv are written row by row; configs stop
starting after --budget-s seconds (the rest are listed as skipped).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import time

import torch

from vllm_hisparse.bench import dense_tune_invariance as inv
from vllm_hisparse.bench.dense_tune_harness import (N_CALLS, Bench, Case, CsvOut, Shape,
                                                    copy_ceiling_gbps, measure)
from vllm_hisparse.ops import triton_dense_decode as td

FIELDS = ("SPLITS", "MIN_SPLIT", "BLOCK_N", "WARPS", "STAGES")

# (SPLITS, MIN_SPLIT, BLOCK_N, WARPS, STAGES), most promising first (a budget cut drops the tail).
# split_len rounds seq / SPLITS up to a multiple of MIN_SPLIT: a 4K row with SPLITS=32 gets 32
# splits of 128 keys with MIN_SPLIT 64 or 128 alike, so MIN_SPLIT moves only where it exceeds
# seq / SPLITS. Every config compiles for sm_90 within a CTA's shared memory (at most ~74 KB,
# BLOCK_N 128; tests/test_bench_dense_tune.py compiles them all on the CPU).
CURATED = [
    # one constant moved around the defaults (32, 128, 64, 4, 2)
    (32, 128, 64, 4, 3), (32, 128, 64, 4, 1), (32, 128, 64, 4, 4), (32, 128, 64, 8, 2),
    (32, 128, 32, 4, 2), (32, 128, 128, 4, 2), (32, 128, 128, 8, 2), (16, 128, 64, 4, 2),
    (64, 128, 64, 4, 2), (32, 256, 64, 4, 2), (32, 512, 64, 4, 2),
    # few rows: more programs (4K: 64 splits of 64 keys; 32K: 128 splits of 256)
    (64, 64, 64, 4, 2), (64, 64, 32, 4, 2), (64, 64, 32, 4, 3), (128, 64, 64, 4, 2),
    (128, 128, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 128, 8, 2), (128, 64, 64, 8, 2),
    # many rows: fewer, longer splits, deeper pipelines
    (16, 256, 64, 4, 3), (16, 256, 128, 8, 3), (16, 256, 128, 4, 3), (8, 512, 64, 4, 3),
    (8, 512, 128, 8, 3), (16, 512, 64, 4, 4), (32, 256, 128, 8, 2), (32, 256, 64, 4, 3),
    (16, 128, 64, 4, 3), (32, 128, 32, 4, 3), (32, 128, 32, 4, 4), (32, 128, 128, 8, 3),
]
QUICK = 2                             # --quick: the default and the first QUICK of CURATED

CSV_FIELDS = ["context", "rows", "impl", "config", "is_default", "splits", "min_split", "block_n",
              "warps", "stages", "fa_num_splits", "us", "gbps", "pct_ceiling", "ok",
              "err_vs_default", "err_vs_ref", "error"]


@dataclasses.dataclass(frozen=True)
class Cfg:
    splits: int
    min_split: int
    block_n: int
    warps: int
    stages: int

    def __post_init__(self):
        if self.min_split % self.block_n:
            raise ValueError(f"config {self}: min_split={self.min_split} must be a multiple of "
                             f"block_n={self.block_n}")

    def __str__(self):
        return (f"S{self.splits}/M{self.min_split}/B{self.block_n}/w{self.warps}"
                f"/s{self.stages}")


def current() -> Cfg:
    """The module's constants now (its defaults unless a config is in use)."""
    return Cfg(*(getattr(td, f) for f in FIELDS))


@contextlib.contextmanager
def use(cfg: Cfg):
    """Set triton_dense_decode's constants to cfg; put the previous ones back, whatever happens."""
    saved = dataclasses.astuple(current())
    try:
        for f, v in zip(FIELDS, dataclasses.astuple(cfg)):
            setattr(td, f, v)
        yield
    finally:
        for f, v in zip(FIELDS, saved):
            setattr(td, f, v)


def parse_configs(text: str) -> list[Cfg]:
    """'32:128:64:4:2,64:64:64:4:3' -> configs (SPLITS:MIN_SPLIT:BLOCK_N:WARPS:STAGES)."""
    return [Cfg(*map(int, c.split(":"))) for c in text.split(",") if c]


def configs_for(default: Cfg, quick: bool, given: str | None) -> list[Cfg]:
    """The default first, then the given configs or CURATED (the first QUICK with quick), no
    repeats."""
    rest = parse_configs(given) if given else [Cfg(*c) for c in CURATED]
    out = [default]
    for c in rest[:QUICK] if quick else rest:
        if c not in out:
            out.append(c)
    return out


def triton_call(b: Bench, case: Case, work, t: int, out: torch.Tensor) -> None:
    # looked up at call time: the CPU test swaps the module's function for a broken one
    td.dense_decode_attention(case.q, b.k, b.v, case.tables[t], case.seq, b.scale, out,
                              work=work)


def fa_call(b: Bench, case: Case, fa, ns: int, t: int, out: torch.Tensor) -> None:
    fa(case.q, b.k, b.v, case.tables[t], case.seq, case.cu, case.ctx, b.scale, out, ns)


def _row(case: Case, impl: str, **kw) -> dict:
    return {"context": case.ctx, "rows": case.rows, "impl": impl, **kw}


def _cfg_fields(cfg: Cfg, default: Cfg) -> dict:
    return {"config": str(cfg), "is_default": cfg == default, "splits": cfg.splits,
            "min_split": cfg.min_split, "block_n": cfg.block_n, "warps": cfg.warps,
            "stages": cfg.stages}


def run_config(b: Bench, cfg: Cfg, default: Cfg, reps: int, ceiling, emit) -> None:
    """Every case under cfg; emit(row) each. A raise (compile, shared memory) is a not-ok row."""
    with use(cfg):
        try:
            work = b.work()
        except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
            work, err = None, f"{type(e).__name__}: {e}"
        for case in b.cases:
            row = _row(case, "triton", **_cfg_fields(cfg, default))
            try:
                if work is None:
                    raise RuntimeError(err)
                row.update(measure(b, case, functools.partial(triton_call, b, case, work), reps,
                                   ceiling))
            except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            emit(row)


def set_base(b: Bench, default: Cfg) -> None:
    """The default config's outputs (table 0), the other configs' yardstick; none where it
    raises (then only the reference judges)."""
    with use(default):
        for case in b.cases:
            try:
                out = torch.full_like(case.out, float("nan"))
                triton_call(b, case, b.work(), 0, out)
                case.base = out
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                print(f"default config {default} raised at {case.ctx} x {case.rows}: {e}")


def run_fa(b: Bench, fa, reps: int, ceiling, emit) -> None:
    for case in b.cases:
        for ns in inv.FA_SPLITS:
            row = _row(case, "fa", fa_num_splits=ns)
            try:
                row.update(measure(b, case, functools.partial(fa_call, b, case, fa, ns), reps,
                                   ceiling))
            except Exception as e:  # noqa: BLE001 - reported in the row
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            emit(row)


def summary(b: Bench, rows: list[dict], inv_rows: list[dict], skipped: list[Cfg]) -> str:
    """Per case: the default, the best ok config, FlashAttention's heuristic and best fixed split
    count; the configs not ok; the invariance verdicts."""
    def us(r):
        return f"{r['us']:.1f}" if r and r.get("us") is not None else "-"

    def ratio(r, base):
        return f"{r['us'] / base['us']:.2f}" if r and base else "-"

    lines = [f"{'context':>7} {'rows':>4} | {'default us':>10} | {'best us':>7} {'best config':<22}"
             f" | {'FA ns=0':>7} | {'FA fixed best':>16} | default/FA0 | best/FA0"]
    for case in b.cases:
        here = [r for r in rows if (r["context"], r["rows"]) == (case.ctx, case.rows)
                and r.get("us") is not None]
        tri = [r for r in here if r["impl"] == "triton"]
        dflt = next((r for r in tri if r["is_default"]), None)
        best = min(tri, key=lambda r: r["us"], default=None)
        fa0 = next((r for r in here if r["impl"] == "fa" and r["fa_num_splits"] == 0), None)
        fab = min((r for r in here if r["impl"] == "fa" and r["fa_num_splits"]),
                  key=lambda r: r["us"], default=None)
        fixed = f"{us(fab)} (ns={fab['fa_num_splits']})" if fab else "-"
        lines.append(f"{case.ctx:>7} {case.rows:>4} | {us(dflt):>10} | {us(best):>7} "
                     f"{best['config'] if best else '-':<22} | {us(fa0):>7} | {fixed:>16} | "
                     f"{ratio(dflt, fa0):>11} | {ratio(best, fa0)}")
    bad = [r for r in rows if not r["ok"]]
    lines.append(f"not ok: {len(bad)}" + "".join(
        f"\n  {r['impl']} {r.get('config') or 'ns=' + str(r.get('fa_num_splits'))} at "
        f"{r['context']} x {r['rows']}: err_vs_ref={r.get('err_vs_ref')} "
        f"err_vs_default={r.get('err_vs_default')} {r.get('error') or ''}" for r in bad))
    if skipped:
        lines.append(f"skipped (budget): {', '.join(map(str, skipped))}")
    lines.append(inv.table(inv_rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/dense_tune")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--max-tokens", type=int, default=64 * 4096,
                    help="keep the (context, rows) cases of at most this many keys per call")
    ap.add_argument("--no-fa", action="store_true", help="no vLLM FlashAttention")
    ap.add_argument("--quick", action="store_true", help=f"the default + {QUICK} configs")
    ap.add_argument("--configs", default=None,
                    help="SPLITS:MIN_SPLIT:BLOCK_N:WARPS:STAGES,... instead of the curated list")
    ap.add_argument("--reps", type=int, default=7, help="graph replays (median)")
    ap.add_argument("--budget-s", type=float, default=75.0,
                    help="start no new config after this many seconds")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1")
    ap.add_argument("--shape", default="32,8,128", help="HQ,HKV,D")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--inv-rows", type=int, default=inv.ROWS)
    ap.add_argument("--inv-min-len", type=int, default=1000)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    dev = torch.device(args.device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the kernels in Triton's interpreter: start Python "
                         "with TRITON_INTERPRET=1")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: --device cpu (with TRITON_INTERPRET=1) for a smoke "
                         "run")
    # Triton 3.6's interpreter gave garbage in bf16 when tried on the CPU: fp16 there
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    shape = Shape(*map(int, args.shape.split(",")), page=args.page)
    contexts = [int(x) for x in args.contexts.split(",")]
    cases = [(R, ctx) for ctx in contexts for R in map(int, args.rows.split(","))
             if R * ctx <= args.max_tokens]
    if not cases:
        raise SystemExit(f"no case of at most --max-tokens={args.max_tokens} keys: raise it")
    default = current()
    configs = configs_for(default, args.quick, args.configs)
    fa = None if args.no_fa else inv.load_fa()
    os.makedirs(args.out, exist_ok=True)
    n_tables = N_CALLS if dev.type == "cuda" else 2
    b = Bench(shape, cases, dev, dtype, n_tables)
    ceiling = copy_ceiling_gbps(dev)
    print(f"{len(cases)} cases, {len(configs)} configs, default {default}, FlashAttention "
          f"{'off' if fa is None else 'on'}, copy ceiling {ceiling and round(ceiling)} GB/s, "
          f"setup {time.monotonic() - t0:.1f} s", flush=True)
    tune = CsvOut(os.path.join(args.out, "dense_tune.csv"), CSV_FIELDS,
                  hide=("is_default", "splits", "min_split", "block_n", "warps", "stages"))
    invariance = CsvOut(os.path.join(args.out, "fa_invariance.csv"), inv.CSV_FIELDS)
    skipped = []
    try:
        set_base(b, default)
        run_config(b, default, default, args.reps, ceiling, tune)
        if fa is not None:
            run_fa(b, fa, args.reps, ceiling, tune)
        inv.run_all(b, fa, max(contexts), args.inv_rows, args.inv_min_len, invariance)
        for cfg in configs[1:]:
            if time.monotonic() - t0 > args.budget_s:
                skipped.append(cfg)
                continue
            run_config(b, cfg, default, args.reps, ceiling, tune)
    finally:
        tune.close()
        invariance.close()
    assert current() == default, "the module's constants were not restored"
    print(summary(b, tune.rows, invariance.rows, skipped))
    print(f"total {time.monotonic() - t0:.1f} s; CSVs in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
