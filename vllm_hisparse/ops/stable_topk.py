"""Stable top-k of the DSA indexer's logits, plain torch: the same SET every run.

vLLM 0.26's top-k kernels (``top_k_per_row_prefill`` / ``top_k_per_row_decode``, csrc/sampler.cu;
``persistent_topk`` / ``cooperative_topk``, csrc/topk.cu) find the k-th score with histograms and
place the entries of its bin through shared-memory ``atomicAdd``: with an exact fp32 tie at the
k-th score, WHICH of the tied columns fill the last slots is decided by the threads' arrival order,
so the selected set can change from run to run (ties are ~1.5e-4 per row at 12K candidates with
fp8 q/k). Here the order is total: score descending, then column ascending, so a tie at the
boundary always keeps the lowest columns.

The key of a column c of a row: the fp32 bits as an order-preserving int (``b >= 0 ? b : b ^
0x7FFFFFFF`` on the int32 view: -0.0 ranks just below +0.0, as in vLLM's kernels, whose bins
keep the two apart), widened to int64, ``(ordered << 32) | (0xFFFFFFFF - c)`` (computed as
``ordered * 2**32 + ...``: the same bits, no shift of a negative int); a column outside
the row's range gets INT64_MIN; ``key.topk(min(K, W))``; a slot whose key is INT64_MIN is -1. No
valid key equals INT64_MIN (that would need a NaN's all-ones bits at column 2**32 - 1).

The entry points have the signatures of the kernels they stand in for (vllm/topk_swap.py installs
them); each writes int32 indices into its output in place, in column order with -1 last (vLLM's
kernels leave theirs unordered): the order ``dsa_sorted`` gives a row, so a stock engine given
these stand-ins (scripts/gpu_dsa.py, mode stock with ``DSA_INDEXER=dsa_stable``) attends the same
rows in the same order as hisparse and resident mode. Work is done in
row chunks of at most ``CHUNK_ELEMS`` logits (a guess: a few int64 temporaries of 128 MB each),
decided by shapes alone: no host sync, fixed shapes, capturable in a CUDA graph. This file is its
own reference (tests/test_stable_topk.py checks it against a per-row sort in Python).
"""
from __future__ import annotations

import torch

CHUNK_ELEMS = 1 << 24
_LOW = 0xFFFFFFFF
_INT64_MIN = torch.iinfo(torch.int64).min


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """(R, W) fp32 -> (R, W) int64, order-preserving (larger float, larger int; -0.0 < +0.0)."""
    b = x.contiguous().view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF).to(torch.int64)


def _rows(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, k: int,
          out: torch.Tensor, relative: bool) -> None:
    """Top ``k`` of each row r of ``logits`` (R, W) fp32 within [starts[r], ends[r]) (R,) int
    into ``out`` (R, k) int32: columns (minus starts[r] where ``relative``), -1 after the row's
    candidates."""
    R, W = logits.shape
    if W == 0 or k == 0:
        out.fill_(-1)
        return
    n = min(k, W)
    step = max(1, CHUNK_ELEMS // W)
    col = torch.arange(W, device=logits.device, dtype=torch.int64)
    tie = _LOW - col                                            # lower column, larger key
    for a in range(0, R, step):
        b = min(R, a + step)
        s = starts[a:b].to(torch.int64)[:, None]
        e = ends[a:b].to(torch.int64)[:, None]
        key = _ordered(logits[a:b].float()) * (1 << 32) + tie   # |ordered| <= 2**31: no overflow
        key = torch.where((col >= s) & (col < e), key, torch.full_like(key, _INT64_MIN))
        top, idx = key.topk(n, dim=1)
        # the set in column order, -1 last (as dsa_sorted orders a row): a stock engine with
        # these stand-ins then sums its sparse attention in the order hisparse and resident do
        idx = torch.where(top == _INT64_MIN, torch.full_like(idx, W), idx).sort(dim=1).values
        if relative:
            idx = idx - s
        idx = torch.where(idx >= W - (s if relative else 0), torch.full_like(idx, -1), idx)
        out[a:b, :n].copy_(idx)
        if n < k:
            out[a:b, n:].fill_(-1)


def stable_topk(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                k: int) -> torch.Tensor:
    """(R, k) int32: per row the top ``k`` columns of ``logits`` (R, W) fp32 within [starts,
    ends) (R,), by (score descending, column ascending), as absolute columns; -1 after them."""
    out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    _rows(logits, starts, ends, k, out, relative=False)
    return out


def top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, raw_topk_indices, num_rows,
                          stride0, stride1, topk_tokens) -> None:
    """``vllm._custom_ops.top_k_per_row_prefill``'s contract (csrc/sampler.cu): row r of
    ``logits`` (num_rows, W) fp32 holds the scores of columns [cu_seqlen_ks[r], cu_seqlen_ke[r])
    (int32 (num_rows,); the rest is not cleaned); ``raw_topk_indices`` (num_rows, topk_tokens)
    int32 gets the top-k columns relative to cu_seqlen_ks[r], -1 after them when the row has
    fewer. The strides are the tensor's own (read from it)."""
    _rows(logits[:num_rows], cu_seqlen_ks[:num_rows], cu_seqlen_ke[:num_rows], topk_tokens,
          raw_topk_indices[:num_rows, :topk_tokens], relative=True)


def _decode_lengths(seq_lens: torch.Tensor, next_n: int, num_rows: int) -> torch.Tensor:
    """Candidates [0, length) of each decode row: seq_lens (B, next_n) (vLLM 0.26's metadata,
    v1/attention/backends/mla/indexer.py: [b, j] is token j's own length) read flat; a 1-D
    (B,) the sequences' lengths, token j of next_n seeing seq_len - next_n + j + 1."""
    if seq_lens.dim() == 2 or next_n == 1:
        return seq_lens.reshape(-1)[:num_rows]
    j = torch.arange(num_rows, device=seq_lens.device) % next_n
    return seq_lens.repeat_interleave(next_n)[:num_rows] - next_n + j + 1


def top_k_per_row_decode(logits, next_n, seq_lens, raw_topk_indices, num_rows, stride0, stride1,
                         topk_tokens) -> None:
    """``vllm._custom_ops.top_k_per_row_decode``'s contract: row r of ``logits`` (num_rows, W)
    fp32 has candidates [0, length_r) (``_decode_lengths``); ``raw_topk_indices`` (num_rows,
    topk_tokens) int32 gets the top-k positions, -1 after them (a padding row of length 0: all
    -1)."""
    n = _decode_lengths(seq_lens, next_n, num_rows)
    _rows(logits[:num_rows], torch.zeros_like(n), n, topk_tokens,
          raw_topk_indices[:num_rows, :topk_tokens], relative=False)


def persistent_topk(logits, lengths, output, workspace, k, max_seq_len) -> None:
    """``torch.ops._C.persistent_topk``'s (and ``cooperative_topk``'s) contract (csrc/topk.cu):
    ``lengths`` int32, 1-D or 2-D, contiguous, one entry per row of ``logits`` (R, W) fp32;
    ``output`` (R, k) int32 gets the top-k of [0, length) per row, -1 after them. ``workspace``
    and ``max_seq_len`` only size the kernel's passes; unused here."""
    n = lengths.reshape(-1)
    _rows(logits, torch.zeros_like(n), n, k, output, relative=False)


cooperative_topk = persistent_topk
