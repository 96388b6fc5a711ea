"""The worker's stats of a SparseRuntime (``stats_dict``; the demo, the serving bench and the
engine tests read them from ``HISPARSE_STATS_FILE``, written by ``dump``).

Counts since start: ``steps``, ``decode_rows`` (sparse one-token rows), ``resident_rows`` (sparse
rows with every page in the block table), ``partial_rows`` (some pages given back, some still
there), ``spills`` (requests that left *resident*), ``shrinks`` (every time the KV manager took
blocks from a request), ``inserts`` (pages given back that the plan copied into hot slots
first, per layer: core/give_back.py), RESOLVE's ``hits`` / ``misses`` of the hot slots (``hit_rate``: the
policy's) and ``resident_units`` (selected pages taken through the block table instead), so
``miss_rate`` = misses / every selected page. Gauges: pools, live requests and their residency
(core/residency.py ``residency_summary``). Host time of the plan and the layers.
``write_behind_writes``: prefill write-throughs issued on the side stream (core/write_behind.py).
"""
from __future__ import annotations

import json
import os

from vllm_hisparse.core.residency import residency_summary


def stats_dict(rt) -> dict:
    s = dict(rt.stats)
    s["hits"], s["misses"], s["resident_units"] = (int(x) for x in rt.hit_miss.tolist())
    n = s["resolved_units"] = s["hits"] + s["misses"]
    s["hit_rate"] = s["hits"] / n if n else None
    sel = n + s["resident_units"]
    s["miss_rate"] = s["misses"] / sel if sel else None
    s["inserts"] = rt.given_back.inserts()
    s["policy"] = rt.cfg.policy
    s["host_pages_used"] = rt.host_pages_used
    s["dense_pool_pages_used"] = rt.dpool.used_pages if rt.dpool is not None else 0
    s["live_requests"] = len(rt.reqs)
    s["write_behind_writes"] = rt.write_behind.writes
    s.update(residency_summary(rt.cfg, {rid: (r.start, r.num_prompt, r.keep)
                                        for rid, r in rt.reqs.items() if r.sparse}))
    # host (CPU) time spent in plan / forward_layer, totals over all steps
    s.update({f"host_ms_{k}": round(v * 1e3, 3) for k, v in rt._host_s.items()})
    return s


def dump(rt, path: str | None) -> None:
    """Write stats_dict to ``path`` atomically (nothing without a path)."""
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(stats_dict(rt), f)
        os.replace(tmp, path)
