"""The worker half of the GQA path's KV connector (vllm/connector.py forwards to it), in each worker
process (every tensor-parallel rank): holds the process's worker object
(``gqa_worker.HiSparseWorker``, made by the attention impls: vllm/worker.py) as ``self.worker``
and starts its ``SparseRuntime`` (host pool + hot-slot state), which the attention backend
forwards to; registers the scheduler's requests and frees their host pages; plans each FULL
decode step in ``start_load_kv``. Every method runs in the worker process.
"""
from __future__ import annotations

import os

import torch

from vllm_hisparse.core.deployment import Deployment
from vllm_hisparse.core.hostless import host_back

from . import metrics, worker
from .compat import extract_layer_index
from .gqa_worker import HiSparseWorker

STATS_ENV = "HISPARSE_STATS_FILE"      # worker writes hit-rate stats there (the demo reads it)


class ConnectorWorker:
    def __init__(self, vllm_config, dep: Deployment, rank: int):
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        # the impls' worker object; none when no layer made one (a connector built outside an
        # engine: tests), then this connector's own
        self.worker: HiSparseWorker = worker.find(vllm_config) or HiSparseWorker(dep)
        rt = self.worker.start_runtime(mc, pc.tensor_parallel_size)
        self._done: set[str] = set()          # dropped, reported by the next get_finished
        self._dropped = False                 # a request dropped since the last stats
        self._stats_path = os.environ.get(STATS_ENV)
        if self._stats_path and rank > 0:     # one file per rank: rank 0 keeps the name
            self._stats_path = f"{self._stats_path}.rank{rank}"
        self._report = metrics.WorkerReport(rt, rank, dep.page_bytes)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer KV caches (the tensors the attention layers are called with): a
        request turning sparse copies its KV so far from them (core/turn_sparse.py)."""
        rt = self.worker.get_runtime()
        by_layer = {extract_layer_index(name): t for name, t in kv_caches.items()}
        rt.bind_kv_caches([by_layer.get(i) for i in range(rt.num_layers)])

    def bind_connector_metadata(self, connector_metadata) -> None:
        """The scheduler's step metadata (HiSparseConnectorMetadata), before the step's forward:
        drops, spills, host-less requests moved into the host tier (``hosted``), then the new or
        resumed requests and their first blocks (those in ``hostless``: no host copy, every page
        on the GPU, never spilled: core/hostless.py), with the host page ids the scheduler gave
        them (``pages``: the list of their whole life, its shared prefix read-only)."""
        rt = self.worker.get_runtime()
        for rid in connector_metadata.finished:
            self._drop(rt, rid)
        for rid in connector_metadata.freed:
            self._drop(rt, rid, report=False)
        # spills first: a request resumed after a preemption restarts resident (rt.add), as in
        # the KV manager; none is spilled in the step it is (re)scheduled (no processed page)
        for rid, keep in connector_metadata.spilled.items():   # before the step is planned
            if rid in rt.reqs:
                rt.spill(rid, keep)
        pages = connector_metadata.pages       # the scheduler's host page ids (HostPageTable)
        for rid in connector_metadata.hosted:   # host pages and a row now: sparse from this step
            if rid in rt.reqs:
                host_back(rt, rid)
                if rid in pages:
                    rt.assign_host(rid, *pages[rid])
        hostless = set(connector_metadata.hostless)
        for rid, (num_prompt, first_block) in connector_metadata.new.items():
            rt.add(rid, num_prompt, hostless=rid in hostless)
            self.worker.rows.bind(rid, first_block)
            if rid in pages:
                rt.assign_host(rid, *pages[rid])

    def start_load_kv(self) -> None:
        # full_decode_graphs: plan a single-token step now that its requests are bound, before
        # vLLM replays the step's FULL graph (which calls no backend code)
        self.worker.plan()

    def wait_for_save(self) -> None:
        # as the step's forward context exits: its host write-behind joined on the compute stream
        # (core/write_behind.py), before vLLM touches the blocks it frees
        self.worker.get_runtime().end_step()

    def _drop(self, rt, rid: str, report: bool = True) -> None:
        if rt.finish(rid):
            self.worker.rows.unbind(rid)
            self._dropped = True
            if report:
                self._done.add(rid)

    def get_finished(self, finished_req_ids: set[str]):
        # after the step's forward: a plan_full request left by a run that never reached
        # start_load_kv (a dummy run) must not be resolved by a later hook
        self.worker.forget()
        rt = self.worker.get_runtime()
        # finished_req_ids come from the scheduler output whose metadata was bound before this
        # step: its ``freed`` ids were dropped then (unreported), so rt.finish skips them here
        for rid in finished_req_ids:
            self._drop(rt, rid)
        done, self._done = self._done, set()
        if self._dropped:
            rt.dump_stats(self._stats_path)
            self._dropped = False
        return (done or None), None

    def stats(self):
        """This rank's part of vllm/metrics.py (vLLM asks every step)."""
        return self._report.report()
