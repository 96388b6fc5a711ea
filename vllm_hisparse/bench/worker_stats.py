"""The hisparse worker's counters file (``HISPARSE_STATS_FILE``, written by the runtime when a
request is dropped: vllm/connector.py) read by ``bench.serving``: its snapshots before and after a
concurrency point give that point's host time per step and RESOLVE's hits and misses."""
from __future__ import annotations

import json


def read_stats(path: str | None) -> dict | None:
    """The hisparse worker's counters (HISPARSE_STATS_FILE), None when there are none (stock)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (TypeError, FileNotFoundError, json.JSONDecodeError):
        return None


def host_per_step(before: dict | None, after: dict | None) -> dict:
    """Host ms per step of the steps between two snapshots of the worker's counters: the plan, and
    every attention layer's Python and launches (dense, sparse, FULL-graph body); {} without them."""
    if not before or not after or after["steps"] <= before["steps"]:
        return {}
    n = after["steps"] - before["steps"]
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    layers = sum(d(f"host_ms_{k}_layers") for k in ("dense", "sparse", "full"))
    return {"steps": n, "plan": d("host_ms_plan") / n, "layers": layers / n}


def cache_per_point(before: dict | None, after: dict | None) -> dict:
    """RESOLVE between two snapshots of the worker's counters: the policy, the hot slots' hit rate
    (None when every selected page was on the block table), misses, the miss rate over every
    selected page (comparable with and without resident_first), the pages taken through the block
    table, resident-first spills and shrinks; {} without them or when nothing was selected."""
    if not before or not after:
        return {}
    d = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    n = d("hits") + d("misses")
    sel = n + d("resident_units")
    if sel <= 0:
        return {}
    return {"policy": after.get("policy"), "hit_rate": d("hits") / n if n else None,
            "misses": d("misses"), "miss_rate": d("misses") / sel,
            "resident_units": d("resident_units"), "spills": d("spills"), "shrinks": d("shrinks")}
