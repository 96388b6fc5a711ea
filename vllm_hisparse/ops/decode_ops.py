"""The decode batch's fused ops on CUDA tensors, the plain-torch references otherwise.

``decode_write`` (the new token into the cache, a second pool and the Quest bounds: one Triton
launch), ``decode_write_score`` (that and the Quest page scores in one launch) and
``select_resolve`` (top-k pages + RESOLVE: one launch of the CUDA kernel, or of the Triton one;
then, unless the attention's splits copy the misses in themselves, one launch of the miss
copies), contracts in ``reference.decode_write``, ``reference.quest_scores`` and
``reference.select_resolve``. All are allocation-free on CUDA when the caller passes every output
and workspace (the decode body does), so they can be recorded into a CUDA graph.
"""
from __future__ import annotations

import os

import torch

from vllm_hisparse.knobs import env_flag

from . import kernels, reference


# Which select_resolve kernel runs on CUDA: "cuda" (csrc/select_resolve.cu, when the extension is
# built) or "triton" (ops/triton_select.py). Both give the same bits (tests/test_decode_ops.py runs
# each against the reference); the knob is for A/B runs (bench.decode_step --select-impl, env
# HISPARSE_SELECT_IMPL).
SELECT_IMPL = os.environ.get("HISPARSE_SELECT_IMPL", "cuda")
SELECT_THREADS = 512     # threads of the CUDA select's CTA (256, 512 or 1024)
# Where the decode body's misses are copied in: "1" (default) in the attention's split launch,
# each split copying its missed pages from the pinned pool into their blocks before its loop (one
# launch fewer, a split's copies beside the other splits' attention); "0" in select_resolve's
# miss-copy launch before it. The same bits either way (tests/test_decode_attention.py,
# tests/test_decode_body_gpu.py); the knob is for A/B runs (env HISPARSE_FETCH_IN_ATTENTION).
FETCH_IN_ATTENTION = env_flag("HISPARSE_FETCH_IN_ATTENTION", True,
                              on="misses copied in by the attention's split launch",
                              off="by select_resolve's miss-copy launch")


def _check_write(kv, k, v, kmin, kmax) -> None:
    assert kv.is_contiguous() and k.stride(2) == 1 and v.stride(2) == 1
    assert k.shape[1] == 1 or k.stride(1) == k.shape[2], "k's (Hkv, D) block must be contiguous"
    if kmin is not None:
        assert kmin.stride(0) == kmin.shape[1] * kmin.stride(1) and kmin.stride() == kmax.stride()


def decode_write(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                 seq: torch.Tensor, newest: torch.Tensor, dst: torch.Tensor | None = None,
                 dst_page: torch.Tensor | None = None, kmin: torch.Tensor | None = None,
                 kmax: torch.Tensor | None = None, q_page: torch.Tensor | None = None) -> None:
    """reference.decode_write (shapes there); one Triton launch on CUDA. k/v rows may be strided
    (views of a fused qkv output) with each (Hkv, D) block contiguous."""
    if not k.is_cuda:
        reference.decode_write(kv, k, v, block_table, seq, newest, dst, dst_page, kmin, kmax,
                               q_page)
        return
    from . import triton_decode_write
    _check_write(kv, k, v, kmin, kmax)
    triton_decode_write.decode_write(kv, k, v, block_table, seq, newest,
                                     kernels.device_alias(dst, kv.device), dst_page, kmin, kmax,
                                     q_page)


def decode_write_score(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       block_table: torch.Tensor, seq: torch.Tensor, newest: torch.Tensor,
                       dst: torch.Tensor | None, dst_page: torch.Tensor | None,
                       kmin: torch.Tensor, kmax: torch.Tensor, q_page: torch.Tensor,
                       q: torch.Tensor, rows: torch.Tensor, num_units: torch.Tensor,
                       out: torch.Tensor) -> None:
    """decode_write(kv, ..., kmin, kmax, q_page) and then Quest's page scores
    quest_scores_rows(q, kmin, kmax, rows, num_units, out, live_only=True), in one Triton launch
    on CUDA (ops/triton_write_score.py). num_units[r]: row r's complete pages, at most the page of
    its new token ((seq - 1) // page: the scores never read the page the write folds into). Two
    rows whose tokens fold into Quest rows must not share one (rows[r] differ where q_page >= 0,
    as the decode batch gives them): one row's scores would race another's write."""
    from .quest import check, quest_scores_rows
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but k has {k.shape[0]}: one query per new token")
    if not k.is_cuda:
        reference.decode_write(kv, k, v, block_table, seq, newest, dst, dst_page, kmin, kmax,
                               q_page)
        quest_scores_rows(q, kmin, kmax, rows, num_units, out, live_only=True)
        return
    check(q, kmin, kmax, rows, num_units, out)
    if not (rows.is_contiguous() and num_units.is_contiguous()):
        raise ValueError("rows and num_units must be contiguous on CUDA (decode batch fields are)")
    from . import triton_write_score
    _check_write(kv, k, v, kmin, kmax)
    triton_write_score.write_score(kv, k, v, block_table, seq, newest,
                                   kernels.device_alias(dst, kv.device), dst_page, kmin, kmax,
                                   q_page, q, rows, num_units, out)


def select_resolve(scores: torch.Tensor, seq: torch.Tensor, num_full: torch.Tensor, k: int,
                   block_table: torch.Tensor, sel: torch.Tensor, locs: torch.Tensor,
                   work: tuple[torch.Tensor, torch.Tensor] | None = None,
                   hot: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   state=None, host_pt: torch.Tensor | None = None,
                   host: torch.Tensor | None = None, kv: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None, fetch: bool = True,
                   missed: torch.Tensor | None = None) -> None:
    """reference.select_resolve (shapes there; missed (N,) int32, with hot: 1 for a row that missed
    a page this step, else 0, which lets the attention's split skip its miss check); on CUDA the select kernel SELECT_IMPL names (CUDA:
    csrc/select_resolve.cu, or Triton: ops/triton_select.py; the same bits) and then, with fetch,
    the launch of the miss copies (fetch False: the misses stay marked ``-2 - block`` for the
    attention to read, ``kernels.decode_attention(..., miss=...)``). work: the Triton select's
    (scratch, victims) int32 workspaces of workspace_shapes(N, k, S); allocated here when None
    (and only when the Triton select runs), from the graph's pool while a CUDA graph is being
    captured, like the body's other buffers."""
    if not scores.is_cuda:
        reference.select_resolve(scores, seq, num_full, k, block_table, sel, locs, hot, rows,
                                 state, host_pt, host, kv, counts, fetch, missed)
        return
    from . import triton_select
    if hot is not None:
        if missed is None:
            missed = torch.empty(scores.shape[0], dtype=torch.int32, device=scores.device)
        assert host is not None and host.dtype == kv.dtype and kv.is_contiguous()
        assert host[0].numel() == kv[0].numel(), "host pages and cache blocks must have one layout"
        assert all(t.stride(1) == 1 for t in (*state.kernel_state(), host_pt))
    if SELECT_IMPL not in ("cuda", "triton"):
        raise ValueError(f"HISPARSE_SELECT_IMPL={SELECT_IMPL!r}: use cuda or triton")
    if SELECT_IMPL == "cuda" and kernels.available():
        _select_resolve_cuda(scores, seq, num_full, k, block_table, sel, locs, hot, rows, state,
                             host_pt, host, kv, counts, fetch, missed)
        return
    if work is None:
        S = state.kernel_state()[0].shape[1] if hot is not None else 1
        work = tuple(torch.empty(s, dtype=torch.int32, device=scores.device)
                     for s in workspace_shapes(scores.shape[0], k, S))
    triton_select.select_resolve(scores, seq, num_full, k, block_table, sel, locs, *work, hot,
                                 rows, state, host_pt, kernels.device_alias(host, scores.device),
                                 kv, counts, fetch, missed)


def _select_resolve_cuda(scores, seq, num_full, k, block_table, sel, locs, hot, rows, state,
                         host_pt, host, kv, counts, fetch, missed) -> None:
    """The CUDA select + RESOLVE (one CTA per row), then, with fetch, the miss copies
    (triton_select's IO launch). Rows' int fields int64, as the decode batch holds them."""
    from . import triton_select
    if hot is None:
        torch.ops.hisparse.select_resolve(scores, seq, num_full, seq, seq, block_table, sel, sel,
                                          sel, seq, sel, locs, sel, k, False, 0, 0, 0,
                                          SELECT_THREADS)
        return
    su, us, pol = state.kernel_state()
    c = triton_select.policy_constants(state)
    torch.ops.hisparse.select_resolve(scores, seq, num_full, hot, rows, block_table, su, us, pol,
                                      counts, sel, locs, missed, k, True, c["POLICY"],
                                      c["SHIFT"], c["HIT"], SELECT_THREADS)
    if fetch:
        triton_select.miss_io(locs, sel, seq, num_full, hot, rows, host_pt,
                              kernels.device_alias(host, scores.device), kv, k)


def workspace_shapes(N: int, k: int, S: int) -> tuple[tuple, tuple]:
    """Shapes of select_resolve's (scratch, victims) workspaces for a batch of N rows."""
    from .triton_select import select_widths
    KB, SB = select_widths(k, S)
    return (N, SB), (N, KB)
