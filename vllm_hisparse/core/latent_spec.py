"""Verify rows on the DSA path: a sparse request with several query tokens in one step (vLLM's
verified token + its k drafts, MTP or ngram speculation), each token with its OWN indexer top-k,
all read through the request's ONE row set (docs/dsa.md, "Speculative decoding").

Resolving each token's selection separately into the one row set would race (two batch rows on
one RESOLVE state row pick the same victims) or, one after the other, let a sibling's misses evict
what an earlier token already mapped. So, per request and per layer:

1. **union**: the tokens' selections, each causally masked to its token's position, merged in
   token order with every position kept once (``ops/selection_union.py``);
2. **one RESOLVE** of the union into the row set (``ops/resolve_given.py``, the k = 1 path's
   machinery unchanged): hits keep their slots, victims are chosen among slots that NO token of
   the step selects (RESOLVE never evicts a slot hit by its own selection), misses are fetched from
   the host pool;
3. **each token attends its own top-k**: its rows are the union's pool rows gathered through
   ``first`` (where each of its positions sits in the union), in its selection's order.

Capacity: the union of n = k + 1 tokens holds up to n x top_k positions and is resolved as one
selection of fixed width n x top_k (CUDA graphs: shapes are fixed before the step's indexer runs),
so ``device_buffer_size >= (k + 1) x top_k`` (``check_buffer``). The union's real size is known
only on the GPU, per layer, mid-forward; a smaller buffer could only truncate it (a token
attending without some of its rows: no longer exact) or sync the host.

Newest rows, as the k = 1 path (docs/dsa.md section 2, ``newest = 0``): the step's tokens' rows go
through to the host pool before the layer's attention (``do_kv_cache_update`` precedes
``forward_mqa``) and RESOLVE fetches them as misses. One addition: a rejected draft's position is
written again at a later step (vLLM reschedules from the accepted token), while the row set may
still hold the rejected row in a slot; ``write_rows`` sends each verify token's new row also to
the slot holding its position, if any (write-through to resident slots), so a hit never reads a
stale row. On the k = 1 path a position is written once and is never resident before that.

Which process: the worker (served: planned by ``latent_step.plan_arrays`` into a ``VerifyRows`` over
slices of ``LatentGraphStep``'s fixed buffers, which FULL CUDA graphs replay; the tests' reference:
``LatentStep.plan``'s per-step ``VerifyRows.build``; run per layer by ``write_rows`` / ``convert``). vLLM-free. Served with ngram speculation (vllm/mla_setup.py: the buffer
rule at startup; vllm/mla_connector.py: admission of prompt + max_tokens + k).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_hisparse.ops.resolve_given import resolve_given
from vllm_hisparse.ops.selection_union import selection_union


def buffer_needed(top_k: int, spec_tokens: int) -> int:
    """Hot slots a row set needs for verify rows of spec_tokens drafts + 1: the union's width."""
    return (spec_tokens + 1) * top_k


def check_buffer(device_buffer_size: int, top_k: int, spec_tokens: int) -> None:
    """The one-line refusal when a row set cannot hold the worst-case union."""
    need = buffer_needed(top_k, spec_tokens)
    if device_buffer_size < need:
        raise ValueError(f"device_buffer_size={device_buffer_size} must be >= (num_speculative_"
                         f"tokens + 1) x top_k = ({spec_tokens} + 1) x {top_k} = {need} for DSA "
                         f"speculative decoding; set device_buffer_size={need}")


def _scatter_rows(base: torch.Tensor, tok: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """base (T, ...) with base[tok[e]] = vals[e] for every entry e of tok (flattened), entries
    tok >= T (padding) going to a spare row that is dropped."""
    T = base.shape[0]
    buf = torch.cat([base, base.new_full((1, *base.shape[1:]), -1)])
    buf.index_copy_(0, tok.reshape(-1).clamp(max=T),
                    vals.reshape(tok.numel(), *base.shape[1:]).to(buf.dtype))
    return buf[:-1]


def group_arrays(groups: list[tuple[int, list[int], list[int]]], n: int, pad: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tok (G, n), pos (G, n), rows (G,), seq (G,)) int64 of G requests' verify tokens (groups:
    row set, the tokens' indices in the step, their positions): padding entries tok ``pad``, pos
    -1; seq = the last position + 1. The host half of ``VerifyRows.build`` and of
    ``LatentGraphStep.load_arrays``."""
    tok = np.full((len(groups), n), pad, dtype=np.int64)
    pos = np.full((len(groups), n), -1, dtype=np.int64)
    for d, (_, toks, ps) in enumerate(groups):
        if len(toks) > n:
            raise ValueError(f"{len(toks)} verify tokens exceed the buffers' {n} (num_speculative_"
                             f"tokens + 1)")
        tok[d, :len(toks)], pos[d, :len(ps)] = toks, ps
    rows = np.array([g[0] for g in groups], dtype=np.int64)
    return tok, pos, rows, pos.max(1) + 1


@dataclass
class VerifyRows:
    """The step's decode tokens of sparse requests grouped per request: D requests, n = k + 1
    entries each (device tensors):
    tok (D, n) int64 the token's index in the step, >= T = padding entry (fewer tokens this
    step); pos (D, n) int64 its position, -1 = padding; rows (D,) int64 row sets; seq (D,) int64
    last position + 1, 0 = a padding request (RESOLVE skips it); slots (D, B) int32 pool rows of
    the row sets' hot slots. Built per step (``build``) or over fixed buffers that a FULL CUDA
    graph replays (core/latent_graph.py: ``clear``, and ``load`` for the tests' reference path)."""
    tok: torch.Tensor
    pos: torch.Tensor
    rows: torch.Tensor
    seq: torch.Tensor
    slots: torch.Tensor
    pad: int | None = None      # fixed buffers: the padding entries' token index

    @classmethod
    def build(cls, pool, groups: list[tuple[int, list[int], list[int]]], n: int, T: int
              ) -> "VerifyRows":
        """groups: per request (row set, its tokens' indices in the step, their positions), at
        most n tokens each; T: the step's tokens; pool: the LatentPool."""
        dev = pool.device
        tok, pos, rows, seq = (torch.from_numpy(x).to(dev) for x in group_arrays(groups, n, T))
        slots = (pool.slot_rows(rows) if len(groups) else
                 torch.empty(0, pool.B, dtype=torch.int32, device=dev))
        return cls(tok, pos, rows, seq, slots)

    def clear(self) -> None:
        """Every entry padding (fixed buffers: a dummy run, a capture, a step without verify
        rows)."""
        self.tok.fill_(self.pad)
        self.pos.fill_(-1)
        self.seq.zero_()

    def load(self, step: "VerifyRows | None") -> None:
        """Copy a step's verify rows into these fixed buffers, the rest padding."""
        self.clear()
        if step is None:
            return
        d, n = step.tok.shape
        if d > self.tok.shape[0] or n != self.tok.shape[1]:
            raise ValueError(f"{d} requests of {n} verify tokens exceed the buffers' "
                             f"{self.tok.shape[0]} x {self.tok.shape[1]} (max_num_seqs x "
                             f"num_speculative_tokens + 1)")
        self.tok[:d].copy_(torch.where(step.pos >= 0, step.tok, self.pad))
        self.pos[:d].copy_(step.pos)
        self.rows[:d].copy_(step.rows)
        self.seq[:d].copy_(step.seq)
        self.slots[:d].copy_(step.slots)

    @property
    def width(self) -> int:
        return self.tok.shape[1]

    def write_rows(self, state, pool_row: torch.Tensor) -> torch.Tensor:
        """(T,) int64: pool_row (the plan's region rows, -1 elsewhere) with each verify token's
        row in the hot slot that holds its position now (-1 where none): the write-through that
        refreshes a rejected draft's stale copy. state: the layer's HotBufferState (read only)."""
        p = self.pos.clamp(min=0)
        slot = state.unit_slot[self.rows[:, None], p].long()          # (D, n), -1 = not held
        row = torch.gather(self.slots.long(), 1, slot.clamp(min=0))
        return _scatter_rows(pool_row, self.tok, torch.where((self.pos >= 0) & (slot >= 0), row, -1))

    def convert(self, topk: torch.Tensor, region_len: int, state, host_rows: torch.Tensor,
                host: torch.Tensor, kv: torch.Tensor, counts: torch.Tensor, out: torch.Tensor,
                work: tuple | None = None) -> None:
        """out[tok] (T, K) int32 = each verify token's pool rows, in its selection's order, -1
        kept; other rows of out untouched. topk: (T, K) int32 the step's selections; the rest as
        ops/latent_index.pool_indices (state, host_rows, host, kv, counts: one layer's)."""
        T, K = topk.shape
        D, n = self.tok.shape
        check_buffer(state.slots, K, n - 1)
        if D == 0:
            return
        sel = torch.cat([topk, topk.new_full((1, K), -1)])[self.tok.clamp(max=T)]  # (D, n, K)
        sel = torch.where(sel < region_len, sel, -1)                     # stock's range rule
        union, first = selection_union(sel, self.pos)
        locs = torch.full_like(union, -1)
        resolve_given(union, self.seq, self.slots, locs, torch.ones_like(self.seq), self.rows,
                      state, host_rows, host, kv, counts, work)
        out.copy_(_scatter_rows(out, self.tok, torch.gather(locs, 1, first)))
