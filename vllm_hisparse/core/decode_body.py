"""One layer of a decode batch (core/decode_batch.py): the only code that decodes a row, run eagerly
(CPU, mixed steps, batch sizes vLLM has no graph for) and recorded into vLLM's FULL CUDA graphs.

Sparse layer, N rows, every launch over all rows (rows not of a kernel's kind return at once):

1. the new token into its block, through to the host pool, into the indexer's state, and, if
   the batch has sparse rows (a graph records it always), the indexer's unit scores
   (``Indexer.write_and_score``: one launch for Quest on CUDA); ``decode_write`` alone in an
   eager batch without sparse rows;
2. if the batch has sparse rows: ``select_resolve`` (top-k units, RESOLVE; the misses left
   marked);
3. ``decode_attention``: sparse rows over their selected pages and newest page — a missed page's
   tokens copied from the pinned host pool into its block by the split that reads them — dense
   rows with the batch-invariant split-KV dense decode over the paged cache — one split and one
   combine launch. (``HISPARSE_FETCH_IN_ATTENTION=0``, and the eager path with FlashAttention for dense
   rows: select_resolve copies the misses in its own launch first.)

Dense layer: the new token into its block (and the dense pool, or the host pool); dense decode of
the rows whose keys are on the GPU over the cache, of sparse rows over the dense pool — one split and
one combine launch for both (``kernels.dense_decode_two``); sparse rows whose pages left the GPU
without a dense pool read them back from the host (eager only).

Each kernel's result for a row depends only on that row, so a row gets the same bits whatever the
batch, eager or replayed — and hisparse == resident, which differ only in where pages sit.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core import prefill
from vllm_hisparse.ops import decode_ops, kernels


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _dense_work(q: torch.Tensor):
    """The split-KV dense decode's partial results for every row of q (CUDA; a marker on CPU)."""
    if not q.is_cuda:
        return ()
    from vllm_hisparse.ops.triton_dense_decode import partials_numel
    n_o, n_m = partials_numel(q.shape[0], q.shape[1], q.shape[2])
    return (torch.empty(n_o, dtype=torch.float32, device=q.device),
            torch.empty(n_m, dtype=torch.float32, device=q.device))


def _max_k(db, q: torch.Tensor, bt: torch.Tensor, P: int) -> int:
    """Keys bound of the dense calls (FlashAttention's max_seqlen_k; the split-KV kernel's grid
    does not depend on it): the block table's width in a graph (it serves any batch), else this
    batch's longest row."""
    if _capturing(q):
        return bt.shape[1] * P
    return max([s.seq_len for s in db.steps] + [1])


def sparse_layer(rt, layer: int, db, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv: torch.Tensor, bt: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """q/out (N, Hq, D), k/v (N, Hkv, D): row i = row i of db; kv (blocks, 2, P, Hkv, D) this
    layer's cache; bt (N, W) int32 the rows' block tables."""
    f = db.field
    N, dev = q.shape[0], q.device
    host = rt.host_layer(layer)
    ix = rt.ix
    write = (kv, k, v, bt, f("seq"), db.newest, host, f("host_page"))
    K, P = rt.k_sel, rt.P
    scores = torch.empty(N, ix.U, dtype=torch.float32, device=dev)
    if db.holds("has_sparse"):
        ix.write_and_score(layer, write, f("i_unit"), q, f("irow"), f("full"), scores)
    else:
        decode_ops.decode_write(*write, **ix.decode_write_kwargs(layer, f("i_unit")))
    sel = db.sel[layer]                  # (N, K): kept to the next step (core/give_back.py)
    locs = torch.empty_like(sel)
    hs = rt.hot[layer]
    # rows that missed a page this step (select_resolve's, read by the split): hot layers only
    missed = torch.empty(N, dtype=torch.int32, device=dev) if hs is not None else None
    mixed = rt.split_dense or not q.is_cuda          # both row kinds: one split + one combine launch
    # the misses' pages: read (and stored into their blocks) by the attention's split launch, or
    # copied by select_resolve's own launch before it
    in_attention = hs is not None and mixed and decode_ops.FETCH_IN_ATTENTION

    def sparse():
        hot = {} if hs is None else dict(
            hot=f("hot"), rows=f("row"), state=hs, host_pt=rt.host_pt.fetch, host=host, kv=kv,
            counts=rt._hit_miss, fetch=not in_attention, missed=missed)
        decode_ops.select_resolve(scores, f("sp_seq"), f("full"), K, bt, sel, locs, **hot)
        if rt.trace is not None:
            rt.trace.decode(layer, db, sel)

    db.run_kinds(("has_sparse",), [sparse])
    if mixed:
        aw = ()
        if q.is_cuda:
            from vllm_hisparse.ops.triton_decode_attention import partials_numel
            aw = tuple(torch.empty(n, dtype=torch.float32, device=dev)
                       for n in partials_numel(N, q.shape[1], kv.shape[3], K, P, q.shape[2]))
        miss = (f("row"), rt.host_pt.fetch, host, missed) if in_attention else None
        kernels.decode_attention(q, kv, bt, locs, sel, f("sp_seq"), db.newest, f("dn_seq"), scale,
                                 out, aw, miss)
        return
    # split_dense off (FlashAttention for dense rows; eager only, no FULL graphs then)
    dense = _dense(rt, q, kv, bt, f("dn_seq"), scale, out, _max_k(db, q, bt, P), ())
    db.run_kinds(("has_sparse", "has_dense"), [lambda: kernels.sparse_decode_attention_newest(
        q, kv, locs, sel, f("sp_seq"), db.newest, scale, out), dense])


def dense_layer(rt, layer: int, db, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: torch.Tensor, bt: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """A dense layer (cfg.dense_layers) of the decode batch; arguments as sparse_layer."""
    f = db.field
    dp = rt.dense_pool_layer(layer)
    if dp is not None:
        dst, dst_page = dp, f("dpool_page")
    else:
        dst, dst_page = rt.host_layer(layer), f("host_page")
    decode_ops.decode_write(kv, k, v, bt, f("seq"), db.newest, dst, dst_page)
    work = _dense_work(q)
    if dp is not None and (rt.split_dense or not q.is_cuda):
        # rows on the cache and rows on the pool: one split + one combine launch for both
        if db.holds("has_dl") or db.holds("has_pool"):
            kernels.dense_decode_two(q, kv, bt, f("dl_seq"), dp, rt.dense_pt.table, f("row"),
                                     f("pool_seq"), scale, out, work)
    else:
        max_k = _max_k(db, q, bt, rt.P)
        on_gpu = _dense(rt, q, kv, bt, f("dl_seq"), scale, out, max_k, work)
        if dp is None:
            db.run_kinds(("has_dl",), [on_gpu])
        else:                          # FlashAttention (split_dense_decode off): one call a cache
            in_pool = _dense(rt, q, dp, rt.dense_pt.table, f("pool_seq"), scale, out, max_k,
                             work, rows=f("row"))
            db.run_kinds(("has_dl", "has_pool"), [on_gpu, in_pool])
    if db.freed:                     # no dense pool: pages that left the GPU come from the host
        prefill.dense_from_host(rt, layer, db, q, kv, bt, scale, out)


def _dense(rt, q, cache, table, seq, scale, out, max_k: int, work, rows=None):
    """The dense decode of the rows with seq > 0 over cache pages table (rows: table row of each),
    as a callable: the split-KV decode kernel (its plain-torch twin on the CPU), or, with
    split_dense_decode off on a GPU, the runtime's dense_fn (FlashAttention; FULL graphs are off
    then) merged by row."""
    if rt.split_dense or not q.is_cuda:
        return lambda: kernels.dense_decode_attention(
            q, cache[:, 0], cache[:, 1], table, seq, scale, out, max_k=max_k, table_rows=rows,
            work=work)

    def fa():
        N = q.shape[0]
        tmp = torch.empty_like(q)
        tbl = (table if rows is None else table[rows]).to(torch.int32)
        cu = torch.arange(N + 1, dtype=torch.int32, device=q.device)
        rt.dense_fn(q, cache[:, 0], cache[:, 1], tbl, cu, seq.to(torch.int32), 1, max_k, scale, tmp)
        out.copy_(torch.where((seq > 0)[:, None, None], tmp, out))
    return fa
