"""Decode of the sparse layers in one CUDA graph per (layer, padded batch size): the eager decode
layer is ~60 small launches (CPU-bound, docs/gpu-results.md), a replay is one.

A step qualifies when every row of the batch is one decode token of a sparse request (no prefill
chunk, no short resident request: ``plan.dense`` empty); other steps and the dense layers stay
eager. The batch is padded to a bucket size Rp (powers of two up to max_rows). Everything the
layer reads lives in static buffers filled once per step by ``fill`` (one host->device copy of a
packed metadata tensor), so the captured kernels see the same addresses on every replay:

- padding rows point at runtime row ``scratch`` (one spare row of Quest bounds / hot-slot state that
  no request owns), write their K/V into block 0 (vLLM's null block, never read for a real row),
  write nothing to the host pool (page -1), select nothing (so RESOLVE leaves them alone) and count
  no hits or misses; their outputs are dropped;
- every real row runs the same ops as the eager path, in the same order, on the same values: the
  result is bit-identical to the eager path (tests/test_decode_graph.py on CPU, where the static
  step runs without capture; tests/test_decode_graph_gpu.py replays real graphs).

No host sync, no allocation outside the graph's pool, no data-dependent Python branch inside.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hisparse.core import sparse_layer as sl
from vllm_hisparse.ops.write_through import write_through

# Per-step metadata packed into one int64 tensor (one H2D copy): one row each, width Rp.
_FIELDS = ("rows", "qrows", "seq", "full", "newest", "newest_blk", "off", "host_page",
           "q_page", "q_new", "is_hot", "sparse")
# The static buffers a step writes (a capture's warm-up saves and restores them).
_STEP_BUFFERS = ("meta", "bt", "host_pt", "is_hot", "seq", "slot_map")


def bucket(n: int, max_rows: int) -> int:
    """Smallest power of two >= n, capped at max_rows."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_rows)


@dataclass
class Static:
    """The static buffers of one padded batch size."""
    q: torch.Tensor             # (Rp, Hq, D)
    k: torch.Tensor             # (Rp, Hkv, D)
    v: torch.Tensor
    out: torch.Tensor           # (Rp, Hq, D)
    meta: torch.Tensor          # (len(_FIELDS), Rp) int64
    bt: torch.Tensor            # (Rp, W) int64 block tables (padding rows: block 0)
    host_pt: torch.Tensor       # (Rp, U) int32 host page tables (padding rows: -1)
    tok: torch.Tensor           # (Rp,) arange: token i of the static batch is row i
    is_hot: torch.Tensor        # (Rp,) bool: the row resolves through its hot slots
    seq: torch.Tensor           # (Rp,) int32 sequence lengths
    slot_map: torch.Tensor      # (Rp, S) int32 blocks of the hot slots
    n: int = 0                  # real rows this step

    def field(self, name: str) -> torch.Tensor:
        return self.meta[_FIELDS.index(name)]


def static_buffers(rt, num_heads: int, W: int, N: int) -> dict:
    """Static's tensors for a batch of N rows (padding contents), as keyword arguments."""
    dev, dt, D, Hkv = rt.device, rt.dtype, rt.head_dim, rt.num_kv_heads
    return dict(
        q=torch.zeros(N, num_heads, D, dtype=dt, device=dev),
        k=torch.zeros(N, Hkv, D, dtype=dt, device=dev),
        v=torch.zeros(N, Hkv, D, dtype=dt, device=dev),
        out=torch.zeros(N, num_heads, D, dtype=dt, device=dev),
        meta=torch.zeros(len(_FIELDS), N, dtype=torch.int64, device=dev),
        bt=torch.zeros(N, W, dtype=torch.int64, device=dev),
        host_pt=torch.full((N, rt.U), -1, dtype=torch.int32, device=dev),
        tok=torch.arange(N, dtype=torch.int64, device=dev),
        is_hot=torch.zeros(N, dtype=torch.bool, device=dev),
        seq=torch.ones(N, dtype=torch.int32, device=dev),
        slot_map=torch.zeros(N, rt.S, dtype=torch.int32, device=dev))


def load_rows(rt, st: Static, d: list, bt_rows: torch.Tensor | None) -> None:
    """Fill st for rows [0, n) = the one-token batch rows d (core.step_plan.ReqStep) with block
    tables bt_rows (n, W'), the rest inert padding (all of it when d is empty). A row of a sparse
    request decodes; any other row (a dense request: the FULL body's) is inert like padding except
    that its K/V go to its newest block: scratch rows, nothing selected, no host page, q_page on
    the scratch Quest row (one page per row, so no two rows update the same page)."""
    n, N, P, U = len(d), st.meta.shape[1], rt.P, rt.U
    pad = [0] * (N - n)
    idx = torch.arange(N)
    sp = torch.tensor([s.sparse for s in d] + [False] * (N - n))
    seq = torch.tensor([s.seq_len for s in d] + [1] * (N - n), dtype=torch.int64)
    newest = torch.where(idx < n, (seq - 1) // P, 0)
    meta = torch.zeros(len(_FIELDS), N, dtype=torch.int64)
    F = dict(zip(_FIELDS, meta))
    F["rows"][:] = torch.where(sp, torch.tensor([s.row for s in d] + pad), rt.scratch_row)
    F["qrows"][:] = torch.where(sp, torch.tensor([s.qrow for s in d] + pad), rt.quest_scratch)
    F["seq"][:] = seq
    F["full"][:] = torch.where(sp, newest, 0)
    F["newest"][:] = newest
    F["off"][:] = torch.where(idx < n, (seq - 1) % P, 0)      # the new token in its page
    F["q_new"][:] = torch.where(sp, ((seq - 1) % P == 0).long(), 1)
    F["q_page"][:] = torch.where(sp, F["qrows"] * U + newest, rt.quest_scratch * U + idx % U)
    F["is_hot"][:] = torch.tensor([int(s.sparse and s.freed[1] > s.freed[0]) for s in d] + pad)
    F["sparse"][:] = sp.long()
    st.meta.copy_(rt.h2d(meta))
    # block tables and host page tables stay on the device: gathered for the real rows
    st.bt.zero_()
    if n:
        w = min(bt_rows.shape[1], st.bt.shape[1])
        st.bt[:n, :w] = bt_rows[:, :w].to(rt.device, torch.int64)
    nb = st.field("newest")[:, None]
    st.field("newest_blk").copy_(torch.gather(st.bt, 1, nb)[:, 0])     # padding: block 0
    if rt.pool is not None:
        on = st.field("sparse").bool()
        pt = rt.host_pt.table[st.field("rows").clamp(max=rt.max_rows - 1)]
        st.host_pt.copy_(torch.where(on[:, None], pt, -1))
        st.field("host_page").copy_(torch.gather(st.host_pt.long(), 1, nb)[:, 0])
    else:
        st.host_pt.fill_(-1)
        st.field("host_page").fill_(-1)
    st.is_hot.copy_(st.field("is_hot").bool())
    st.seq.copy_(st.field("seq"))
    st.slot_map.copy_(st.bt[:, :rt.S])
    st.n = n


def sparse_body(rt, layer: int, st: Static, kv: torch.Tensor, scale: float) -> None:
    """One sparse layer's decode on static buffers (st.q/k/v in, st.out out): the eager decode path's
    ops in its order; rows pointing at the scratch rows with nothing selected are inert. Shared by
    the per-layer graphs here and the FULL-graph body (core/full_decode.py)."""
    f = st.field
    sl.write_kv(kv, f("newest_blk"), f("off"), None, st.k, st.v)
    host = rt.host_layer(layer)
    if host is not None:
        write_through(host, st.k, st.v, st.tok, f("host_page"), f("off"))
    sl.quest_update_pages(rt.kmin[layer], rt.kmax[layer], f("q_page"), f("q_new").bool(),
                          st.tok, st.k)
    sel, locs = sl.quest_topk_locs(st.q, rt.kmin[layer], rt.kmax[layer], f("qrows"), f("full"),
                                   rt.k_sel, st.bt)
    if rt.hot[layer] is not None:                   # cold and padding rows resolve nothing
        sl.resolve_hot_into(locs, sel, st.is_hot, f("rows"), rt.hot[layer], st.slot_map, kv, host,
                            st.host_pt, rt._hit_miss, io_chunk_bytes=rt.cfg.io_chunk_bytes)
    sl.sparse_decode(st.q, kv, locs, sel, st.seq, f("newest_blk"), scale, st.out)


class DecodeGraphs:
    def __init__(self, rt, num_heads: int, max_width: int, capture: bool):
        """rt: the SparseRuntime; max_width: block-table width (max_model_len pages);
        capture: record CUDA graphs (CUDA only); False runs the static step eagerly (CPU tests)."""
        self.rt = rt
        self.Hq = num_heads
        self.W = max_width
        self.capture = capture
        self.static: dict[int, Static] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # What a graph baked in besides the static buffers: the scale and the cache tensor.
        self._baked: dict[tuple[int, int], tuple] = {}
        self._pool = None
        self.stats = {"runs": 0, "replays": 0, "captures": 0, "precaptures": 0}

    @staticmethod
    def _signature(kv: torch.Tensor, scale: float) -> tuple:
        return (float(scale), kv.data_ptr(), tuple(kv.shape), tuple(kv.stride()), kv.dtype)

    def precapture(self, layer: int, rows: int, kv: torch.Tensor, scale: float) -> bool:
        """Capture (layer, bucket(rows)) ahead of the first real step, on an all-padding batch:
        the Triton JIT and the capture then happen at startup (vLLM's own graph-capture dummy
        batches call this) instead of inside the first requests. Runtime state is untouched
        (_padding_step). On the CPU (capture off) it runs the all-padding step once. Returns whether it did anything."""
        Rp = bucket(max(rows, 1), self.rt.max_rows)
        key = (layer, Rp)
        if key in self.graphs and self._baked.get(key) == self._signature(kv, scale):
            return False
        st = self._static(Rp, None)
        if self.capture:
            self._record(key, st, kv, scale)
        else:
            self._padding_step(layer, st, kv, scale)
        self.stats["precaptures"] += 1
        return True

    # ---- per step ----------------------------------------------------------------------------
    def fill(self, plan) -> None:
        """Copy the step's decode metadata into the bucket's static buffers (plan.graph = Rp)."""
        Rp = bucket(len(plan.dec), self.rt.max_rows)
        self._load(self._static(Rp, plan), plan.dec, plan.block_table)
        plan.graph = Rp

    def _load(self, st: Static, d: list, block_table: torch.Tensor | None) -> None:
        """Rows [0, n) from the decode rows d, the rest inert padding (all of it when d is empty)."""
        bt = None
        if d:
            idx = torch.tensor([s.idx for s in d], dtype=torch.int64).to(block_table.device)
            bt = block_table[idx]
        load_rows(self.rt, st, d, bt)

    # ---- per layer ---------------------------------------------------------------------------
    def run(self, layer: int, plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """The decode step of one sparse layer for the plan's rows (every token a decode row)."""
        st = self.static[plan.graph]
        n = st.n
        tok = plan.dec_tok
        if plan.dec_prefix:                          # one copy each, no gather (pure decode)
            st.q[:n].copy_(q[:n])
            st.k[:n].copy_(k[:n])
            st.v[:n].copy_(v[:n])
        else:
            st.q[:n] = q[tok]
            st.k[:n] = k[tok]
            st.v[:n] = v[tok]
        key = (layer, plan.graph)
        self.stats["runs"] += 1                      # layers through this path (replayed or not)
        if not self.capture:
            self._step(layer, st, kv, scale)
        else:
            g = self.graphs.get(key)
            if g is None or self._baked.get(key) != self._signature(kv, scale):
                g = self._record(key, st, kv, scale)   # first use, or captured with another scale/cache
            g.replay()
            self.stats["replays"] += 1
        if plan.dec_prefix:
            out[:n].copy_(st.out[:n])
        else:
            out[tok] = st.out[:n].to(out.dtype)

    def _step(self, layer: int, st: Static, kv: torch.Tensor, scale: float) -> None:
        """The captured body: the eager decode path on static buffers, padding rows inert."""
        sparse_body(self.rt, layer, st, kv, scale)

    def _padding_step(self, layer: int, st: Static, kv: torch.Tensor, scale: float) -> None:
        """Run the step on an all-padding batch, then put back the step buffers and the hit/miss
        counts it touched: only inert padding state (scratch rows, null block) changes."""
        saved, n = {name: getattr(st, name).clone() for name in _STEP_BUFFERS}, st.n
        hm = self.rt._hit_miss.clone()
        self._load(st, [], None)
        self._step(layer, st, kv, scale)
        for name, t in saved.items():
            getattr(st, name).copy_(t)
        st.n = n
        self.rt._hit_miss.copy_(hm)

    def _record(self, key, st: Static, kv: torch.Tensor, scale: float):
        """Warm up (Triton JIT, allocator) on a side stream with an all-padding step, then capture."""
        layer = key[0]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._padding_step(layer, st, kv, scale)  # JIT + allocator warm-up
        torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._step(layer, st, kv, scale)
        self.graphs[key] = g
        self._baked[key] = self._signature(kv, scale)
        self.stats["captures"] += 1
        # Capture does not execute: the caller replays it for this step.
        return g

    def _static(self, Rp: int, plan) -> Static:
        st = self.static.get(Rp)
        if st is None:
            st = self.static[Rp] = Static(**static_buffers(self.rt, self.Hq, self.W, Rp))
        return st
