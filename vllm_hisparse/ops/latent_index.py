"""The DSA read path's index conversion (docs/dsa.md section 4): what replaces vLLM 0.26's
``triton_convert_req_index_to_global_index`` in ``forward_mqa``. Each query token's top-k logical
positions become latent-pool rows, in the selection's order (FA3 sums in that order):

- tokens of requests holding a region (prefill; resident mode): ``region_base + pos``, -1 kept,
  ``pos >= region_len`` -> -1 (stock's out-of-range rule, its block table being max_model_len
  long);
- decode tokens of sparse requests: RESOLVE of the given selection (``ops/resolve_given.py``:
  hits through the row set's token -> slot table, misses take the victims of the pool's
  replacement policy (lru or crf) and are copied from the host pool), -1 kept;
- padding tokens (no region, not decoding): all -1.

Plain torch around resolve_given (which has its Triton kernel on CUDA); the index arrays come
planned once per step (core/latent_step.py), so nothing here reads the host. The fixed-buffer path
(core/latent_graph.py) runs ``convert_rows``: plain torch here (region rows, RESOLVE, the decode
rows copied in, the counts: the reference; ``pool_indices``, the eager step's, always runs these
pieces in torch), two launches on CUDA (ops/triton_latent_index.py: one for the region rows,
RESOLVE and the counts, one for the misses' rows), where stock runs one; ``region_rows`` (one
launch) serves a step with no decode entries (resident mode) and speculative decoding's verify
rows, whose counts ``valid_counts`` makes after they are converted.
"""
from __future__ import annotations

import torch

from vllm_hisparse.slots import HotBufferState

from .resolve_given import resolve_given, workspace_shapes


def region_rows(topk: torch.Tensor, base: torch.Tensor, region_len: int, out: torch.Tensor,
                valid: torch.Tensor) -> None:
    """out (T, K) int32 = base[t] + topk[t, j] where base[t] >= 0 (a region token) and
    0 <= topk[t, j] < region_len, else -1; valid (T,) int32 = each row's entries >= 0.
    topk (T, K) int32, base (T,) int64."""
    if topk.is_cuda:
        from . import triton_latent_index as tli
        tli.region_rows(topk, base, region_len, out, valid)
        return
    _region_rows(topk, base, region_len, out)
    _valid_counts(out, valid)


def _region_rows(topk, base, region_len, out) -> None:
    pos = topk.long()
    b = base.long()[:, None]
    ok = (b >= 0) & (pos >= 0) & (pos < region_len)
    out.copy_(torch.where(ok, b + pos, -1).to(out.dtype))


def _decode_selections(topk, gather, region_len, sel, locs) -> None:
    """sel (n, K) int32 = the selections of tokens ``gather`` (n,) int64 (clipped to T - 1: a
    padding entry's), entries >= region_len made -1 (stock's range rule); locs (n, K) = -1."""
    s = topk.index_select(0, gather.clamp(max=topk.shape[0] - 1))
    sel.copy_(torch.where(s < region_len, s, -1))      # out of range -> -1, as stock
    locs.fill_(-1)


def valid_counts(out: torch.Tensor, valid: torch.Tensor) -> None:
    """valid (T,) int32 = entries of out (T, K) that are >= 0 (FA3's seqused_k)."""
    if out.is_cuda:
        from . import triton_latent_index as tli
        tli.valid_counts(out, valid)
        return
    _valid_counts(out, valid)


def _valid_counts(out, valid) -> None:
    valid.copy_((out >= 0).sum(1).to(valid.dtype))


def convert_rows(topk: torch.Tensor, base: torch.Tensor, region_len: int, gather: torch.Tensor,
                 scatter: torch.Tensor, seq: torch.Tensor, slots: torch.Tensor, hot: torch.Tensor,
                 rows: torch.Tensor, state: HotBufferState, host_pt: torch.Tensor,
                 host: torch.Tensor, kv: torch.Tensor, counts: torch.Tensor, sel: torch.Tensor,
                 locs: torch.Tensor, out: torch.Tensor, valid: torch.Tensor,
                 work: tuple | None = None) -> None:
    """One layer's conversion in fixed buffers (core/latent_graph.py): ``out[:T]`` (T, K) int32
    the pool rows of each token's selection and ``valid`` (T,) int32 their counts, for the T
    tokens of topk (T, K) int32 logical positions.

    base (T,) int64: a token's region base (>= 0), -1 (none: padding) or -2 (a decode token of a
    sparse request, resolved by its decode entry); region_len: max_model_len. n decode entries
    (n <= T): gather / scatter (n,) int64 the token each reads / whose out row it fills (a
    padding entry, seq 0: gathers any token, scatters to a spare row of out, >= T), seq (n,)
    int64 context length, slots (n, B) int32 its row set's hot-slot rows, hot (n,) int64 (!= 0),
    rows (n,) int64 its row set; state, host_pt, host, kv, counts: as ops/resolve_given's (the
    layer's slot state, host row of each position, host pool rows, latent pool, [hits, misses]);
    sel, locs (n, K) int32 scratch; work: RESOLVE's workspaces (CUDA). The reference is four
    pieces in order: region rows, RESOLVE of the decode entries' selections, their rows copied in
    (``index_copy_``), the counts. CUDA: two launches (ops/triton_latent_index.py). Each -2 token
    must be the scatter row of exactly one decode entry (core/latent_graph.py checks the plan)."""
    T, K = topk.shape
    n = gather.shape[0]
    if n > T or valid.shape != (T,) or out.shape[1] != K or out.shape[0] < T:
        raise ValueError(f"topk ({T}, {K}) with {n} decode entries (at most T), out "
                         f"{tuple(out.shape)} (>= T rows of K), valid {tuple(valid.shape)} (T,)")
    if topk.is_cuda:
        from . import kernels, triton_latent_index as tli
        host = kernels.device_alias(host, topk.device)
        if work is None:
            work = tuple(torch.empty(s, dtype=torch.int32, device=topk.device)
                         for s in workspace_shapes(n, K, state.slots)) if n else (None, None)
        tli.convert_rows(topk, base, region_len, gather, scatter, seq, slots, hot, rows, state,
                         host_pt, host, kv, counts, sel, locs, out, valid, *work)
        return
    _region_rows(topk, base, region_len, out[:T])
    if n:
        _decode_selections(topk, gather, region_len, sel, locs)
        resolve_given(sel, seq, slots, locs, hot, rows, state, host_pt, host, kv, counts)
        out.index_copy_(0, scatter, locs)
    _valid_counts(out[:T], valid)


def pool_indices(topk: torch.Tensor, region_base: torch.Tensor, region_len: int,
                 dec_tok: torch.Tensor, dec_rows: torch.Tensor, dec_slots: torch.Tensor,
                 dec_seq: torch.Tensor, state: HotBufferState | None,
                 host_rows: torch.Tensor | None, host: torch.Tensor | None, kv: torch.Tensor,
                 counts: torch.Tensor, out: torch.Tensor, valid: torch.Tensor) -> None:
    """out (T, K) int32: the pool row of each selected position; valid (T,) int32: how many of a
    token's out entries are >= 0 (stock's valid counts, FA3's seqused_k).

    topk: (T, K) int32 logical positions, valid first, -1 after (vLLM's topk_indices_buffer);
    region_base: (T,) int64 first pool row of the token's region, < 0 = none (-1 padding, -2 a
    decode token); region_len: rows of a region (max_model_len); dec_tok: (D,) int64 the decode tokens
    of sparse requests (at most one per request), with dec_rows (D,) int64 their row sets,
    dec_slots (D, B) int32 the pool rows of those row sets' hot slots and dec_seq (D,) int64 their
    context lengths (position + 1); state: one layer's RESOLVE state (slots.HotBufferState of N
    rows, B slots, max_model_len units, its policy's), read and written at dec_rows; host_rows:
    (N, max_model_len) int32 host row of each token of each row set; host: (P, W) the layer's
    host pool as rows; kv: (M, W) the layer's latent pool; counts: (2,) int64, += [hits, misses].
    state, host_rows and host may be None when D == 0 (resident mode)."""
    T, K = topk.shape
    if topk.dtype != torch.int32 or out.shape != (T, K) or region_base.shape != (T,):
        raise ValueError(f"topk must be (T, K) int32 with out ({T}, {K}) and region_base ({T},); "
                         f"got {topk.dtype} {tuple(out.shape)} {tuple(region_base.shape)}")
    D = dec_tok.shape[0]
    if dec_rows.shape != (D,) or dec_seq.shape != (D,) or dec_slots.shape[0] != D:
        raise ValueError(f"dec_rows {tuple(dec_rows.shape)}, dec_seq {tuple(dec_seq.shape)} and "
                         f"dec_slots {tuple(dec_slots.shape)} must have one row per decode token "
                         f"({D})")
    _region_rows(topk, region_base, region_len, out)
    if D:
        sel, locs = (torch.empty(D, K, dtype=topk.dtype, device=topk.device) for _ in range(2))
        _decode_selections(topk, dec_tok, region_len, sel, locs)
        resolve_given(sel, dec_seq, dec_slots, locs, torch.ones_like(dec_seq), dec_rows, state,
                      host_rows, host, kv, counts)
        out[dec_tok] = locs.to(out.dtype)
    _valid_counts(out, valid)
