"""The measuring harness of bench/dense_tune.py: one random paged cache and per (rows, context)
case a query, block tables and the reference output (``Bench``); the output check (``rel_err``,
``measure``: a wrong output is reported, not timed); the timer (``time_calls``: calls recorded into
one CUDA graph, replayed, CUDA events; wall clock off CUDA); the bandwidth ceiling; CSV rows.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import statistics
import time

import torch

from vllm_hisparse.ops import reference
from vllm_hisparse.ops import triton_dense_decode as td

# max |out - want| / max |want|. One bf16 rounding is <= 2^-8 (0.4%) of max|want|; one split of 32
# dropped from a 4K row moved it by 23% in a CPU trial (random q/K/V, Llama shape): 2% parts them.
TOL = 2e-2
N_CALLS = 20                          # calls per graph, each with its own block table


@dataclasses.dataclass(frozen=True)
class Shape:
    hq: int = 32
    hkv: int = 8
    d: int = 128
    page: int = 16


@dataclasses.dataclass
class Case:
    rows: int
    ctx: int
    q: torch.Tensor           # (rows, Hq, D)
    seq: torch.Tensor         # (rows,) int32, all ctx
    tables: list              # n x (rows, ceil(ctx / page)) int32, random distinct pages each
    out: torch.Tensor         # (rows, Hq, D): the timed calls' output
    cu: torch.Tensor          # (rows + 1,) int32: FlashAttention's query offsets
    ref: torch.Tensor | None = None    # reference output of table 0
    base: torch.Tensor | None = None   # the default config's output of table 0


class Bench:
    """One random paged cache (K and V (pages, page, Hkv, D)) shared by every case, sized for the
    largest; per case a query, an output and n_tables random block tables."""

    def __init__(self, shape: Shape, cases: list[tuple[int, int]], device: torch.device,
                 dtype: torch.dtype, n_tables: int, seed: int = 0):
        self.shape, self.device, self.dtype = shape, device, dtype
        self.pages = max(R * -(-ctx // shape.page) for R, ctx in cases)
        kv = torch.randn(2, self.pages, shape.page, shape.hkv, shape.d, device=device, dtype=dtype,
                         generator=torch.Generator(device=device).manual_seed(seed))
        self.g = torch.Generator().manual_seed(seed)     # tables and queries: made on the CPU
        self.k, self.v = kv[0], kv[1]
        self.scale = shape.d ** -0.5
        self.max_rows = max(R for R, _ in cases)
        self.cases = [self._case(R, ctx, n_tables) for R, ctx in cases]

    def _case(self, R: int, ctx: int, n: int) -> Case:
        s, dev = self.shape, self.device
        W = -(-ctx // s.page)
        tables = [torch.randperm(self.pages, generator=self.g)[:R * W].view(R, W)
                  .to(device=dev, dtype=torch.int32) for _ in range(n)]
        q = torch.randn(R, s.hq, s.d, generator=self.g).to(device=dev, dtype=self.dtype)
        case = Case(R, ctx, q, torch.full((R,), ctx, dtype=torch.int32, device=dev), tables,
                    torch.empty_like(q), torch.arange(R + 1, dtype=torch.int32, device=dev))
        case.ref = reference.dense_decode_attention(q, self.k, self.v, tables[0], case.seq,
                                                    self.scale)
        return case

    def work(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Partials for the current SPLITS (set the config first), for the largest case."""
        po, pml = td.partials_numel(self.max_rows, self.shape.hq, self.shape.d)
        return (torch.empty(po, dtype=torch.float32, device=self.device),
                torch.empty(pml, dtype=torch.float32, device=self.device))

    def kv_bytes(self, case: Case) -> int:
        return 2 * case.rows * case.ctx * self.shape.hkv * self.shape.d * self.k.element_size()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in fp32; inf where either holds NaN/inf (the checked output
    is poisoned with NaN first, so rows left unwritten count as wrong)."""
    got, want = got.float(), want.float()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def time_calls(calls: list, reps: int, device: torch.device) -> float:
    """us per call. CUDA: the calls recorded into one graph (after a warm-up pass), replayed reps
    times, median. Elsewhere: wall clock of one pass."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ms.append(e0.elapsed_time(e1))
    del g
    return statistics.median(ms) * 1e3 / len(calls)


def measure(b: Bench, case: Case, call, reps: int, ceiling: float | None) -> dict:
    """call(t, out): one call over case.tables[t] into out. Checks table 0's output (poisoned
    first) against the reference and the default's; times the calls only when it is ok."""
    out = torch.full_like(case.out, float("nan"))
    call(0, out)
    err_r = rel_err(out, case.ref)
    err_d = rel_err(out, case.base) if case.base is not None else None
    ok = err_r < TOL and (err_d is None or err_d < TOL)
    row = {"ok": ok, "err_vs_ref": f"{err_r:.3g}",
           "err_vs_default": None if err_d is None else f"{err_d:.3g}"}
    if ok:
        us = time_calls([functools.partial(call, t, case.out) for t in range(len(case.tables))],
                        reps, b.device)
        gbps = b.kv_bytes(case) / us / 1e3
        row.update(us=round(us, 2), gbps=round(gbps, 1),
                   pct_ceiling=None if ceiling is None else round(100 * gbps / ceiling, 1))
    return row


def copy_ceiling_gbps(device: torch.device) -> float | None:
    """A device-to-device copy's GB/s (bytes read + written): the bandwidth ceiling measured."""
    if device.type != "cuda":
        return None
    x = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        y.copy_(x)
    e1.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e9


class CsvOut:
    """A CSV written row by row (flushed: a run cut short still leaves its rows)."""

    def __init__(self, path: str, fields: list[str], hide: tuple = ()):
        self.hide = set(hide)                # fields left out of the progress line
        self.f = open(path, "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=fields)
        self.w.writeheader()
        self.rows: list[dict] = []

    def __call__(self, row: dict) -> None:
        self.w.writerow(row)
        self.f.flush()
        self.rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()
                       if v is not None and v != "" and k not in self.hide), flush=True)

    def close(self) -> None:
        self.f.close()


