"""The DSA step plan in fixed-address buffers (docs/dsa.md section 5): what the vLLM adapter's
``do_kv_cache_update`` and ``forward_mqa`` read, so that vLLM's FULL decode CUDA graphs, recorded
once per batch size, replay every later step with that step's plan.

``core/latent_step.plan_arrays`` decides a step on the host in numpy (which pool and host rows each
token writes, which tokens are decode tokens of sparse requests); ``LatentGraphStep.load_arrays``
ships it in ONE pinned, non-blocking H2D copy into the base plan ``_base``, laid out as ``_meta``,
the one int64 tensor whose slices are the buffers (sized once for the largest step:
``max_tokens`` = vLLM's max_num_batched_tokens, ``max_decodes`` = max_num_seqs), then
``ops/latent_plan.materialize`` writes the buffers and the host rows from it in one launch, and the
row sets' slot rows follow on the device (what LatentRuntime.plan runs). A steady decode step
(core/latent_runtime.py ``_steady``) is ``advance``: the base plan materialized one more step on,
no host plan. ``load`` copies a ``LatentStep.plan``'s tensors in instead (the tests' reference:
both fill the same buffers; not advanceable). ``clear`` makes every entry a no-op (what a dummy run
or a graph capture sees) and keeps the base plan. The per-layer work has fixed shapes:

- ``write``: ``ops/latent_write.write_latent_rows`` of the call's T tokens in the pool's row
  format (``LatentPool.row_parts``; -1 rows write nothing): one launch on CUDA, as stock's;
- ``convert``: ``ops/latent_index.convert_rows``: region rows ``region_base + pos`` for the T
  tokens and RESOLVE of the first ``min(max_decodes, T)`` decode entries (the plan puts them
  first; padding entries have ``dec_seq`` 0 and scatter to the spare last row ``T_max``: RESOLVE
  skips them), each token's valid count beside its rows: two launches on CUDA (the first for
  the rows and counts, the second for the misses' copy; stock: one); a step with no decode
  entries (resident mode) is ``region_rows``, one launch.
  Same rows, same order as ``LatentStep.convert`` (tests/test_dsa_graph.py checks it bit for bit).

With ``verify_tokens`` n (speculative decoding: num_speculative_tokens + 1) the decode entries are
verify rows instead: ``max_decodes`` requests of up to n tokens in a ``VerifyRows`` over slices of
``_meta``, each request's tokens resolved as ONE union of width n x top_k (core/latent_spec.py), and
``write`` also refreshes a rewritten position's hot slot (tests/test_dsa_spec.py,
``test_verify_rows_in_graph_buffers_equal_resident``).

Which process: the worker (the connector's ``start_load_kv`` loads the plan; every sparse layer
runs write/convert).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_hisparse.core.latent_admission import LatentAdmission
from vllm_hisparse.core.latent_spec import VerifyRows, group_arrays
from vllm_hisparse.core.latent_step import LatentStep, PlanArrays
from vllm_hisparse.core.staging import HostToDevice
from vllm_hisparse.ops.latent_index import convert_rows, region_rows, valid_counts
from vllm_hisparse.ops.latent_plan import materialize
from vllm_hisparse.ops.latent_write import write_latent_rows
from vllm_hisparse.ops.resolve_given import workspace_shapes


def batch_tokens(query_start_loc, seq_lens) -> tuple[np.ndarray, np.ndarray]:
    """(req_of_token, positions), each (T,) int64, of a vLLM batch: row i's query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` are the last ones of its ``seq_lens[i]`` tokens.
    query_start_loc: (B+1,) int; seq_lens: (B,) int (this step's tokens included)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    n = np.diff(qsl)
    if len(seq) != len(n) or (n < 0).any() or (seq < n).any():
        raise ValueError(f"query_start_loc {qsl.tolist()} and seq_lens {seq.tolist()} must give "
                         f"each row at most seq_len query tokens")
    req = np.repeat(np.arange(len(n), dtype=np.int64), n)
    start = np.repeat(qsl[:-1], n)
    pos = np.repeat(seq - n, n) + np.arange(int(qsl[-1] - qsl[0]), dtype=np.int64) - (start - qsl[0])
    return req, pos


class LatentGraphStep:
    def __init__(self, adm: LatentAdmission, max_tokens: int, max_decodes: int, top_k: int,
                 verify_tokens: int | None = None):
        """adm: the worker's admission (its pool and host pool); max_tokens: the most tokens of a
        step (max_num_batched_tokens); max_decodes: the most decode requests of a step
        (max_num_seqs; none in resident mode); top_k: the indexer's K (index_topk);
        verify_tokens: None = one decode token a request; n = up to n (verify rows)."""
        pool = adm.pool
        dev, i64 = pool.device, torch.int64
        self.adm, self.T, self.K = adm, max_tokens, top_k
        self.verify_tokens = verify_tokens
        sparse = 0 if adm.resident else max_decodes
        V = sparse if verify_tokens is not None else 0          # verify-row requests
        n = verify_tokens or 0
        D = self.D = sparse - V                                 # one-token decode entries
        # every per-step index in one int64 tensor (load_arrays fills it with one H2D copy): the
        # host-row source (row set x width + position), pool row, region base of each token; the
        # one-token decodes' topk row, out row, row set, seq; the verify rows' tok, pos, rows, seq
        sizes = [max_tokens] * 3 + [D] * 4 + [V * n, V * n, V, V]
        self._meta = torch.empty(sum(sizes), dtype=i64, device=dev)
        (self.host_src, self.pool_row, self.region_base, self.dec_gather, self.dec_scatter,
         self.dec_rows, self.dec_seq, v_tok, v_pos, v_rows, v_seq) = self._meta.split(sizes)
        self.verify = (VerifyRows(v_tok.view(V, n), v_pos.view(V, n), v_rows, v_seq,
                                  pool.slot_rows(v_rows.zero_()), max_tokens) if V else None)
        self.host_row = torch.full((max_tokens,), -1, dtype=i64, device=dev)
        self.dec_rows.zero_()
        self.dec_slots = (pool.slot_rows(self.dec_rows) if D else
                          torch.empty(0, pool.B, dtype=torch.int32, device=dev))
        self._h2d = HostToDevice(dev, slots=4)     # one copy a step: 4 pinned buffers suffice
        self.hot = torch.ones(D, dtype=i64, device=dev)
        self.locs = torch.full((D, top_k), -1, dtype=torch.int32, device=dev)
        self.sel = torch.full((D, top_k), -1, dtype=torch.int32, device=dev)
        self.out = torch.full((max_tokens + 1, top_k), -1, dtype=torch.int32, device=dev)
        self.valid = torch.zeros(max_tokens, dtype=torch.int32, device=dev)
        self.work = None
        self._host = [None] * pool.num_layers       # per layer: the host pool as rows (pages, W)
        if not adm.resident:
            if dev.type == "cuda":
                from vllm_hisparse.ops import kernels

                rows, width = ((sparse, verify_tokens * top_k) if self.verify is not None
                               else (D, top_k))
                self.work = tuple(torch.empty(s, dtype=torch.int32, device=dev)
                                  for s in workspace_shapes(rows, width, pool.B))
            for layer in range(pool.num_layers):
                h = adm.host.data[layer]
                rows = h.view(h.shape[0], -1)
                if dev.type == "cuda":
                    rows = kernels.device_alias(rows, dev)       # the pinned pool seen over UVA
                self._host[layer] = rows
        self._blank_fields()
        self.planned = 0                 # decode entries of the loaded plan (host int)
        self._blank_dev = self._meta.clone()                   # the cleared values
        self._blank = self._meta.cpu().numpy().copy()          # ... and host side
        # the plan last shipped from the host (load_arrays), which advance() moves on
        self._base = self._meta.clone()
        self._base_planned = 0
        self._advanceable = False        # the base plan came from load_arrays
        self.delta = 0                   # decode steps since the base plan

    # ---- per step (host) ------------------------------------------------------------------------
    def clear(self) -> None:
        """Every entry a no-op: writes nothing, reads nothing (-1 rows). Two launches (the blank
        buffer copied in); the base plan stays for ``advance``."""
        self.planned = 0
        self.host_row.fill_(-1)
        self._meta.copy_(self._blank_dev)

    def _blank_fields(self) -> None:
        """The cleared values, field by field (once: ``clear`` copies them in)."""
        self.host_src.fill_(-1)
        self.pool_row.fill_(-1)
        self.region_base.fill_(-1)
        if self.D:
            self.dec_seq.zero_()
            self.dec_gather.zero_()
            self.dec_scatter.fill_(self.T)
        if self.verify is not None:
            self.verify.clear()

    def advance(self) -> None:
        """The base plan one decode step further on (every live position + 1; the runtime
        checks that the step is steady: core/latent_runtime.py): one launch, no host copy."""
        if not self._advanceable:
            raise RuntimeError("advance() needs a base plan shipped by load_arrays (load() "
                               "fills the buffers only)")
        self.delta += 1
        self._materialize()
        self.planned = self._base_planned

    def _materialize(self) -> None:
        table = None if self.adm.resident else self.adm.pool.host_rows.table
        materialize(self._base, self._meta, self.host_row, table, self.delta, self.T, self.D)

    def load_arrays(self, a: PlanArrays) -> None:
        """Load a step planned on the host (``latent_step.plan_arrays``): its indices into the
        base plan with ONE host->device copy (pinned, not waiting for the GPU: core/staging.py),
        then on the device the buffers and host rows from it (``ops/latent_plan.materialize``)
        and the row sets' slot rows. The same buffers as
        ``load(LatentStep.plan(...))`` (tests/test_dsa_graph.py)."""
        n, d, g = len(a.pos), len(a.dec), len(a.groups)
        if (g and self.verify is None) or (d and self.verify is not None):
            raise ValueError(f"a step planned {'with' if g else 'without'} verify rows loaded "
                             f"into buffers of verify_tokens={self.verify_tokens}")
        cap = self.D if self.verify is None else self.verify.rows.numel()
        if n > self.T or max(d, g) > cap:
            raise ValueError(f"a step of {n} tokens / {max(d, g)} decode tokens exceeds the "
                             f"buffers' {self.T} / {cap} (max_num_batched_tokens / max_num_seqs)")
        marked = a.rbase == -2
        if int(marked.sum()) != d or (d and not marked[np.asarray(a.dec)].all()):
            raise ValueError("a plan's decode tokens must be exactly its region_base -2 tokens "
                             "(convert_rows leaves those rows to their decode entries)")
        m = self._blank.copy()
        T, D = self.T, self.D
        W = self.adm.pool.host_rows.table.shape[1] if not self.adm.resident else 0
        live = a.rset >= 0
        m[:n] = np.where(live, a.rset * W + a.pos, -1) if W else -1
        m[T:T + n] = np.where(a.rbase >= 0, a.rbase + a.pos, -1)
        m[2 * T:2 * T + n] = a.rbase
        o = 3 * T
        if d:
            dec = np.asarray(a.dec, dtype=np.int64)
            m[o:o + d], m[o + D:o + D + d] = dec, dec
            m[o + 2 * D:o + 2 * D + d] = a.rset[dec]
            m[o + 3 * D:o + 3 * D + d] = a.pos[dec] + 1
        if g:
            V, k = self.verify.tok.shape
            o += 4 * D
            tok, pos, rows, seq = group_arrays(a.groups, k, T)
            m[o:o + V * k].reshape(V, k)[:g] = tok
            m[o + V * k:o + 2 * V * k].reshape(V, k)[:g] = pos
            m[o + 2 * V * k:o + 2 * V * k + g] = rows
            m[o + 2 * V * k + V:o + 2 * V * k + V + g] = seq
        self._h2d(m, out=self._base)
        self.delta, self._advanceable = 0, True
        self._materialize()              # the buffers and the host rows, one launch
        self.planned = self._base_planned = d
        pool = self.adm.pool
        if D:
            self.dec_slots.copy_(pool.slot_rows(self.dec_rows))
        if self.verify is not None:
            self.verify.slots.copy_(pool.slot_rows(self.verify.rows))

    def load(self, step: LatentStep) -> None:
        """Copy a planned step into the buffers (the rest cleared)."""
        n, d = step.host_row.shape[0], step.dec_tok.shape[0]
        if (step.verify is not None and self.verify is None) or (d and self.verify is not None):
            raise ValueError(f"a step planned {'with' if d == 0 else 'without'} verify rows "
                             f"loaded into buffers of verify_tokens={self.verify_tokens}")
        if n > self.T or d > self.D:
            raise ValueError(f"a step of {n} tokens / {d} decode tokens exceeds the buffers' "
                             f"{self.T} / {self.D} (max_num_batched_tokens / max_num_seqs)")
        self.clear()
        self.planned = d
        if self.verify is not None:
            self.verify.load(step.verify)
        self.host_row[:n].copy_(step.host_row)
        self.pool_row[:n].copy_(step.pool_row)
        self.region_base[:n].copy_(step.region_base)
        if d:
            self.dec_gather[:d].copy_(step.dec_tok)
            self.dec_scatter[:d].copy_(step.dec_tok)
            self.dec_rows[:d].copy_(step.dec_rows)
            self.dec_seq[:d].copy_(step.dec_seq)
            self.dec_slots[:d].copy_(step.dec_slots)
        self._base.copy_(self._meta)
        self._base_planned, self.delta = d, 0
        self._advanceable = False        # no host sources in a LatentStep: not advanceable

    def decode_tokens(self) -> torch.Tensor:
        """(E,) int64 the step's tokens resolved through the row sets (one-token decodes or verify
        rows), padding entries >= any call's T (fixed buffers: core/latent_shadow.py's check)."""
        if self.verify is not None:
            return self.verify.tok.reshape(-1)
        return self.dec_scatter

    # ---- per layer (device, fixed shapes) ---------------------------------------------------------
    def write(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """The call's T new latent rows (kv_c (T, L), k_pe (T, Rd); T may include vLLM's padding)
        into the host pool and the regions, as planned (one launch on CUDA)."""
        T = kv_c.shape[0]
        if T > self.T:
            raise ValueError(f"{T} tokens exceed the plan's {self.T} (max_num_batched_tokens)")
        host = self._host[layer]
        pool_row = self.pool_row[:T]
        if self.verify is not None:    # a rewritten (rejected draft's) position: its hot slot too
            pool_row = self.verify.write_rows(self.adm.pool.states[layer], pool_row)
        pool = self.adm.pool
        write_latent_rows(*pool.row_parts(kv_c, k_pe), host, self.host_row[:T], pool.rows[layer],
                          pool_row)

    def convert(self, layer: int, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out (T, K) int32 pool rows, -1 = none; valid (T,) int32 counts) of ``layer`` for topk
        (T, K) int32 logical positions (vLLM's topk_indices_buffer[:T]); views of fixed buffers."""
        T, K = topk.shape
        if T > self.T or K != self.K or topk.dtype != torch.int32:
            raise ValueError(f"topk {tuple(topk.shape)} {topk.dtype} must be (<= {self.T}, "
                             f"{self.K}) int32")
        pool = self.adm.pool
        out, valid = self.out[:T], self.valid[:T]
        if T == 0:
            return out, valid
        if self.D:
            # decode entries sit first and are tokens of this call: at most T of them, so the
            # launches cover min(D, T) entries (a graph of batch size T: T rows, not max_num_seqs)
            n = min(self.D, T)
            if self.planned > n:     # eager and piecewise calls only (a replay runs no Python)
                raise ValueError(f"a call of {T} tokens for a plan of {self.planned} decode "
                                 f"tokens: each decode token is one of the call's tokens")
            convert_rows(topk, self.region_base[:T], pool.max_model_len, self.dec_gather[:n],
                         self.dec_scatter[:n], self.dec_seq[:n], self.dec_slots[:n],
                         self.hot[:n], self.dec_rows[:n], pool.states[layer],
                         pool.host_rows.fetch, self._host[layer], pool.rows[layer],
                         pool.counts, self.sel[:n], self.locs[:n], self.out, valid,
                         None if self.work is None else tuple(w[:n] for w in self.work))
            return out, valid
        region_rows(topk, self.region_base[:T], pool.max_model_len, out, valid)
        if self.verify is not None:
            self.verify.convert(topk, pool.max_model_len, pool.states[layer],
                                pool.host_rows.fetch, self._host[layer], pool.rows[layer],
                                pool.counts, out, self.work)
            valid_counts(out, valid)
        return out, valid
