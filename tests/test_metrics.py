"""vllm/metrics.py without an engine: what every rank reports, how vLLM's own aggregation code
merges ranks and steps, what Prometheus then shows. (tests/test_vllm_engine.py scrapes a real
`vllm serve`; tests/test_soak.py reads the same series under load.)"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture
def m():
    from vllm_hisparse.vllm import metrics

    return metrics


def fake_runtime(hits=0, misses=0, sparse=0, dense=0, used=0, live=("r",)):
    return SimpleNamespace(hit_miss=torch.tensor([hits, misses]), host_pages_used=used,
                           reqs=dict.fromkeys(live),
                           stats={"decode_rows": sparse, "dense_decode_rows": dense})


def test_worker_reports_deltas_and_nothing_when_nothing_changed(m):
    rt = fake_runtime()
    rep = m.WorkerReport(rt, rank=1, page_bytes=100)
    assert rep.report().data == {"ranks": {"1": {"hits": 0, "lookups": 0, "miss_bytes": 0,
                                                 "sparse_rows": 0, "dense_rows": 0,
                                                 "host_pages_used": 0}}}    # first: the gauges
    assert rep.report() is None
    rt.hit_miss += torch.tensor([5, 3])
    rt.stats["decode_rows"] = 4
    rt.host_pages_used = 7
    assert rep.report().data["ranks"]["1"] == {"hits": 5, "lookups": 8, "miss_bytes": 300,
                                               "sparse_rows": 4, "dense_rows": 0,
                                               "host_pages_used": 7}
    rt.hit_miss += torch.tensor([1, 0])
    assert rep.report().data["ranks"]["1"]["hits"] == 1                      # a delta
    assert rep.report() is None


def test_aggregation_through_vllms_kv_output_aggregator(m):
    """Two ranks' reports of one step go through vLLM's own KVOutputAggregator (what the mp and Ray
    executors run), then a second step through its log accumulator: counters of each rank add up,
    gauges keep the newest; /metrics then shows hits, lookups and bytes of all ranks, rows and pages
    of rank 0 (every rank plans the same rows), the scheduler's gauges."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    def out(rank, **kw):
        st = m.HiSparseStats(data={"ranks": {rank: dict(kw)}})
        return ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(kv_connector_stats=st))

    row = dict(sparse_rows=4, dense_rows=1, miss_bytes=0)
    step1 = KVOutputAggregator(2).aggregate([
        out("0", hits=5, lookups=8, host_pages_used=7, **row),
        out("1", hits=6, lookups=8, host_pages_used=7, **row)]).kv_connector_output.kv_connector_stats
    sched = m.HiSparseStats(data={"sched": {"host_pages_reserved": 9, "host_pages": 20,
                                            "waiting_host_pool": 2}})
    step1 = step1.aggregate(sched)                    # what Scheduler.update_from_output does
    assert m.totals(step1.data) == {"hits": 11, "lookups": 16, "miss_bytes": 0, "sparse_rows": 4,
                                    "dense_rows": 1, "host_pages_used": 7,
                                    "host_pages_reserved": 9, "host_pages": 20,
                                    "waiting_host_pool": 2}
    acc = m.build_stats(step1.data)                   # the front end's log accumulator
    acc.aggregate(m.HiSparseStats(data={"ranks": {"0": dict(hits=1, lookups=2, host_pages_used=3,
                                                             **row)}}))
    assert m.totals(step1.data)["hits"] == 11         # the SchedulerStats' dict is left alone
    assert acc.reduce() == {"hits": 12, "lookups": 18, "sparse_rows": 8, "dense_rows": 2,
                            "hit_rate": 0.6667, "miss_MiB": 0.0, "host_pages_used": 3,
                            "host_pages_reserved": 9, "host_pages": 20}
    assert m.HiSparseStats().is_empty() and not acc.is_empty()


def test_prometheus_series(m):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Counter, Gauge, Histogram)}
    prom = m.HiSparsePromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                                 ["model_name", "engine"], {0: ["tiny", "0"]})
    data = {"ranks": {"0": {"hits": 5, "lookups": 8, "miss_bytes": 300, "sparse_rows": 4,
                            "dense_rows": 2, "host_pages_used": 7},
                      "1": {"hits": 6, "lookups": 8, "miss_bytes": 200, "sparse_rows": 4,
                            "dense_rows": 2, "host_pages_used": 7}},
            "sched": {"host_pages_reserved": 9, "host_pages": 20, "waiting_host_pool": 2,
                      "waiting_dense_pool": 0, "waiting_quest_rows": 1,
                      "prefix_slots_donated": 12, "prefix_slots_dropped": 1}}
    prom.observe(data, 0)
    prom.observe({"ranks": {"0": {"hits": 1, "lookups": 1, "miss_bytes": 0, "sparse_rows": 1,
                                  "dense_rows": 0, "host_pages_used": 3}}}, 0)
    lab = {"model_name": "tiny", "engine": "0"}

    def v(name, **extra):
        return reg.get_sample_value(name, dict(lab, **extra))

    assert v("vllm:hisparse_hot_buffer_hits_total") == 12
    assert v("vllm:hisparse_hot_buffer_lookups_total") == 17
    assert v("vllm:hisparse_miss_bytes_total") == 500
    assert v("vllm:hisparse_decode_rows_total", kind="sparse") == 5
    assert v("vllm:hisparse_decode_rows_total", kind="dense") == 2
    assert v("vllm:hisparse_host_pool_pages_used") == 3
    assert v("vllm:hisparse_host_pool_pages_reserved") == 9          # not in the second report
    assert v("vllm:hisparse_host_pool_pages_capacity") == 20
    assert v("vllm:hisparse_requests_waiting", reason="host_pool") == 2
    assert v("vllm:hisparse_requests_waiting", reason="quest_rows") == 1
    assert v("vllm:hisparse_policy_info", policy="lru") == 1             # the default
    assert v("vllm:hisparse_prefix_slots_donated") == 12
    assert v("vllm:hisparse_prefix_slots_dropped") == 1


def test_donation_gauges_read_the_ledger_the_manager_counts_in(m):
    """The KV manager counts its donations in the pool's spill ledger, which the scheduler's
    connector reports (none without a host tier)."""
    from vllm_hisparse.vllm.spill_ledger import SpillLedger

    led = SpillLedger()
    assert m.donation_gauges(None) == {}
    assert m.donation_gauges(led) == {"prefix_slots_donated": 0, "prefix_slots_dropped": 0}
    led.donation["donated"] += 3
    led.donation["dropped"] += 1
    assert m.donation_gauges(led) == {"prefix_slots_donated": 3, "prefix_slots_dropped": 1}


def test_policy_info_names_the_configured_policy(m):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Counter, Gauge, Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=None, additional_config={"hisparse": {"policy": "crf"}})
    m.HiSparsePromMetrics(cfg, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    lab = {"model_name": "tiny", "engine": "0"}
    assert reg.get_sample_value("vllm:hisparse_policy_info", dict(lab, policy="crf")) == 1
    assert reg.get_sample_value("vllm:hisparse_policy_info", dict(lab, policy="lru")) is None


def test_device_counters_on_cpu_read_at_once(m):
    t = torch.tensor([3, 4])
    c = m.DeviceCounters(t)
    assert c.read() == [3, 4]
    t += 1
    assert c.read() == [4, 5]


@pytest.mark.cuda
def test_device_counters_on_gpu_lag_without_a_sync(m):
    """A read queues a copy and returns the last one that landed; wait=True reads now."""
    t = torch.tensor([3, 4], device="cuda")
    c = m.DeviceCounters(t)
    assert c.read() == [0, 0]                 # nothing landed yet: the first copy is queued now
    torch.cuda.synchronize()
    t += 1                                    # after the queued copy: not in it
    torch.cuda.synchronize()
    assert c.read() == [3, 4]
    assert c.read(wait=True) == [4, 5]


def test_idle_worker_reads_exactly(m, monkeypatch):
    """With no live request the report waits for the device counters (the engine may go idle
    after this step, and a lagging copy would never be reported)."""
    rt = fake_runtime(hits=2, misses=1, live=())
    rep = m.WorkerReport(rt, 0, 1)
    seen = []
    monkeypatch.setattr(rep.counters, "read", lambda wait=False: seen.append(wait) or [2, 1])
    rep.report()
    rt.reqs["r"] = None
    rep.report()
    assert seen == [True, False]
