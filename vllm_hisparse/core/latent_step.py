"""One step of the DSA path, planned once (docs/dsa.md section 5) and run per layer: which pool
and host rows each of the step's tokens writes (section 3) and how each query token's top-k
positions become pool rows (section 4).

``plan_arrays`` reads the admission (who holds which region / row set) on the host, once per step:
the served path's host half (core/latent_graph.LatentGraphStep.load_arrays ships it).
``LatentStep.plan`` turns the same decisions into index tensors on the pool's device, and its
``write`` / ``convert`` do the per-layer work eagerly: the reference the tests (and
scripts/dsa_plan_cost.py) compare the fixed-buffer path with. A token is one of:

- a **region** token: its request holds a region (prefill in hisparse mode, and decoding while
  its region is lent: core/latent_ledger.py; every token in resident mode): written to
  ``region_base + pos`` (and to the host in hisparse mode), reads ``region_base + topk``;
- a **decode** token of a sparse request (hisparse, prompt complete, no region): written to the host only,
  reads its row set's hot slots through RESOLVE (one such token per request per step; with
  ``verify_tokens`` n, up to n of them, speculative decoding's verify rows, read through ONE
  RESOLVE of the union of their selections: core/latent_spec.py);
- **padding** (request key None): writes nothing, reads nothing (-1).

Which process: the worker (the connector's plan of the step, then every sparse layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_hisparse.core.latent_admission import LatentAdmission
from vllm_hisparse.core.latent_spec import VerifyRows
from vllm_hisparse.ops.latent_index import pool_indices
from vllm_hisparse.ops.latent_write import write_latent_rows


@dataclass
class PlanArrays:
    """A step's plan on the host, before any device tensor (numpy, T tokens): what
    ``LatentStep.plan`` makes its tensors from and ``LatentGraphStep.load_arrays`` ships in one
    copy. pos, rset, rbase (T,) int64: each token's position, row set and region base (-1: none;
    -2: a one-token decode of a sparse request, resolved by its decode entry);
    dec: one-token decode tokens' indices; groups: verify rows (row set, tokens, positions)."""
    pos: np.ndarray
    rset: np.ndarray
    rbase: np.ndarray
    dec: list[int]
    groups: list[tuple[int, list[int], list[int]]]
    verify_tokens: int | None


def plan_arrays(adm: LatentAdmission, keys: list, req_of_token, positions,
                verify_tokens: int | None = None) -> PlanArrays:
    """The host half of ``LatentStep.plan`` (arguments there): the checks and the per-request
    decisions, no device work."""
    pool = adm.pool
    req = np.asarray(req_of_token, dtype=np.int64).reshape(-1)
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if req.shape != pos.shape:
        raise ValueError(f"req_of_token {req.shape} and positions {pos.shape} must have one "
                         f"entry per token")
    if len(req) and (req.max() >= len(keys) or req.min() < -1):
        raise ValueError(f"req_of_token must index keys (0..{len(keys) - 1}) or be -1")
    T = len(req)
    rset = np.full(T, -1, dtype=np.int64)
    rbase = np.full(T, -1, dtype=np.int64)
    dec: list[int] = []
    groups: list[tuple[int, list[int], list[int]]] = []
    seen: set = set()
    if verify_tokens is not None and verify_tokens < 1:
        raise ValueError(f"verify_tokens={verify_tokens} must be None or >= 1 "
                         f"(num_speculative_tokens + 1)")
    for i, key in enumerate(keys):
        if key is None:
            continue
        toks = np.nonzero(req == i)[0]
        if len(toks) == 0:
            continue
        g = adm.grant(key)
        if pos[toks].min() < 0 or pos[toks].max() >= g.tokens:
            raise ValueError(f"request {key!r}: positions must lie in [0, {g.tokens}) "
                             f"(prompt + max_tokens admitted); got {pos[toks].min()}.."
                             f"{pos[toks].max()}")
        rset[toks] = g.row_set
        if g.in_region:
            rbase[toks] = pool.region_base(g.region)
        elif verify_tokens is not None:
            if len(toks) > verify_tokens or key in seen:
                raise ValueError(f"request {key!r} has {len(toks)} decode tokens this step; "
                                 f"at most verify_tokens={verify_tokens} (num_speculative_"
                                 f"tokens + 1)")
            seen.add(key)
            groups.append((g.row_set, toks.tolist(), pos[toks].tolist()))
        else:
            if len(toks) != 1 or key in seen:
                raise ValueError(f"request {key!r} has {len(toks)} decode tokens this step; "
                                 f"a sparse request decodes one token a step (no spec decode)")
            seen.add(key)
            dec.append(int(toks[0]))
            rbase[toks[0]] = -2              # resolved by its decode entry (ops/latent_index)
    return PlanArrays(pos, rset, rbase, dec, groups, verify_tokens)


@dataclass
class LatentStep:
    """Index tensors of one step (on the pool's device), T tokens, D decode tokens:
    host_row, pool_row, region_base (T,) int64 (-1 = none; region_base -2: a decode token);
    dec_tok, dec_rows, dec_seq (D,) int64; dec_slots (D, B) int32; verify: the verify rows (with ``verify_tokens`` and a sparse request
    decoding; None otherwise; then D = 0)."""
    adm: LatentAdmission
    host_row: torch.Tensor
    pool_row: torch.Tensor
    region_base: torch.Tensor
    dec_tok: torch.Tensor
    dec_rows: torch.Tensor
    dec_seq: torch.Tensor
    dec_slots: torch.Tensor
    verify: VerifyRows | None = None

    @classmethod
    def plan(cls, adm: LatentAdmission, keys: list, req_of_token, positions,
             verify_tokens: int | None = None) -> "LatentStep":
        """keys: the step's request keys (None = a padding request); req_of_token: (T,) int index
        into keys of each token (vLLM's req_id_per_token), -1 = padding; positions: (T,) int each
        token's position in its request; verify_tokens: None = one decode token per sparse
        request (today's path); n >= 1 = up to n (num_speculative_tokens + 1), resolved as one
        union per request (core/latent_spec.py)."""
        pool = adm.pool
        a = plan_arrays(adm, keys, req_of_token, positions, verify_tokens)
        pos, rset, rbase, dec, groups, T = a.pos, a.rset, a.rbase, a.dec, a.groups, len(a.pos)
        dev = pool.device
        pos_t = torch.from_numpy(pos).to(dev)
        rset_t, rbase_t = torch.from_numpy(rset).to(dev), torch.from_numpy(rbase).to(dev)
        if adm.resident:
            host_row = torch.full((T,), -1, dtype=torch.int64, device=dev)
        else:
            table = pool.host_rows.table
            host_row = torch.where(rset_t >= 0, table[rset_t.clamp(min=0), pos_t.clamp(min=0)]
                                   .long(), -1)
        pool_row = torch.where(rbase_t >= 0, rbase_t + pos_t, -1)
        dec_t = torch.tensor(dec, dtype=torch.int64, device=dev)
        dec_rows = rset_t[dec_t]
        return cls(adm, host_row, pool_row, rbase_t, dec_t, dec_rows, pos_t[dec_t] + 1,
                   pool.slot_rows(dec_rows) if len(dec) else
                   torch.empty(0, pool.B, dtype=torch.int32, device=dev),
                   VerifyRows.build(pool, groups, verify_tokens, T) if groups else None)

    # ---- per layer ------------------------------------------------------------------------------
    def _host(self, layer: int) -> torch.Tensor | None:
        """The layer's host pool as rows (pages, W); None in resident mode."""
        if self.adm.resident:
            return None
        h = self.adm.host.data[layer]
        return h.view(h.shape[0], -1)

    def write(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """The step's new latent rows of ``layer`` (kv_c (T, L), k_pe (T, Rd), token order of
        the plan), in the pool's row format (``LatentPool.row_parts``): host pool and regions
        (ops/latent_write.write_latent_rows); verify tokens also
        to the hot slot holding their position (VerifyRows.write_rows)."""
        pool_row = self.pool_row
        if self.verify is not None:
            pool_row = self.verify.write_rows(self.adm.pool.states[layer], pool_row)
        pool = self.adm.pool
        write_latent_rows(*pool.row_parts(kv_c, k_pe), self._host(layer), self.host_row,
                          pool.rows[layer], pool_row)

    def convert(self, layer: int, topk: torch.Tensor, out: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out (T, K) int32 pool rows, -1 = none; valid (T,) int32 counts) of ``layer`` for the
        step's topk (T, K) int32 logical positions (ops/latent_index.pool_indices); RESOLVE's
        hits and misses are added to the pool's counts."""
        pool = self.adm.pool
        T, K = topk.shape
        out = torch.empty(T, K, dtype=torch.int32, device=topk.device) if out is None else out
        valid = torch.empty(T, dtype=torch.int32, device=topk.device) if valid is None else valid
        host = self._host(layer)
        pool_indices(topk, self.region_base, pool.max_model_len, self.dec_tok, self.dec_rows,
                     self.dec_slots, self.dec_seq,
                     pool.states[layer] if pool.states else None,
                     None if host is None else pool.host_rows.fetch, host,
                     pool.rows[layer], pool.counts, out, valid)
        if self.verify is not None:
            self.verify.convert(topk, pool.max_model_len, pool.states[layer],
                                pool.host_rows.fetch, host,
                                pool.rows[layer], pool.counts, out)
            valid.copy_((out >= 0).sum(1).to(valid.dtype))
        return out, valid
