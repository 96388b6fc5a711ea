"""The worker's DSA runtime (docs/dsa.md sections 2-7): the latent pool, the host pool, the
admission that the scheduler's ledger drives (``core/latent_ledger.py`` events) and the step plan
in fixed-address buffers (``core/latent_graph.py``), behind the three calls the vLLM adapter makes:

- per step (the KV connector, host): ``apply(events)`` then ``plan(keys, query_start_loc,
  seq_lens)`` (or ``clear()`` for a batch of no live request);
- per layer (the attention impl, device, no host work): ``write(layer, kv_c, k_pe)`` from
  ``do_kv_cache_update`` and ``convert(layer, topk)`` from ``forward_mqa``, whose pool rows and
  valid counts go to FA3 with ``kv = pool.rows[layer]``.

hisparse mode: ``host_pages > 0``; resident mode (the exactness reference, section 7):
``host_pages = 0``, every request in a full-length region for its life.
Which process: the worker. vLLM-free (tests/test_dsa_runtime.py drives it with vLLM's batch
shapes on the CPU).
"""
from __future__ import annotations

import time

import torch

from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.latent_admission import LatentAdmission
from vllm_hisparse.core.latent_graph import LatentGraphStep, batch_tokens
from vllm_hisparse.core.latent_pool import LatentPool
from vllm_hisparse.core.latent_shadow import compare_rows, shadow_on
from vllm_hisparse.core.latent_step import plan_arrays
from vllm_hisparse.core.steady_step import steady_plan_on


def host_pages_for(host_pool_bytes: int, num_layers: int, row_bytes: int) -> int:
    """Latent rows (one token of every layer) the host pool holds: what the scheduler's ledger
    counts and the worker's pool allocates."""
    return host_pool_bytes // (row_bytes * num_layers)


class LatentRuntime:
    def __init__(self, num_layers: int, max_model_len: int, buffer: int, row_sets: int,
                 regions: int, host_pages: int, max_tokens: int, max_decodes: int, top_k: int,
                 row: int = 576, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 pin: bool | None = None, policy: str = "lru", verify_tokens: int | None = None,
                 lend: bool = False):
        """num_layers: sparse MLA layers; buffer: B hot slots a row set; row_sets: N sparse
        requests at once; regions: prefill_slots (hisparse) or N (resident); host_pages: latent
        rows of the host pool (0 = resident mode); max_tokens / max_decodes: a step's most tokens
        (max_num_batched_tokens) / decode tokens (max_num_seqs); top_k: the indexer's K; row:
        kv_lora_rank + qk_rope_head_dim; pin: pin the host pool (None: when CUDA is up); policy:
        the hot slots' replacement policy (config ``policy``: lru or crf); verify_tokens:
        speculative decoding's num_speculative_tokens + 1 (None: one decode token a request;
        core/latent_spec.py); lend: a complete prompt keeps its region until an admission needs
        it (the config's resident_first; core/latent_ledger.py)."""
        self.resident = host_pages == 0
        self.pool = LatentPool(num_layers, max_model_len, buffer, 0 if self.resident else row_sets,
                               regions, row, dtype, device, policy)
        self.host = None if self.resident else HostKVPool(num_layers, host_pages, 1, 1, row // 2,
                                                          dtype, pin=pin)
        self.adm = LatentAdmission(self.pool, self.host, lend)
        self.verify_tokens = verify_tokens
        self.graph = LatentGraphStep(self.adm, max_tokens, max_decodes, top_k, verify_tokens)
        # the in-engine exactness check (core/latent_shadow.py; test-only): a resident twin
        self.shadow = None
        if not self.resident and shadow_on():
            self.shadow = LatentRuntime(num_layers, max_model_len, buffer, row_sets, row_sets, 0,
                                        max_tokens, max_decodes, top_k, row, dtype, device, pin,
                                        policy, verify_tokens)
            self.shadow_counts = torch.zeros(2, dtype=torch.int64, device=self.pool.device)
        self.steps = 0
        self.steady_plans = 0       # steps planned by advancing the last plan (no host plan)
        self.advance_on = steady_plan_on()      # HISPARSE_STEADY_PLAN=0: every step in full
        self._last = None           # what a steady next step must match (_steady_state)
        self._host_s = {"apply": 0.0, "plan": 0.0}   # host seconds (bench.step_profile reads them)
        self.max_live = 0           # most requests held at once (admitted, not yet released)

    def use_packer(self, packer) -> None:
        """fp8_ds_mla: what packs a step's [kv_c, k_pe] into rows (the adapter's, vLLM's kernel),
        for the pool and its twin alike."""
        self.pool.packer = packer
        if self.shadow is not None:
            self.shadow.pool.packer = packer

    # ---- per step (host) ------------------------------------------------------------------------
    def apply(self, events) -> None:
        """Replay the scheduler's decisions in order (LatentLedger events)."""
        t0 = time.perf_counter()
        self._apply(events)
        self._host_s["apply"] += time.perf_counter() - t0
        if self.shadow is not None:
            self.shadow.apply(events)

    def _apply(self, events) -> None:
        if events:
            self._last = None            # admissions change the plan: the next one is full
        for ev in events:
            kind, key = ev[0], ev[1]
            if kind == "admit":
                if self.adm.admit(key, ev[2], ev[3]) is None:
                    raise RuntimeError(f"hisparse: the worker's latent pool cannot admit {key!r} "
                                       f"that the scheduler admitted: "
                                       f"{self.adm.refusal(key, ev[2], ev[3])}")
            elif kind == "prompt_done":
                self.adm.prompt_done(key)
            elif kind == "demote":
                self.adm.demote(key)
            elif kind == "release":
                self.adm.release(key)
            else:
                raise ValueError(f"unknown latent event {ev!r}")
            self.max_live = max(self.max_live, len(self.adm.grants))

    def plan(self, keys: list, query_start_loc, seq_lens) -> None:
        """Load the step's plan. keys: (B,) each batch row's request key, None = a padding row (no
        query tokens); query_start_loc: (B+1,) int; seq_lens: (B,) int (this step's tokens
        included): vLLM's CommonAttentionMetadata, host copies."""
        t0 = time.perf_counter()
        if self._steady(keys, query_start_loc, seq_lens):
            self.graph.advance()
            self.steady_plans += 1
        else:
            req, pos = batch_tokens(query_start_loc, seq_lens)
            self.graph.load_arrays(plan_arrays(self.adm, keys, req, pos, self.verify_tokens))
            self._last = (self._steady_state(keys, query_start_loc, seq_lens)
                          if self.advance_on else None)
        self.steps += 1
        self._host_s["plan"] += time.perf_counter() - t0
        if self.shadow is not None:
            self.shadow.plan(keys, query_start_loc, seq_lens)

    def _steady_state(self, keys: list, query_start_loc, seq_lens):
        """What the next step must match to be this one a token further on (``_steady``): the
        keys, the query layout, the sequence lengths and each row's last admitted length; None
        when a step like this cannot advance (a row of several tokens, verify rows)."""
        qsl, seq = list(query_start_loc), list(seq_lens)
        if self.verify_tokens is not None or any(b - a > 1 for a, b in zip(qsl, qsl[1:])):
            return None
        tokens = [self.adm.grant(k).tokens if k is not None and qsl[i + 1] > qsl[i] else None
                  for i, k in enumerate(keys)]
        return [list(keys), qsl, seq, tokens]

    def _steady(self, keys: list, query_start_loc, seq_lens) -> bool:
        """A decode step of the same requests in the same rows as the last plan, each one token
        further on, with no event since (``apply`` forgets the last plan), whose positions stay
        within their admitted lengths: the last plan advanced (LatentGraphStep.advance) is this
        step's plan, as plan_arrays would make it (tests/test_dsa_steady_plan.py)."""
        last = self._last
        if last is None or self.graph.delta + 1 >= self.pool.max_model_len:
            return False
        k0, qsl0, seq0, tokens = last
        if list(keys) != k0 or list(query_start_loc) != qsl0:
            return False
        seq = list(seq_lens)
        if len(seq) != len(seq0):
            return False
        for s, s0, lim in zip(seq, seq0, tokens):
            if lim is None:
                if s != s0:
                    return False
            elif s != s0 + 1 or s > lim:
                return False
        last[2] = seq
        return True

    def clear(self) -> None:
        """This batch belongs to no live request (a dummy run, a graph capture): a no-op plan."""
        self.graph.clear()
        if self.shadow is not None:
            self.shadow.clear()

    # ---- per layer (device) ---------------------------------------------------------------------
    def write(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """do_kv_cache_update: kv_c (T, L), k_pe (T, Rd) or (T, 1, Rd) (vLLM's), T >= the plan's
        tokens (vLLM's padding after them writes nothing)."""
        if k_pe.dim() == 3:
            k_pe = k_pe.squeeze(1)
        self.graph.write(layer, kv_c, k_pe)
        if self.shadow is not None:
            self.shadow.write(layer, kv_c, k_pe)

    def convert(self, layer: int, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_mqa's index conversion: (rows (T, K) int32 of pool.rows[layer], -1 = none;
        valid (T,) int32) for vLLM's topk_indices_buffer[:T] (T, K) int32."""
        out, valid = self.graph.convert(layer, topk)
        if self.shadow is not None:
            ref, _ = self.shadow.convert(layer, topk)
            compare_rows(self.shadow_counts, self.graph.decode_tokens(), out,
                         self.pool.rows[layer], ref, self.shadow.pool.rows[layer])
        return out, valid

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Hits and misses of RESOLVE (all layers, all steps; a device read: call it off the hot
        path), requests held (now and at most at once), and the bytes of the GPU and host pools."""
        hits, misses = (int(x) for x in self.pool.counts.tolist())
        host = self.host
        return {"hits": hits, "misses": misses, "steps": self.steps,
                "steady_plans": self.steady_plans, "policy": self.pool.policy,
                "host_ms_plan": (self._host_s["apply"] + self._host_s["plan"]) * 1e3,
                "live_requests": len(self.adm.grants), "max_live_requests": self.max_live,
                "regions_lent": len(self.adm.ledger.lent),
                "demotions": self.adm.ledger.demotions,
                "gpu_pool_bytes": self.pool.nbytes,
                "host_pool_bytes": 0 if host is None else host.data.numel()
                * host.data.element_size(),
                "host_pages_used": 0 if host is None else host.used_pages,
                "resident": self.resident,
                **({} if self.shadow is None else dict(zip(
                    ("shadow_tokens", "shadow_mismatch"), self.shadow_counts.tolist())))}
