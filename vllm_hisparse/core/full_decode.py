"""One fixed decode body per layer for vLLM's FULL CUDA graphs (config full_decode_graphs).

vLLM captures a whole decode step per padded batch size N and replays it without calling the
attention backend, so the body a layer records must serve *any* batch of N single-token rows:
sparse requests (Quest + RESOLVE + sparse attention), short resident requests (dense attention over
the paged cache) and vLLM's padding rows, in any mix. Everything per step is decided on the host
before the replay (``SparseRuntime.plan_full`` in the metadata builder) and written into static
buffers here (``fill``: one host->device copy of packed metadata plus on-device gathers of the block
and page tables); the body reads only those buffers:

- a sparse layer runs ``decode_graph.sparse_body`` over all N rows, the non-sparse rows pointing
  at the scratch rows with nothing selected (as decode-graph padding does), then FlashAttention
  (``rt.dense_fn``) over all N rows with ``seq_k`` 0 for every row but the dense ones, and keeps
  per row the output of its kind;
- a dense layer writes K/V, writes the sparse rows through to the dense pool, and attends the dense
  rows over the paged cache and the sparse rows over the dense pool (``seq_k`` 0 for the others).

Each row's result depends only on its own inputs (both attention kernels are per-row with fixed
splits), so a real row gets exactly what the eager path gives it, whatever the other rows are
(tests/test_full_decode.py). Padding rows write K/V into vLLM's null block 0 and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.core.decode_graph import _FIELDS, Static, sparse_body
from vllm_hisparse.ops.write_through import write_through

# extra per-row fields of the FULL body, packed after decode_graph's: rows of one int64 tensor
_EXTRA = ("newest", "seq_dense", "seq_pool", "is_dense", "is_sparse", "dpool_page")


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


class FullDecode:
    def __init__(self, rt, num_heads: int, max_width: int):
        self.rt, self.Hq, self.W = rt, num_heads, max_width
        self.static: dict[int, FullStatic] = {}
        self.max_k = max_width * rt.P                  # FlashAttention's max_seqlen_k (fixed)
        self.dense_fn = None          # the dense rows' attention; None = the runtime's dense_fn
        self.stats = {"full_steps": 0, "full_layers": 0}

    # ---- per step (host, in the metadata builder) --------------------------------------------
    def fill(self, steps: list, block_table: torch.Tensor | None, N: int) -> FullStatic:
        """Static buffers of batch size N for the decode rows `steps` (sp.ReqStep, one token each,
        in batch order from row 0; rows past len(steps) are padding). block_table: (>= n, W') the
        batch's block tables, row i = steps[i]."""
        rt = self.rt
        st = self._static(N)
        n, P, U = len(steps), rt.P, rt.U
        if n > N:
            raise ValueError(f"{n} decode rows do not fit a FULL batch of {N}")
        meta = torch.zeros(len(_FIELDS) + len(_EXTRA), N, dtype=torch.int64)
        F = {name: meta[i] for i, name in enumerate(_FIELDS + _EXTRA)}
        idx = torch.arange(N)
        sp = torch.tensor([s.sparse for s in steps] + [False] * (N - n))
        real = idx < n
        seq = torch.tensor([s.seq_len for s in steps] + [1] * (N - n), dtype=torch.int64)
        newest = torch.where(real, (seq - 1) // P, 0)
        F["rows"][:] = torch.where(sp, torch.tensor([s.row for s in steps] + [0] * (N - n)),
                                   rt.scratch_row)
        F["qrows"][:] = torch.where(sp, torch.tensor([s.qrow for s in steps] + [0] * (N - n)),
                                    rt.quest_scratch)
        F["seq"][:] = seq
        F["full"][:] = torch.where(sp, newest, 0)
        F["off"][:] = torch.where(real, (seq - 1) % P, 0)
        F["q_new"][:] = torch.where(sp, ((seq - 1) % P == 0).long(), 1)
        F["q_page"][:] = torch.where(sp, F["qrows"] * U + newest, rt.quest_scratch * U + idx % U)
        F["is_hot"][:] = torch.tensor([int(s.sparse and s.freed[1] > s.freed[0]) for s in steps]
                                      + [0] * (N - n))
        F["newest"][:] = newest
        dense = real & ~sp
        F["seq_dense"][:] = torch.where(dense, seq, 0)
        F["seq_pool"][:] = torch.where(sp, seq, 0)
        F["is_dense"][:] = dense.long()
        F["is_sparse"][:] = sp.long()
        st.meta.copy_(meta[:len(_FIELDS)].to(rt.device))
        st.extra.copy_(meta[len(_FIELDS):].to(rt.device))
        # block tables, host and dense-pool page tables: gathered on the device
        st.bt.zero_()
        if n:
            rows_bt = block_table[:n].to(rt.device, torch.int64)
            w = min(rows_bt.shape[1], self.W)
            st.bt[:n, :w] = rows_bt[:, :w]
        nb = st.x("newest")
        st.field("newest_blk").copy_(torch.gather(st.bt, 1, nb[:, None])[:, 0])
        st.field("newest_blk")[n:] = 0
        srow = st.field("rows")
        on = st.x("is_sparse").bool()
        if rt.pool is not None:
            st.host_pt.copy_(torch.where(on[:, None], rt.host_pt.table[srow.clamp(max=rt.max_rows - 1)],
                                         -1))
            hp = torch.gather(st.host_pt.long(), 1, nb[:, None])[:, 0]
            st.field("host_page").copy_(torch.where(on, hp, -1))
        else:
            st.host_pt.fill_(-1)
            st.field("host_page").fill_(-1)
        if rt.dpool is not None:
            pt = rt.dense_pt.table[srow.clamp(max=rt.max_rows - 1)]
            st.pool_bt.copy_(torch.where(on[:, None], pt, 0)[:, :self.W])
            dp = torch.gather(pt.long(), 1, nb[:, None])[:, 0]
            st.x("dpool_page").copy_(torch.where(on, dp, -1))
        else:
            st.x("dpool_page").fill_(-1)
        st.bt32.copy_(st.bt)
        st.is_hot.copy_(st.field("is_hot").bool())
        st.seq.copy_(st.field("seq"))
        st.seq_dense.copy_(st.x("seq_dense"))
        st.seq_pool.copy_(st.x("seq_pool"))
        st.is_dense.copy_(st.x("is_dense").bool()[:, None, None])
        st.is_sparse.copy_(on[:, None, None])
        st.slot_map.copy_(st.bt[:, :rt.S])
        st.n = n
        self.stats["full_steps"] += 1
        return st

    # ---- per layer (recorded into vLLM's graph, or run eagerly) ------------------------------
    def layer(self, layer: int, N: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """q/out (N, Hq, D), k/v (N, Hkv, D): the step's (padded) tokens, row i = token i."""
        rt = self.rt
        st = self._static(N)
        st.q.copy_(q)
        st.k.copy_(k)
        st.v.copy_(v)
        if layer in rt.dense_layers:
            self._dense_layer(layer, st, kv, scale)
        else:
            sparse_body(rt, layer, st, kv, scale)
            self._attend(st.q, kv, st.bt32, st.seq_dense, scale, st.o_dense)
            st.out.copy_(torch.where(st.is_dense, st.o_dense, st.out))
        out.copy_(st.out)
        self.stats["full_layers"] += 1

    def _dense_layer(self, layer: int, st: FullStatic, kv: torch.Tensor, scale: float) -> None:
        rt = self.rt
        f = st.field
        sl.write_kv(kv, f("newest_blk"), f("off"), None, st.k, st.v)
        if rt.dpool is None:                            # no host tier: every row is resident
            self._attend(st.q, kv, st.bt32, st.seq, scale, st.out)
            return
        dp = rt.dpool.data[rt._dpool_layer[layer]]
        write_through(dp, st.k, st.v, st.tok, st.x("dpool_page"), f("off"))
        self._attend(st.q, kv, st.bt32, st.seq_dense, scale, st.o_dense)
        self._attend(st.q, dp, st.pool_bt, st.seq_pool, scale, st.o_pool)
        st.out.copy_(torch.where(st.is_sparse, st.o_pool, st.o_dense))

    def _attend(self, q, cache, table, seq_k, scale, out) -> None:
        """One query per row over `cache` pages `table` (N, W) int32 with seq_k[r] keys (0: none)."""
        fn = self.dense_fn or self.rt.dense_fn
        fn(q, cache[:, 0], cache[:, 1], table, self.static[q.shape[0]].cu_q, seq_k, 1, self.max_k,
           scale, out)

    def padding(self, N: int) -> FullStatic:
        """An all-padding batch of N (vLLM's capture runs): every row inert."""
        return self.fill([], None, N)

    def _static(self, N: int) -> FullStatic:
        st = self.static.get(N)
        if st is None:
            rt = self.rt
            dev, dt, D, Hkv = rt.device, rt.dtype, rt.head_dim, rt.num_kv_heads
            z = lambda *shape, dtype=dt: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
            st = FullStatic(
                q=z(N, self.Hq, D), k=z(N, Hkv, D), v=z(N, Hkv, D), out=z(N, self.Hq, D),
                meta=z(len(_FIELDS), N, dtype=torch.int64), bt=z(N, self.W, dtype=torch.int64),
                host_pt=torch.full((N, rt.U), -1, dtype=torch.int32, device=dev),
                tok=torch.arange(N, dtype=torch.int64, device=dev),
                is_hot=z(N, dtype=torch.bool), seq=torch.ones(N, dtype=torch.int32, device=dev),
                slot_map=z(N, rt.S, dtype=torch.int32),
                extra=z(len(_EXTRA), N, dtype=torch.int64), bt32=z(N, self.W, dtype=torch.int32),
                pool_bt=z(N, self.W, dtype=torch.int32),
                cu_q=torch.arange(N + 1, dtype=torch.int32, device=dev),
                seq_dense=z(N, dtype=torch.int32), seq_pool=z(N, dtype=torch.int32),
                is_dense=z(N, 1, 1, dtype=torch.bool), is_sparse=z(N, 1, 1, dtype=torch.bool),
                o_dense=z(N, self.Hq, D), o_pool=z(N, self.Hq, D))
            self.static[N] = st
        return st
