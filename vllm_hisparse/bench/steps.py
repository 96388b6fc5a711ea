"""The serving benchmark's per-step figures, from the server's own step records (one per engine
step, written by the front end as it handles the step: ``vllm/step_log.py``, the format there).

A scrape of ``/metrics`` every 0.5 s from the client could fall behind or stop under load (its
"decode peak" could read below the run's end-to-end average); these records miss no step and
time each one on the engine's clock.

*Decode-only* steps are those in which no request is in prefill: every running request generated
one token, none got its first one (no prefill completed), none is waiting. Their rate is the
decode phase's: ``decode_rate`` = their tokens / their durations, a step's duration being the time
since the previous token of its requests on the engine's clock (``itl``: all of them decoded in the
step before too, unless it completed a prefill, where the previous token was that first one).
"""
from __future__ import annotations

import json
import statistics


def read(path: str, offset: int = 0) -> tuple[list[dict], int]:
    """The complete records from byte ``offset`` on, and the offset after the last of them (a line
    still being written is left for the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    recs = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return recs, offset + end


def decode_only(r: dict) -> bool:
    """No request in prefill during this step (see the module docstring)."""
    if r["running"] is None or r["waiting"] is None or r["itl"] is None:
        return False
    return (r["first"] == 0 and r["waiting"] == 0 and r["preempted"] == 0 and r["gen"] > 0
            and r["gen"] == r["running"] + r["finished"])


def decode_rate(recs: list[dict]) -> dict:
    """The decode-only figures of a run's records: tok_s (tokens / seconds over the decode-only
    steps), their seconds, steps and tokens, and the mean step in ms (the GPU's time per decode
    step, as the engine sees it). tok_s is None without any decode-only step."""
    steps = [r for r in recs if decode_only(r)]
    tokens = sum(r["gen"] for r in steps)
    seconds = sum(r["itl"] for r in steps)
    return {"tok_s": tokens / seconds if seconds > 0 else None, "seconds": seconds,
            "steps": len(steps), "tokens": tokens,
            "step_ms": 1e3 * seconds / len(steps) if steps else None}


def window_rate(recs: list[dict], i: int, j: int) -> float:
    """Tokens / time over records i+1..j on the front end's clock (record i opens the window):
    what a counter read at records i and j would give."""
    return sum(r["gen"] for r in recs[i + 1:j + 1]) / (recs[j]["t"] - recs[i]["t"])


def decode_runs(recs: list[dict]) -> list[tuple[int, int]]:
    """Maximal runs [a, b] (indices, inclusive) of consecutive decode-only records."""
    runs, a = [], None
    for k, r in enumerate(recs):
        if decode_only(r):
            a = k if a is None else a
        elif a is not None:
            runs.append((a, k - 1))
            a = None
    if a is not None:
        runs.append((a, len(recs) - 1))
    return runs


def running(recs: list[dict]) -> tuple[int, float]:
    """(most running requests in any step, mean over the steps): the scheduler's own count."""
    xs = [r["running"] for r in recs if r["running"] is not None]
    return (max(xs), statistics.fmean(xs)) if xs else (-1, -1.0)
