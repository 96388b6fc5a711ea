"""The DSA path's two halves of the KV connector (docs/dsa.md sections 5-6); vllm/connector.py's
``HiSparseConnector`` picks them on an MLA model and only forwards to the half of its role.
Admission is ``core.latent_ledger.LatentLedger``'s (scheduler), the pool
``core.latent_runtime.LatentRuntime``'s (worker, allocated by the MLA impls with the process's
worker object: vllm/mla_worker.py, vllm/worker.py).

``LatentConnectorScheduler`` (scheduler process, role SCHEDULER):
  * admission: ``get_num_new_matched_tokens`` checks that a row set, a prefill region (a free
    one, or the one lent longest ago) and host rows for prompt + max_tokens (+ ngram drafts) are
    there, else the request waits (``None``); ``update_state_after_alloc`` (vLLM allocated its
    blocks and schedules it) takes them, demoting a lent region only then; a request asked again
    (preempted) gives everything back and is admitted again: it recomputes its tokens in a
    region, its row set starts empty;
  * ``build_connector_meta``: the ledger's events since the last step, in order, and each new or
    resumed request's first GPU block (its identity in the batch); then the requests whose prefill
    this step completes give their region back (``prompt_done``, shipped with the next step, after
    this one is planned), or with ``resident_first`` keep it lent, decoding from it, until an
    admission needs it (the ledger's ``demote`` event, shipped before that admission's);
  * finish: everything back at once (``request_finished`` -> False: vLLM's blocks hold only the
    stub and the indexer K, which the worker never touches after the request's last step).
``LatentConnectorWorker`` (worker process, role WORKER): applies the events, binds first blocks,
and plans the step the MLA builder noted in ``start_load_kv`` (before vLLM runs or replays the
step's graph).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from vllm_hisparse.core.deployment import Deployment
from vllm_hisparse.core.latent_ledger import LatentLedger

from . import worker
from .compat import KVConnectorMetadata, init_logger

logger = init_logger(__name__)
STATS_ENV = "HISPARSE_STATS_FILE"      # worker writes its hit/miss counts there at each finish


@dataclass
class HiSparseMLAConnectorMetadata(KVConnectorMetadata):
    events: list = field(default_factory=list)          # LatentLedger events, in order
    bind: dict[str, int] = field(default_factory=dict)  # req -> first GPU block (new, resumed)


def admission_of(request, max_model_len: int, spec_tokens: int = 0) -> tuple[int, int]:
    """(prompt_len, tokens past the prompt) a request is admitted with: max_tokens plus
    speculative decoding's spec_tokens drafts (a step writes them, and vLLM bounds drafts by
    max_model_len only), its positions clipped to max_model_len (a request without max_tokens
    may run to max_model_len)."""
    prompt = request.num_prompt_tokens
    max_tokens = getattr(request, "max_tokens", None) or max_model_len
    return prompt, max(0, min(max_tokens + spec_tokens, max_model_len - prompt))


class LatentConnectorScheduler:
    """Every method runs in the scheduler process."""

    def __init__(self, vllm_config, dep: Deployment):
        self.cfg = dep.cfg
        self.max_model_len = dep.limits.max_model_len
        self.spec_tokens = dep.limits.spec_tokens
        s = dep.latent               # the latent pool's sizes, as the worker's (mla_worker)
        self.ledger = LatentLedger(s.row_sets, s.regions, s.host_rows, self.max_model_len,
                                   s.resident, lend=s.lend)
        self._prefill: dict[str, int] = {}     # req -> tokens its (re)computed prefill covers
        self._waiting: dict[str, str] = {}     # req -> why it waits (logged once)
        logger.info("hisparse dsa: admission of %d requests at once (%s)",
                    s.regions if s.resident else s.row_sets,
                    "resident: a full-length region each" if s.resident else
                    f"{s.regions} prefill regions, {s.host_rows} host rows"
                    + (", a complete prompt decoding in its region until a prompt needs it "
                       "(resident_first)" if s.lend else ""))

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        return None                   # no startup check: a prompt's latent is in the plugin's pool

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        rid = request.request_id
        self.ledger.release(rid)                  # asked again: preempted or not yet scheduled
        prompt, max_tokens = admission_of(request, self.max_model_len, self.spec_tokens)
        why = self.ledger.refusal(rid, prompt, max_tokens)
        if why is not None:
            if self._waiting.get(rid) != why:
                logger.info("hisparse dsa: request %s waits: %s", rid, why)
            self._waiting[rid] = why
            return None, False
        self._waiting.pop(rid, None)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """vLLM allocated the request's blocks and schedules it this step: the admission that
        get_num_new_matched_tokens checked is taken now (a lent region demoted only for a
        request that runs; vLLM asks the connector about no other request in between)."""
        rid = request.request_id
        prompt, max_tokens = admission_of(request, self.max_model_len, self.spec_tokens)
        if not self.ledger.admit(rid, prompt, max_tokens):
            raise RuntimeError(f"hisparse dsa: request {rid} was admissible when vLLM asked, "
                               f"not after it allocated: "
                               f"{self.ledger.refusal(rid, prompt, max_tokens)}")
        self._prefill[rid] = request.num_tokens   # prompt (+ outputs to recompute after preemption)
        return None

    def build_connector_meta(self, scheduler_output) -> HiSparseMLAConnectorMetadata:
        so = scheduler_output
        md = HiSparseMLAConnectorMetadata(events=self.ledger.take_events())
        computed = {}
        for r in so.scheduled_new_reqs:
            md.bind[r.req_id] = r.block_ids[0][0]
            computed[r.req_id] = r.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                md.bind[rid] = cached.new_block_ids[i][0][0]
            computed[rid] = cached.num_computed_tokens[i]
        for rid, done in computed.items():        # after this step: regions of complete prompts
            n = so.num_scheduled_tokens.get(rid, 0)
            if self.ledger.in_prefill(rid) and done + n >= self._prefill.get(rid, 1 << 62):
                self.ledger.prompt_done(rid)      # an event of the next step's metadata
        return md

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self.ledger.release(rid)
        self._prefill.pop(rid, None)
        self._waiting.pop(rid, None)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        return None                   # nothing is reported back: every free is immediate

    def stats(self):
        """No KV-connector stats on the DSA path (vllm/metrics.py is the GQA path's)."""
        return None


class LatentConnectorWorker:
    """Every method runs in the worker process."""

    def __init__(self, vllm_config, dep: Deployment):
        self.worker = worker.find(vllm_config)        # made by the MLA impls
        if self.worker is None:
            raise RuntimeError("hisparse: the DSA KV connector runs without the MLA attention "
                               "backend; start vLLM with --attention-backend hisparse so the "
                               "plugin configures both")
        self.rt = self.worker.runtime
        self._stats_path = os.environ.get(STATS_ENV)

    def register_kv_caches(self, kv_caches) -> None:
        return None                   # vLLM's blocks hold the stub and the indexer K: never read

    def bind_connector_metadata(self, connector_metadata) -> None:
        md = connector_metadata
        for ev in md.events:
            if ev[0] == "release":
                self.worker.rows.unbind(ev[1])
        self.rt.apply(md.events)
        for rid, first_block in md.bind.items():
            self.worker.rows.bind(rid, first_block)

    def start_load_kv(self) -> None:
        self.worker.plan()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None                   # write-through happens in do_kv_cache_update

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]):
        self.worker.forget()          # a batch noted by a run that never reached start_load_kv
        if finished_req_ids and self._stats_path:
            with open(self._stats_path, "w") as f:
                json.dump(self.rt.stats(), f)
        return None, None

    def stats(self):
        """No KV-connector stats on the DSA path (vllm/metrics.py is the GQA path's)."""
        return None
