"""hisparse's counters on vLLM's ``/metrics``, through vLLM 0.26's KV-connector stats path.

How they travel (vLLM 0.26, no wrap needed):

1. worker, every tensor-parallel rank, every step: ``HiSparseConnector.get_kv_connector_stats``
   -> ``WorkerReport.report``: this rank's counters since its previous report and its gauges,
   ``{"ranks": {"<tp rank>": {...}}}``, or None when nothing changed;
2. the executor's ``KVOutputAggregator`` merges the ranks' reports of the step
   (``HiSparseStats.aggregate``); the scheduler adds the scheduler-side connector's report
   (``{"sched": {...}}``: requests told to wait, pages reserved, requests running host-less,
   the page table's pages in use and held by the prefix-cache index: ``table_gauges``)
   and ships the data dict in ``SchedulerStats.kv_connector_stats``;
3. front end: ``PrometheusStatLogger.record`` -> ``KVConnectorProm.observe`` ->
   ``HiSparsePromMetrics.observe``; the periodic log line "KV Transfer metrics: ..." is
   ``HiSparseStats.reduce``.

Device counters (RESOLVE's hits and misses live on the GPU) are read without waiting for the GPU:
each report queues a copy into pinned host memory and uses the last copy that has landed
(``DeviceCounters``), so they lag by about a step; they are read exactly (one sync) only when the
worker holds no live request, i.e. when the engine is about to go idle. Everything else is a count
the host already keeps (the runtime's plan, the pools' free lists, the connector's admission).
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from .compat import KVConnectorPromMetrics, KVConnectorStats, create_metric_per_engine
from .deployment import config_of

COUNTERS = ("hits", "lookups", "miss_bytes", "sparse_rows", "dense_rows")   # deltas per report
WAIT_REASONS = ("host_pool", "dense_pool", "quest_rows")
TABLE_GAUGES = ("host_pages_in_use", "host_pages_cached")     # the scheduler's HostPageTable
DONATION_GAUGES = ("prefix_slots_donated", "prefix_slots_dropped")    # the KV manager's, cumulative


def table_gauges(table) -> dict[str, int]:
    """The scheduler's page-table gauges (core/host_pages.py ``HostPageTable``), for its part of a
    report: pages off the free list (held by a live request or by the prefix-cache index) and pages
    the index holds. Idle, the two are equal; after ``reset_prefix_cache(reset_connector=True)``
    both are 0 (bench.chat's leak check)."""
    return {"host_pages_in_use": table.used, "host_pages_cached": len(table.index)}


def donation_gauges(ledger) -> dict[str, int]:
    """The KV manager's donations of hashed hot-slot blocks since the start (vllm/spec.py: moved to
    a fresh copy before the worker overwrites the slot, or dropped from the prefix cache when no
    block was free: a lost hit), from the pool's spill ledger; none without a host tier."""
    if ledger is None:
        return {}
    return {"prefix_slots_donated": ledger.donation["donated"],
            "prefix_slots_dropped": ledger.donation["dropped"]}


class HiSparseStats(KVConnectorStats):
    """``data = {"ranks": {rank: {COUNTERS deltas..., "host_pages_used": n}}, "sched": {...}}``;
    ranks are tensor-parallel ranks as strings. Aggregating adds a rank's counters and keeps the
    newer gauges (``other`` is the newer report: vLLM aggregates ranks of one step, then steps in
    order)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        ranks = self.data.setdefault("ranks", {})
        for rank, d in (other.data.get("ranks") or {}).items():
            mine = ranks.get(rank)
            if mine is None:
                ranks[rank] = dict(d)
                continue
            for k, v in d.items():
                mine[k] = mine.get(k, 0) + v if k in COUNTERS else v
        if other.data.get("sched") is not None:
            self.data["sched"] = dict(other.data["sched"])
        return self

    def reduce(self) -> dict[str, int | float]:
        tot = totals(self.data)
        out = {k: tot[k] for k in ("hits", "lookups", "sparse_rows", "dense_rows") if k in tot}
        if tot.get("lookups"):
            out["hit_rate"] = round(tot["hits"] / tot["lookups"], 4)
        if "miss_bytes" in tot:
            out["miss_MiB"] = round(tot["miss_bytes"] / (1 << 20), 3)
        for k in ("host_pages_used", "host_pages_reserved", "host_pages", "requests_hostless",
                  "requests_moved_to_host", *TABLE_GAUGES, *DONATION_GAUGES):
            if k in tot:
                out[k] = tot[k]
        return out

    def is_empty(self) -> bool:
        return not self.data.get("ranks") and not self.data.get("sched")


def totals(data: dict[str, Any]) -> dict[str, int]:
    """What /metrics shows for one report: hits, lookups and miss bytes summed over the ranks
    (each rank resolves and fetches its own KV heads); decode rows and host pages from rank 0
    (every rank plans the same rows and holds the same page ids); the scheduler's gauges."""
    ranks = data.get("ranks") or {}
    out: dict[str, int] = {}
    for d in ranks.values():
        for k in ("hits", "lookups", "miss_bytes"):
            out[k] = out.get(k, 0) + d.get(k, 0)
    first = ranks.get("0")
    if first is not None:
        for k in ("sparse_rows", "dense_rows", "host_pages_used"):
            if k in first:
                out[k] = first[k]
    out.update(data.get("sched") or {})
    return out


class DeviceCounters:
    """A small counter tensor on the device, read without a sync: ``read`` returns the last copy
    that reached the host and queues the next one (``wait=True``: read it now, synchronously)."""

    def __init__(self, src: torch.Tensor):
        self.src = src
        self.cuda = src.is_cuda
        self.value = [0] * src.numel()
        if self.cuda:
            self.host = torch.zeros(src.shape, dtype=src.dtype, pin_memory=True)
            self.event = torch.cuda.Event()
            self.pending = False

    def read(self, wait: bool = False) -> list[int]:
        if not self.cuda or wait:
            self.value = [int(x) for x in self.src.tolist()]
            if self.cuda:
                self.pending = False
            return self.value
        if self.pending and self.event.query():
            self.value = [int(x) for x in self.host.tolist()]
            self.pending = False
        if not self.pending:
            self.host.copy_(self.src, non_blocking=True)
            self.event.record()
            self.pending = True
        return self.value


class WorkerReport:
    """One rank's reports: counter deltas since its previous report, gauges when they change."""

    def __init__(self, runtime, rank: int, page_bytes: int):
        """page_bytes: one host page of one layer on this rank (a miss fetches one)."""
        self.rt, self.rank, self.page_bytes = runtime, str(rank), page_bytes
        self.counters = DeviceCounters(runtime.hit_miss)
        self.last = dict.fromkeys(COUNTERS, 0)
        self.gauges: dict[str, int] | None = None

    def now(self, wait: bool = False) -> dict[str, int]:
        hits, misses = self.counters.read(wait)[:2]      # [2]: block-table pages (stats file)
        st = self.rt.stats
        return {"hits": hits, "lookups": hits + misses, "miss_bytes": misses * self.page_bytes,
                "sparse_rows": st["decode_rows"], "dense_rows": st["dense_decode_rows"]}

    def report(self) -> HiSparseStats | None:
        now = self.now(wait=not self.rt.reqs)      # no live request: the engine may go idle
        gauges = {"host_pages_used": self.rt.host_pages_used}
        delta = {k: now[k] - self.last[k] for k in COUNTERS}
        if not any(delta.values()) and gauges == self.gauges:
            return None
        self.last, self.gauges = now, gauges
        return HiSparseStats(data={"ranks": {self.rank: {**delta, **gauges}}})


class HiSparsePromMetrics(KVConnectorPromMetrics):
    """The Prometheus series (vLLM's ``vllm:`` prefix, its ``model_name`` and ``engine`` labels)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = per_engine_labelvalues

        def make(cls, name, doc, extra=None, **kw):
            m = cls(name=name, documentation=doc, labelnames=labelnames + ([extra[0]] if extra else []),
                    **kw)
            if extra is None:
                return create_metric_per_engine(m, per_engine)
            return {v: create_metric_per_engine(m, {i: lv + [v] for i, lv in per_engine.items()})
                    for v in extra[1]}

        counter, gauge = self._counter_cls, self._gauge_cls
        self.counters = {
            "hits": make(counter, "vllm:hisparse_hot_buffer_hits",
                         "Selected pages found in the GPU hot buffer by RESOLVE (summed over "
                         "tensor-parallel ranks)."),
            "lookups": make(counter, "vllm:hisparse_hot_buffer_lookups",
                            "Selected pages RESOLVE looked up in the GPU hot buffer (hits + "
                            "misses, summed over tensor-parallel ranks)."),
            "miss_bytes": make(counter, "vllm:hisparse_miss_bytes",
                               "Bytes fetched from the host KV pool for hot-buffer misses (all "
                               "ranks)."),
        }
        self.rows = make(counter, "vllm:hisparse_decode_rows",
                         "Decode rows (one query token) by attention kind: sparse (Quest top-k over "
                         "the hot buffer) or dense (short requests).", ("kind", ("sparse", "dense")))
        mp = {"multiprocess_mode": "mostrecent"}
        self.gauges = {
            "host_pages_used": make(gauge, "vllm:hisparse_host_pool_pages_used",
                                    "Host KV pool pages holding tokens (pages of every layer; "
                                    "the same on every rank).", **mp),
            "host_pages_reserved": make(gauge, "vllm:hisparse_host_pool_pages_reserved",
                                        "Host KV pool pages reserved by admitted requests.", **mp),
            "host_pages": make(gauge, "vllm:hisparse_host_pool_pages_capacity",
                               "Host KV pool capacity in pages.", **mp),
            "host_pages_in_use": make(gauge, "vllm:hisparse_host_page_table_pages_in_use",
                                      "Host KV pool pages off the scheduler's free list: held "
                                      "by a live request or by the prefix-cache index (-1: "
                                      "not reported).", **mp),
            "host_pages_cached": make(gauge, "vllm:hisparse_host_page_table_pages_cached",
                                      "Host KV pool pages the prefix-cache index holds (published "
                                      "host copies; those no live request holds are evictable; "
                                      "-1: not reported).", **mp),
            "prefix_slots_donated": make(gauge, "vllm:hisparse_prefix_slots_donated",
                                         "Hashed hot-slot blocks the KV manager moved to fresh "
                                         "copies before the worker overwrote them, since start "
                                         "(prefix caching keeps their hits).", **mp),
            "prefix_slots_dropped": make(gauge, "vllm:hisparse_prefix_slots_dropped",
                                         "Hashed hot-slot blocks dropped from the prefix cache "
                                         "for want of a free block, since start (lost hits).",
                                         **mp),
            "requests_hostless": make(gauge, "vllm:hisparse_requests_hostless",
                                      "Requests running host-less (admitted when the host pool "
                                      "was full: every page on the GPU, never spilled; sparse, "
                                      "or dense with hostless dense).", **mp),
        }
        for k in TABLE_GAUGES:             # -1 until the scheduler reports it (not 0: no pages)
            for m in self.gauges[k].values():
                m.set(-1)
        self.waiting = make(gauge, "vllm:hisparse_requests_waiting",
                            "Requests held back by hisparse admission, by what is full.",
                            ("reason", WAIT_REASONS), **mp)
        policy = config_of(vllm_config).policy
        info = make(gauge, "vllm:hisparse_policy_info",
                    "The hot-buffer replacement policy RESOLVE runs (value 1): join the hit rate "
                    "(hits / lookups) on it to compare policies.", ("policy", (policy,)), **mp)
        for m in info[policy].values():
            m.set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        tot = totals(transfer_stats_data)
        for k, m in self.counters.items():
            if tot.get(k):
                m[engine_idx].inc(tot[k])
        for kind in ("sparse", "dense"):
            if tot.get(f"{kind}_rows"):
                self.rows[kind][engine_idx].inc(tot[f"{kind}_rows"])
        for k, m in self.gauges.items():
            if k in tot:
                m[engine_idx].set(tot[k])
        for reason in WAIT_REASONS:
            if f"waiting_{reason}" in tot:
                self.waiting[reason][engine_idx].set(tot[f"waiting_{reason}"])


def build_stats(data: dict[str, Any] | None) -> HiSparseStats:
    """The connector's ``build_kv_connector_stats``: a copy, since vLLM's log accumulator
    aggregates into it and the dict is the SchedulerStats' own."""
    return HiSparseStats(data=copy.deepcopy(data) if data else {})
