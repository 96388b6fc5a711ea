"""One fixed decode body per layer for vLLM's FULL CUDA graphs (config full_decode_graphs).

vLLM captures a whole decode step per padded batch size N and replays it without calling the
attention backend, so the body a layer records must serve *any* batch of N single-token rows:
sparse requests (Quest + RESOLVE + sparse attention), short resident requests (dense attention over
the paged cache) and vLLM's padding rows, in any mix. Everything per step is decided on the host
before the replay (``SparseRuntime.plan_full``, from the connector's ``start_load_kv``) and written
into static buffers here (``fill``: decode_graph's ``load_rows``, which also fills the per-layer
graphs' buffers, plus this body's own fields; two host->device copies of packed metadata and
on-device gathers of the block and page tables); the body reads only those buffers:

- a sparse layer runs ``decode_graph.sparse_body`` over all N rows, the non-sparse rows pointing
  at the scratch rows with nothing selected (as decode-graph padding does), then FlashAttention
  (``rt.dense_fn``) over all N rows with ``seq_k`` 0 for every row but the dense ones, and keeps
  per row the output of its kind;
- a dense layer writes K/V, writes the sparse rows through to the dense pool, and attends the dense
  rows over the paged cache and the sparse rows over the dense pool (``seq_k`` 0 for the others).

Each row's result depends only on its own inputs (both attention kernels are per-row with fixed
splits), so a real row gets exactly what the eager path gives it, whatever the other rows are
(tests/test_full_decode.py). Padding rows write K/V into vLLM's null block 0 and nothing else.

``dense_only``: the body for batches without sparse rows (the vLLM adapter lets vLLM replay FULL
graphs only for those, vllm/full_dispatch.py; batches with sparse rows run PIECEWISE with the
per-layer decode graphs): every layer writes K/V and attends every row over the paged cache — what
stock vLLM's graph does, with the batch-invariant kernel. ``fill`` refuses sparse rows then.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.core.decode_graph import Static, load_rows, sparse_body, static_buffers
from vllm_hisparse.ops import kernels
from vllm_hisparse.ops.write_through import write_through

# extra per-row fields of the FULL body: rows of one int64 tensor (one more host->device copy)
_EXTRA = ("seq_dense", "seq_pool", "is_dense", "dpool_page")


@dataclass
class FullStatic(Static):
    """decode_graph.Static plus what the dense rows need."""
    extra: torch.Tensor = None     # (len(_EXTRA), N) int64
    bt32: torch.Tensor = None      # (N, W) int32 block tables for FlashAttention
    pool_bt: torch.Tensor = None   # (N, W) int32 dense-pool page tables (sparse rows), else 0
    cu_q: torch.Tensor = None      # (N+1,) int32 arange: one query per row
    seq_dense: torch.Tensor = None  # (N,) int32 keys of the dense rows, 0 elsewhere
    seq_pool: torch.Tensor = None  # (N,) int32 keys of the sparse rows (dense layers' pool), 0 else
    is_dense: torch.Tensor = None  # (N, 1, 1) bool
    is_sparse: torch.Tensor = None  # (N, 1, 1) bool
    o_dense: torch.Tensor = None   # (N, Hq, D) dense attention's output
    o_pool: torch.Tensor = None    # (N, Hq, D) dense-pool attention's output (dense layers)

    def x(self, name: str) -> torch.Tensor:
        return self.extra[_EXTRA.index(name)]


@dataclass
class DenseOnlyStatic:
    """What the dense-only body reads, for one padded batch size N (a few KiB per row, where
    FullStatic also holds the sparse body's q/k/v/out copies and tables)."""
    newest_blk: torch.Tensor       # (N,) int64 block of each row's new token (padding: null 0)
    off: torch.Tensor              # (N,) int64 the new token's offset in it
    bt32: torch.Tensor             # (N, W) int32 block tables (padding rows: 0)
    seq: torch.Tensor              # (N,) int32 keys per row (padding: 0)
    cu_q: torch.Tensor             # (N+1,) int32 arange: one query per row


class FullDecode:
    def __init__(self, rt, num_heads: int, max_width: int):
        self.rt, self.Hq, self.W = rt, num_heads, max_width
        self.static: dict[int, FullStatic] = {}
        self.static_dense: dict[int, DenseOnlyStatic] = {}
        self.max_k = max_width * rt.P                  # FlashAttention's max_seqlen_k (fixed)
        self.dense_fn = None          # the dense rows' attention; None = the runtime's dense_fn
        self.dense_only = False       # the body for batches without sparse rows (module doc)
        self.stats = {"full_steps": 0, "full_layers": 0}

    # ---- per step (host, before the replay) ---------------------------------------------------
    def fill(self, steps: list, block_table: torch.Tensor | None,
             N: int) -> FullStatic | DenseOnlyStatic:
        """Static buffers of batch size N for the decode rows `steps` (sp.ReqStep, one token each,
        in batch order from row 0; rows past len(steps) are padding). block_table: (>= n, W') the
        batch's block tables, row i = steps[i]."""
        rt = self.rt
        n = len(steps)
        if n > N:
            raise ValueError(f"{n} decode rows do not fit a FULL batch of {N}")
        if self.dense_only:
            if any(s.sparse for s in steps):
                raise RuntimeError(
                    "hisparse: a FULL decode graph with the dense-only body got sparse rows "
                    f"({[s.req_id for s in steps if s.sparse]}); their pages are not all on the "
                    "GPU. vLLM must run such batches PIECEWISE (vllm/full_dispatch.py decides)")
            self.stats["full_steps"] += 1
            return self._fill_dense_only(steps, block_table, N)
        st = self._static(N)
        load_rows(rt, st, steps, block_table[:n] if n else None)   # what sparse_body reads
        extra = torch.zeros(len(_EXTRA), N, dtype=torch.int64)
        X = dict(zip(_EXTRA, extra))
        seq = torch.tensor([s.seq_len for s in steps] + [0] * (N - n))
        sp = torch.tensor([s.sparse for s in steps] + [False] * (N - n))
        dense = (torch.arange(N) < n) & ~sp
        X["seq_dense"][:] = torch.where(dense, seq, 0)
        X["seq_pool"][:] = torch.where(sp, seq, 0)
        X["is_dense"][:] = dense.long()
        st.extra.copy_(rt.h2d(extra))
        on = st.field("sparse").bool()
        if rt.dpool is not None:
            pt = rt.dense_pt.table[st.field("rows").clamp(max=rt.max_rows - 1)]
            st.pool_bt.copy_(torch.where(on[:, None], pt, 0)[:, :self.W])
            dp = torch.gather(pt.long(), 1, st.field("newest")[:, None])[:, 0]
            st.x("dpool_page").copy_(torch.where(on, dp, -1))
        else:
            st.x("dpool_page").fill_(-1)
        st.bt32.copy_(st.bt)
        st.seq_dense.copy_(st.x("seq_dense"))
        st.seq_pool.copy_(st.x("seq_pool"))
        st.is_dense.copy_(st.x("is_dense").bool()[:, None, None])
        st.is_sparse.copy_(on[:, None, None])
        self.stats["full_steps"] += 1
        return st

    def _fill_dense_only(self, steps: list, block_table: torch.Tensor | None,
                         N: int) -> DenseOnlyStatic:
        """DenseOnlyStatic of batch size N, the per-row values in one host->device copy."""
        rt, n, P = self.rt, len(steps), self.rt.P
        st = self._dense_static(N)
        seq = [s.seq_len for s in steps] + [0] * (N - n)
        m = rt.h2d([[max(k - 1, 0) // P for k in seq], [max(k - 1, 0) % P for k in seq], seq],
                   torch.int64)
        st.bt32.zero_()
        if n:
            w = min(block_table.shape[1], self.W)
            st.bt32[:n, :w] = block_table[:n, :w].to(rt.device, torch.int32)
        st.newest_blk.copy_(torch.gather(st.bt32, 1, m[0][:, None])[:, 0])
        st.off.copy_(m[1])
        st.seq.copy_(m[2])
        return st

    # ---- per layer (recorded into vLLM's graph, or run eagerly) ------------------------------
    def layer(self, layer: int, N: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """q/out (N, Hq, D), k/v (N, Hkv, D): the step's (padded) tokens, row i = token i."""
        rt = self.rt
        self.stats["full_layers"] += 1
        if self.dense_only:                   # no sparse row: vLLM's buffers are read directly
            d = self._dense_static(N)
            sl.write_kv(kv, d.newest_blk, d.off, None, k, v)
            self._attend(q, kv, d.bt32, d.seq, d.cu_q, scale, out)
            return
        st = self._static(N)
        st.q.copy_(q)
        st.k.copy_(k)
        st.v.copy_(v)
        if layer in rt.dense_layers:
            self._dense_layer(layer, st, kv, scale, out)
        else:
            sparse_body(rt, layer, st, kv, scale)
            self._attend(st.q, kv, st.bt32, st.seq_dense, st.cu_q, scale, st.o_dense)
            torch.where(st.is_dense, st.o_dense, st.out, out=out)

    def _dense_layer(self, layer: int, st: FullStatic, kv: torch.Tensor, scale: float,
                     out: torch.Tensor) -> None:
        rt = self.rt
        f = st.field
        sl.write_kv(kv, f("newest_blk"), f("off"), None, st.k, st.v)
        if rt.dpool is None:                            # no host tier: every row is resident
            self._attend(st.q, kv, st.bt32, st.seq, st.cu_q, scale, out)
            return
        dp = rt.dpool.data[rt._dpool_layer[layer]]
        write_through(dp, st.k, st.v, st.tok, st.x("dpool_page"), f("off"))
        self._attend(st.q, kv, st.bt32, st.seq_dense, st.cu_q, scale, st.o_dense)
        self._attend(st.q, dp, st.pool_bt, st.seq_pool, st.cu_q, scale, st.o_pool)
        torch.where(st.is_sparse, st.o_pool, st.o_dense, out=out)

    def _attend(self, q, cache, table, seq_k, cu_q, scale, out) -> None:
        """One query per row over `cache` pages `table` (N, W) int32 with seq_k[r] keys (0: none):
        the split-KV decode kernel with config split_dense_decode (as core/dense_groups.py gives
        every one-token row; its grid is sized by the table width, as a graph must), else the
        runtime's dense_fn (or a test's override, self.dense_fn)."""
        if self.rt.split_dense:
            kernels.dense_decode_attention(q, cache[:, 0], cache[:, 1], table, seq_k, scale, out)
            return
        fn = self.dense_fn or self.rt.dense_fn
        fn(q, cache[:, 0], cache[:, 1], table, cu_q, seq_k, 1, self.max_k, scale, out)

    def padding(self, N: int) -> FullStatic | DenseOnlyStatic:
        """An all-padding batch of N (vLLM's capture runs): every row inert."""
        return self.fill([], None, N)

    def _dense_static(self, N: int) -> DenseOnlyStatic:
        st = self.static_dense.get(N)
        if st is None:
            dev = self.rt.device
            z = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
            st = self.static_dense[N] = DenseOnlyStatic(
                newest_blk=z(N, dtype=torch.int64), off=z(N, dtype=torch.int64), bt32=z(N, self.W),
                seq=z(N), cu_q=torch.arange(N + 1, dtype=torch.int32, device=dev))
        return st

    def _static(self, N: int) -> FullStatic:
        st = self.static.get(N)
        if st is None:
            rt = self.rt
            dev = rt.device
            z = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
            st = self.static[N] = FullStatic(
                **static_buffers(rt, self.Hq, self.W, N),
                extra=z(len(_EXTRA), N, dtype=torch.int64), bt32=z(N, self.W),
                pool_bt=z(N, self.W), cu_q=torch.arange(N + 1, dtype=torch.int32, device=dev),
                seq_dense=z(N), seq_pool=z(N), is_dense=z(N, 1, 1, dtype=torch.bool),
                is_sparse=z(N, 1, 1, dtype=torch.bool),
                o_dense=z(N, self.Hq, rt.head_dim, dtype=rt.dtype),
                o_pool=z(N, self.Hq, rt.head_dim, dtype=rt.dtype))
        return st
