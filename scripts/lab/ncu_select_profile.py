"""Where the CUDA select's time goes, from scripts/lab/gpu_ncu.sh's per-instruction source pages.

Reads the `sel-ROWS-{hot,resident}-sass.csv` files that gpu_ncu.sh writes (Nsight Compute's source
page as CSV, one table per profiled launch) and prints, for each, the instructions executed (first
launch), the distinct instructions and 128-byte instruction-cache lines they span, and the warp
stall samples (all launches) of three phases with their top stall reasons:
  prologue+issue  the row's scalars, the scores' loads and (hot rows) the state's copies, up to the
                  first CTA barrier;
  top-k           the radix passes, up to RESOLVE (hot: the wait on the state's copies; resident:
                  the last barrier);
  resolve/tail    RESOLVE and the stores of sel / locs (resident: the block-table reads).

    python3 scripts/lab/ncu_select_profile.py DIR [ROWS]
"""
import collections
import csv
import io
import os
import sys


def launches(path):
    text = open(path).read()
    blocks = [b for b in text.split('"Kernel Name"') if b.strip()]
    return [list(csv.DictReader(io.StringIO(b.split("\n", 1)[1]))) for b in blocks]


def executed(row):
    return int(row["Instructions Executed"] or 0) > 0


def phase_bounds(rows, hot):
    first_bar = next(i for i, r in enumerate(rows) if "BAR.SYNC" in r["Source"] and executed(r))
    if hot:
        tail = next(i for i, r in enumerate(rows) if "TRYWAIT" in r["Source"] or "DEPBAR.LE" in r["Source"])
    else:
        tail = max(i for i, r in enumerate(rows) if "BAR.SYNC" in r["Source"] and executed(r))
    return first_bar, tail


def summarize(path, hot):
    ks = launches(path)
    rows = ks[0]
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    first_bar, tail = phase_bounds(rows, hot)
    names = ("prologue+issue", "top-k", "resolve/tail")
    samples, why = collections.Counter(), collections.defaultdict(collections.Counter)
    for k in ks:
        for i, r in enumerate(k):
            ph = names[0] if i <= first_bar else names[1] if i < tail else names[2]
            samples[ph] += int(r["Warp Stall Sampling (All Samples)"] or 0)
            for c in reasons:
                why[ph][c[len("stall_"):]] += int(r[c] or 0)
    live = [r for r in rows if executed(r)]
    lines = {int(r["Address"], 16) // 128 for r in live}
    tail_live = [r for i, r in enumerate(rows) if i >= tail and executed(r)]
    print(f"{os.path.basename(path)}: {len(ks)} launches; first launch {sum(int(r['Instructions Executed']) for r in live)} "
          f"warp instructions, {len(live)} distinct in {len(lines)} i-cache lines "
          f"(resolve/tail: {len(tail_live)} in {len({int(r['Address'], 16) // 128 for r in tail_live})})")
    for ph in names:
        top = ", ".join(f"{n} {v}" for n, v in why[ph].most_common(4))
        print(f"  {ph:15s} {samples[ph]:5d} samples  ({top})")
    return samples


def main():
    d = sys.argv[1]
    rows = sys.argv[2] if len(sys.argv) > 2 else "1"
    got = {}
    for mode in ("hot", "resident"):
        p = os.path.join(d, f"sel-{rows}-{mode}-sass.csv")
        if os.path.exists(p):
            got[mode] = summarize(p, mode == "hot")
    if len(got) == 2:
        diff = {k: got["hot"][k] - got["resident"][k] for k in got["hot"]}
        print("  hot - resident: " + ", ".join(f"{k} {v:+d}" for k, v in diff.items()))


if __name__ == "__main__":
    main()
