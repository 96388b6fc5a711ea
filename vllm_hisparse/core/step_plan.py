"""What one step of the serving runtime decided, once, on the host (``SparseRuntime.plan``): the
requests of the batch, the cache / indexer / host-pool indices of the prefill rows' tokens and their
dense attention groups, and the decode batch of the one-token rows (core/decode_batch.py).
``forward_layer`` only reads it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ReqStep:
    """One request of the batch: tokens [t0, t1) at positions [start, seq_len)."""
    idx: int
    req_id: str
    t0: int
    t1: int
    start: int
    seq_len: int
    row: int
    sparse: bool
    freed: tuple[int, int]
    irow: int = -1                             # indexer row (-1: not a sparse request)


@dataclass
class DenseGroup:
    """Requests attended densely in one paged-attention call (prefill chunks; dense layers' rows
    read back from the host pool): their tokens packed in batch order."""
    steps: list[ReqStep]
    tok: torch.Tensor                          # (Tq,) token index of each packed query
    cu_q: torch.Tensor                         # (n+1,) int32 packed query offsets
    seq_k: torch.Tensor                        # (n,) int32 keys per request
    block_table: torch.Tensor                  # (n, W) int32
    max_q: int
    max_k: int
    prefix: bool = False                       # tok == arange(Tq): slice q/out, don't gather


@dataclass
class StepPlan:
    reqs: list[ReqStep]
    block_table: torch.Tensor                  # (B, W) int32
    wr_blk: torch.Tensor                       # (n,) int64 block of each token written to the cache
    wr_off: torch.Tensor                       # (n,) int64 its offset in the block
    wr_tok: torch.Tensor | None                # (n,) its token index; None = all T tokens in order
    ix_upd: object = None                      # Indexer.device_update of the sparse rows' tokens
    ix_tok: torch.Tensor | None = None         # (Tq,) token index of each of them; None = all T
    host_tok: torch.Tensor | None = None       # (n,) tokens written through to the host pool
    host_page: torch.Tensor | None = None      # (n,) their host pages
    host_off: torch.Tensor | None = None       # (n,) their offsets in the page
    host_src: torch.Tensor | None = None       # (n,) their K rows in the cache's (N*2*P) rows
    dense_sparse: DenseGroup | None = None     # dense rows of sparse layers
    dense_res: DenseGroup | None = None        # dense layers: requests with every page on the GPU
    dense_freed: list[ReqStep] = field(default_factory=list)  # prefill rows whose pages left the
    # GPU (recomputed after a preemption): attended over the host pool's copy
    dense_pool: DenseGroup | None = None       # dense layers: sparse requests, from the dense pool
    dpool_page: torch.Tensor | None = None     # (n,) dense-pool page of each host_tok token
    dense: list[ReqStep] = field(default_factory=list)  # the prefill rows (several query tokens)
    db: object = None                          # core.decode_batch.DecodeBatch: one-token rows
    db_bt: torch.Tensor | None = None          # (n, W) int32 block tables of the decode rows
    db_tok: torch.Tensor | None = None         # (n,) int64 their tokens; None = tokens 0..n-1
    spec: object = None                        # core.spec_rows.SpecRows: speculative verify rows
