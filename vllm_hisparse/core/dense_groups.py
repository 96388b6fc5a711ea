"""Dense attention of a group of requests in one step (prefill chunks, short requests, dense layers):
the group is built once per step by the plan (``make``) and attended by every layer (``attend``).

Which kernel attends a row is decided per row, never per group, so that a row gets the same bits
whichever rows share its group (hisparse and resident mode group rows differently): rows with several
query tokens go through the runtime's ``dense_fn`` (FlashAttention on the GPU, ``num_splits=1``);
with config ``split_dense_decode`` (resolved per runtime: ``rt.split_dense``) a row with one query
token goes through the batch-invariant split-KV decode kernel instead
(``ops.kernels.dense_decode_attention``; FlashAttention then sees it with 0 keys and skips it),
otherwise through ``dense_fn`` too.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core.step_plan import DenseGroup, ReqStep
from vllm_hisparse.ops import kernels


def split_enabled(cfg, device: torch.device, head_dim: int) -> bool:
    """Config split_dense_decode resolved for a runtime: None (default) = on where the KV lives on
    a CUDA device and the kernel has the head size, else as set."""
    if cfg.split_dense_decode is not None:
        return cfg.split_dense_decode
    return device.type == "cuda" and head_dim in kernels.DENSE_DECODE_HEAD_SIZES


def make(rt, group: list[ReqStep], table: torch.Tensor | None) -> DenseGroup | None:
    """rt: the SparseRuntime; table: (len(group), W) the block table rows of the group's requests
    (into the paged cache the call will read)."""
    if not group:
        return None
    cu = [0]
    for s in group:
        cu.append(cu[-1] + s.t1 - s.t0)
    tok = rt.h2d(torch.cat([torch.arange(s.t0, s.t1) for s in group]))
    seq = [s.seq_len for s in group]
    dec = ([i for i, s in enumerate(group) if s.t1 - s.t0 == 1] if rt.split_dense
           else [])
    n = len(group)
    if dec and len(dec) < n:
        is_dec = set(dec)
        seq_fa = [0 if i in is_dec else k for i, k in enumerate(seq)]
    else:
        seq_fa = seq                                   # unused: all or none of the rows
    meta = rt.h2d(cu + seq + seq_fa + dec + [cu[i] for i in dec], torch.int32)
    g = DenseGroup(group, tok, meta[:n + 1], meta[n + 1:2 * n + 1],
                   table.to(rt.device, torch.int32),
                   max(s.t1 - s.t0 for s in group), max(seq),
                   prefix=all(s.t0 == c for s, c in zip(group, cu)))
    if dec:
        m = 3 * n + 1
        g.dec_rows, g.dec_q = meta[m:m + len(dec)].long(), meta[m + len(dec):].long()
        g.seq_fa = meta[2 * n + 1:3 * n + 1] if len(dec) < n else None    # None: no FlashAttention
    return g


def attend(rt, g: DenseGroup | None, q: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Attention of the group's queries over k_cache/v_cache (N, P, Hkv, D) into out; q/out are the
    step's tokens (T, Hq, D)."""
    if g is None:
        return
    n = len(g.tok)
    direct = g.prefix and out.dtype == q.dtype     # tokens 0..n-1: no gather / scatter
    qg = q[:n] if direct else q[g.tok]
    o = out[:n] if direct else torch.empty((n, *q.shape[1:]), dtype=q.dtype, device=q.device)
    if g.dec_rows is None or g.seq_fa is not None:
        rt.dense_fn(qg, k_cache, v_cache, g.block_table, g.cu_q,
                    g.seq_k if g.dec_rows is None else g.seq_fa, g.max_q, g.max_k, scale, o)
    if g.dec_rows is not None:
        if g.seq_fa is None:                                     # every row is one query token
            kernels.dense_decode_attention(qg, k_cache, v_cache, g.block_table, g.seq_k, scale, o,
                                           max_k=g.max_k)
        else:
            o[g.dec_q] = kernels.dense_decode_attention(
                qg[g.dec_q], k_cache, v_cache, g.block_table[g.dec_rows], g.seq_k[g.dec_rows], scale,
                max_k=g.max_k)
    if not direct:
        out[g.tok] = o.to(out.dtype)
