"""Dense attention of a group of requests in one step (prefill chunks, and the host read-back of
dense layers): the group is built once per step by the plan (``make``) and attended by every layer
(``attend``) through the runtime's ``dense_fn`` (FlashAttention on the GPU, ``num_splits=1`` so a
row's bits do not depend on its group; its plain-torch twin on the CPU).

Rows with one query token are not here: they form the step's decode batch (core/decode_batch.py),
whose dense rows go through the batch-invariant split-KV decode kernel (config
``split_dense_decode``, resolved per runtime by ``split_enabled``).
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
    n = len(group)
    meta = rt.h2d(cu + seq, torch.int32)
    return DenseGroup(group, tok, meta[:n + 1], meta[n + 1:], table.to(rt.device, torch.int32),
                      max(s.t1 - s.t0 for s in group), max(seq),
                      prefix=all(s.t0 == c for s, c in zip(group, cu)))


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
    rt.dense_fn(qg, k_cache, v_cache, g.block_table, g.cu_q, g.seq_k, g.max_q, g.max_k, scale, o)
    if not direct:
        out[g.tok] = o.to(out.dtype)
