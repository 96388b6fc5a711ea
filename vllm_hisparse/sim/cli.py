"""`hisparse sim`: replay selection traces through the runtime's cache policies.

    hisparse sim [TRACE ...] --policies lru,fifo,random,belady,vanilla --k 64,128,256 \
        --buffer 2k,4k --out DIR [--write-allocate on|off|both] [--lookahead 0,0.5k]

TRACE defaults to the small real trace shipped in the package. B (``--buffer``) is a multiple of k
(``2k``) or an absolute unit count (``512``). Writes DIR/results.csv (layer "all" and one row per
trace row), DIR/per_step.csv and two PNG plots; prints a summary table.
"""
from __future__ import annotations

import itertools
import os
import time

from vllm_hisparse import slots as policies

from . import engine, results, trace


def add_arguments(p) -> None:
    p.add_argument("traces", nargs="*", metavar="TRACE",
                   help="trace .npz files (default: the shipped real trace)")
    p.add_argument("--policies", default="all",
                   help=f"comma list of {', '.join(policies.available())}, or 'all' (default)")
    p.add_argument("--k", default="64,128,256", help="top-k sizes in units (default 64,128,256)")
    p.add_argument("--buffer", default="2k,4k",
                   help="hot-buffer sizes B: multiples of k ('2k') or absolute units ('512')")
    p.add_argument("--window", default="0",
                   help="comma list of windows W of newest units kept resident beside the buffer "
                        "(resident_first's partial rows): multiples of k ('2k') or units; 0 = none "
                        "(default); with W > 0 write-allocate is of the unit leaving the window "
                        "(the new unit is in it)")
    p.add_argument("--lookahead", default="0",
                   help="comma list of lookaheads m: after each step, the indexer's next m "
                        "candidates (ranks k .. k+m-1) are prefetched off the critical path "
                        "(sim/engine.py); multiples of k ('0.5k') or units; 0 = none (default); "
                        "needs traces recorded with k_max >= k + m")
    p.add_argument("--write-allocate", default="on", choices=["on", "off", "both"],
                   help="put each decoded token into the buffer as it is produced (default on)")
    p.add_argument("--warmup", type=int, default=32,
                   help="steps left out of steady_miss_rate (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--out", default="out/sim", help="output folder (default out/sim)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_buffer(spec: str, k: int, flag: str = "--buffer") -> int:
    """'2k' -> 2*k, '1.5k' -> int(1.5*k), '512' -> 512."""
    s = spec.strip().lower()
    try:
        v = int(float(s[:-1] or 1) * k) if s.endswith("k") else int(s)
    except ValueError:
        v = -1
    if v < 0:
        raise SystemExit(f"{flag} {spec!r}: give a multiple of k like '2k' or a unit count like "
                         f"'512'")
    return v


def parse_ints(flag: str, spec: str) -> list[int]:
    try:
        vals = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {spec!r}: give a comma list of integers like 64,128") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"{flag} {spec!r}: give positive integers")
    return vals


def parse_policies(spec: str) -> list[str]:
    if spec.strip() == "all":
        names = policies.available()
    else:
        names = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [p for p in names if p not in policies.available()]
    if bad or not names:
        raise SystemExit(f"--policies: unknown {', '.join(bad) if bad else repr(spec)}; choose from "
                         f"{', '.join(policies.available())} or 'all'")
    return names


def make_configs(ks: list[int], buffers: list[str], wa: str, k_max: int,
                 windows: tuple[str, ...] = ("0",), lookaheads: tuple[str, ...] = ("0",),
                 skipped: list | None = None) -> list[engine.Config]:
    """The configs of every (k, B, window, lookahead, write-allocate); a (k, lookahead) whose ranks
    the trace does not hold (k + lookahead > k_max) is left out and, with ``skipped``, listed
    there as (k, lookahead)."""
    was = {"on": [True], "off": [False], "both": [True, False]}[wa]
    out = []
    for k, b, ws, ls, w in itertools.product(ks, buffers, windows, lookaheads, was):
        if k > k_max:
            continue
        slots = parse_buffer(b, k)
        win = parse_buffer(ws, k, "--window")
        la = parse_buffer(ls, k, "--lookahead")
        if k + la > k_max:
            if skipped is not None and (k, la) not in skipped:
                skipped.append((k, la))
            continue
        if slots < k + la + w:          # (with a window: w is the unit leaving it, engine.Config)
            raise SystemExit(f"--buffer {b} gives B={slots} for k={k}"
                             f"{f' and lookahead {la}' if la else ''}: B must hold one selection"
                             f"{' and its prefetch' if la else ''}"
                             f"{' plus the new token' if w else ''}; use a larger --buffer")
        out.append(engine.Config(k, slots, w, win, la))
    return list(dict.fromkeys(out))


def run(args) -> int:
    paths = args.traces or [trace.default_trace_path()]
    try:
        traces = [trace.load(p) for p in paths]
    except trace.TraceError as e:
        raise SystemExit(f"hisparse sim: {e}") from None
    names = parse_policies(args.policies)
    ks = parse_ints("--k", args.k)
    buffers = [b for b in args.buffer.split(",") if b.strip()]
    plan = []
    for tr in traces:
        ahead: list = []
        cfgs = make_configs(ks, buffers, args.write_allocate, tr.k_max,
                            tuple(w for w in args.window.split(",") if w.strip()) or ("0",),
                            tuple(x for x in args.lookahead.split(",") if x.strip()) or ("0",),
                            ahead)
        skipped = [k for k in ks if k > tr.k_max]
        if skipped:
            print(f"{tr.name}: k={','.join(map(str, skipped))} > its k_max={tr.k_max}, skipped")
        if ahead:
            print(f"{tr.name}: " + ", ".join(f"k={k} + lookahead {la}" for k, la in ahead)
                  + f" > its k_max={tr.k_max} (record it with a larger k_max), skipped")
        if cfgs:
            plan.append((tr, cfgs))
    if not plan:
        raise SystemExit("hisparse sim: no --k (+ --lookahead) value fits the traces' k_max; use "
                         "a smaller --k or --lookahead")
    total = sum(tr.steps * len({c.slots for c in cfgs}) for tr, cfgs in plan) * len(names)
    from tqdm import tqdm
    bar = tqdm(total=total, unit="step", desc="sim", disable=args.no_progress)
    rows, per_step = [], []
    t0 = time.time()
    for tr, cfgs in plan:
        for name in names:
            bar.set_postfix_str(f"{tr.name[:24]} {name}")
            rep = engine.replay(tr, name, cfgs, seed=args.seed, bar=bar)
            rows += results.rows_of(rep, args.warmup)
            per_step += results.per_step_of(rep)
    bar.close()
    os.makedirs(args.out, exist_ok=True)
    res = results.write_csv(os.path.join(args.out, "results.csv"), rows, results.COLUMNS)
    results.write_csv(os.path.join(args.out, "per_step.csv"), per_step)
    plots = []
    if not args.no_plots:
        from . import plots as plotting          # matplotlib only when plotting
        plots = plotting.plot_all(args.out, rows, per_step)
    print(results.summary(rows))
    print(f"wrote {res}{''.join(', ' + p for p in plots)} in {time.time() - t0:.1f} s")
    return 0
