"""bench.chat's leak check (issue 47): after a hisparse backend's run, host pages in use must equal
the pages its prefix cache holds, and be 0 once the cache is reset (bench/chat.py's docstring says
how it runs). Reads the gauges of vllm/metrics.py through /metrics."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

from vllm_hisparse.bench import prom

# leak-check figures: row key -> /metrics series (vllm/metrics.py); -1 or absent: not reported
PAGES = {k: f"vllm:hisparse_{v}" for k, v in (
    ("in_use", "host_page_table_pages_in_use"), ("held_by_cache", "host_page_table_pages_cached"),
    ("worker_pool_used", "host_pool_pages_used"), ("reserved", "host_pool_pages_reserved"))}
PROBE = list(range(100, 164))        # warm-up and probes: short, never host-backed
ABORTED = 'vllm:request_success_total{finished_reason="abort"}'   # since the server started


def pages(series: dict[str, float]) -> dict[str, int | None]:
    """The leak-check figures of one /metrics scrape (PAGES); None: not reported."""
    got = {k: series.get(name, -1.0) for k, name in PAGES.items()}
    return {k: int(v) if v >= 0 else None for k, v in got.items()}


def settled(series: dict[str, float], empty: bool = False) -> bool:
    """No request runs or waits, and the prefix cache's pages alone are in use (empty: none)."""
    p = pages(series)
    if empty and (p["in_use"] or p["held_by_cache"]):
        return False
    busy = series.get("vllm:num_requests_running") or series.get("vllm:num_requests_waiting")
    return (not busy and p["in_use"] == p["held_by_cache"] and not p["reserved"]
            and not p["worker_pool_used"])


async def settle(complete, base: str, timeout: float, empty: bool = False) -> dict[str, float]:
    """Probe requests (their steps refresh the gauges; an idle engine reports nothing) until the
    scrape is ``settled`` or ``timeout`` s passed (a leak outlasts it); the last scrape."""
    t_end = time.monotonic() + timeout
    while True:
        await complete(PROBE, 2)
        await asyncio.sleep(0.5)
        series = await asyncio.to_thread(prom.scrape, base)
        if settled(series, empty) or time.monotonic() > t_end:
            return series


def reset_prefix_cache(base: str) -> bool:
    """vLLM's dev endpoint (VLLM_SERVER_DEV_MODE=1): the GPU prefix cache and the connector's
    (reset_connector: hisparse's host page index). False while blocks are held."""
    req = urllib.request.Request(f"{base}/reset_prefix_cache?reset_external=true", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return bool(json.loads(r.read()).get("success"))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST /reset_prefix_cache: HTTP {e.code}; the server needs "
                           f"VLLM_SERVER_DEV_MODE=1 (bench.chat sets it)") from e


async def leak_check(complete, base: str, timeout: float) -> dict:
    """After the run, then after a prefix-cache reset: the PAGES figures (``*_after``,
    ``*_after_reset``) and requests the server aborted (``requests_aborted_server``)."""
    after = await settle(complete, base, timeout)
    t_end = time.monotonic() + timeout
    while not await asyncio.to_thread(reset_prefix_cache, base):
        if time.monotonic() > t_end:
            raise RuntimeError(f"/reset_prefix_cache failed for {timeout:.0f} s (blocks held)")
        await complete(PROBE, 2)
        await asyncio.sleep(0.5)
    reset = await settle(complete, base, timeout, empty=True)
    out = {f"host_pages_{k}_after": v for k, v in pages(after).items()}
    out |= {f"host_pages_{k}_after_reset": v for k, v in pages(reset).items()}
    out["requests_aborted_server"] = int(after.get(ABORTED, 0))
    return out


def leak_verdict(backend: str, r: dict) -> str | None:
    """None for a clean run, else one line naming the numbers: pages in use must equal those the
    prefix cache holds after the run (no reserved or worker-held page left) and be 0 after the
    reset."""
    keys = ("in_use_after", "held_by_cache_after", "in_use_after_reset",      # [2:]: must be 0
            "held_by_cache_after_reset", "reserved_after", "worker_pool_used_after")
    v = {k: r.get(f"host_pages_{k}") for k in keys}
    missing = [k for k, x in v.items() if x is None]
    if missing:
        return (f"{backend}: leak check impossible: /metrics reports no host_pages_"
                f"{', '.join(missing)} (vllm/metrics.py PAGES: the scheduler's stats must include "
                f"metrics.table_gauges)")
    if v["in_use_after"] == v["held_by_cache_after"] and not any(v[k] for k in keys[2:]):
        return None
    return (f"{backend}: host page leak: after the run {v['in_use_after']} pages in use, "
            f"{v['held_by_cache_after']} held by the prefix cache, {v['reserved_after']} reserved, "
            f"{v['worker_pool_used_after']} held on the worker; after the reset "
            f"{v['in_use_after_reset']} in use, {v['held_by_cache_after_reset']} held")
