"""Speculative decoding's verify rows: a sparse request past its prompt with several query tokens in
one step (vLLM's verified token + its drafts, ``rt.spec_tokens`` >= 1 of them at most), attended
sparsely against ONE row set per request instead of the prefill path's dense attention.

A verify row of tokens at positions [start, seq) (a = start // page, b = (seq - 1) // page;
b <= a + 1 while k + 1 <= page):

- its tokens are written like a prefill chunk's (cache, host pool, indexer state: core/prefill.py,
  which also attends them densely in the dense layers);
- its selection is over the complete pages before the step, [0, a): each query token scores them
  (``Indexer.score``) and the request's score of a page is the max over its tokens (one selection
  that serves every token, whichever of them would have picked the page); top ``k_sel`` of them
  are resolved ONCE (``select_resolve`` over one row per request: no two rows share a runtime
  row's hot slots, so RESOLVE does not race);
- token j attends those pages and, causally, the window [a * page, start + j] read from the cache
  (pages a..b, both still on the GPU: the KV manager gives back only pages below
  processed // page, and processed = start here).

With one token (k = 0) this is exactly the decode batch's row: pages [0, (seq - 1) // page)
selected, the newest page attended. Everything is per request, so hisparse == resident (host_tier
false runs the same rows through the block table) bit for bit. The rows run eagerly (a verify step
is not a uniform single-token step: vLLM replays no FULL graph of ours for it). Drafts that vLLM
rejects stay folded into their page's Quest bounds (min/max cannot be unfolded; a later token
rewrites the position's K/V), in both modes alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_hisparse.core import dense_groups, prefill
from vllm_hisparse.core.step_plan import ReqStep, StepPlan
from vllm_hisparse.ops import decode_ops, kernels


@dataclass
class SpecRows:
    """The verify rows of one step (R requests, Tq query tokens); device tensors."""
    steps: list[ReqStep]
    tok: torch.Tensor            # (Tq,) int64 token index of each query token in the step
    req: torch.Tensor            # (Tq,) int64 its verify row (0..R-1)
    irow: torch.Tensor           # (Tq,) int64 its indexer row
    units: torch.Tensor          # (Tq,) int64 pages it scores: a of its row
    win_len: torch.Tensor        # (Tq,) int32 window keys it attends: start + j + 1 - a * page
    seq: torch.Tensor            # (R,) int64 start + 1 (> 0: live)
    full: torch.Tensor           # (R,) int64 a: pages selectable
    hot: torch.Tensor            # (R,) int64 pages [0, hot) through the hot slots (0: resident)
    rows: torch.Tensor           # (R,) int64 runtime rows
    bt: torch.Tensor             # (R, W) int32 block tables
    win: torch.Tensor            # (R, 2) int64 blocks of pages a and b (b == a: a twice)
    sparse_plan: StepPlan        # the step's plan for sparse layers (these rows not attended
    #                              densely there)


def pick(rt, steps: list[ReqStep]) -> list[ReqStep]:
    """The verify rows of a step: sparse requests past their prompt with 2..1 + rt.spec_tokens
    tokens (none unless speculative decoding is on)."""
    k = rt.spec_tokens
    return [s for s in steps if k and s.sparse and 1 < s.t1 - s.t0 <= k + 1
            and s.start >= rt.reqs[s.req_id].num_prompt]


def plan(rt, steps: list[ReqStep], p: StepPlan, block_table: torch.Tensor) -> SpecRows | None:
    """The verify rows (``pick``) of the step of ``steps`` planned as ``p`` (prefill.plan over
    every row with several tokens, these included: their writes, their dense layers); None when
    it has none."""
    spec = pick(rt, steps)
    if not spec:
        return None
    rt.stats["spec_rows"] += len(spec)
    P = rt.P
    if any((s.seq_len - 1) // P > s.start // P + 1 for s in spec):
        raise ValueError(f"hisparse: a verify row spans more than two pages (page_size={P}); "
                         f"num_speculative_tokens must be below page_size")
    tok, req, irow, units, wlen = [], [], [], [], []
    for i, s in enumerate(spec):
        a = s.start // P
        for j in range(s.t1 - s.t0):
            tok.append(s.t0 + j)
            req.append(i)
            irow.append(s.irow)
            units.append(a)
            wlen.append(s.start + j + 1 - a * P)
    h = rt.h2d
    full = [s.start // P for s in spec]
    cols = [[a, (s.seq_len - 1) // P] for a, s in zip(full, spec)]
    bt = prefill.rows_of(rt, spec, block_table)
    win = torch.gather(bt.long(), 1, h(cols, torch.int64).to(bt.device))
    others = [s for s in p.dense if s not in spec]
    on_gpu = [s for s in others if s.freed[1] <= s.freed[0]]
    sp = replace(p, dense_sparse=dense_groups.make(rt, on_gpu, prefill.rows_of(rt, on_gpu,
                                                                               block_table)),
                 dense_freed=[s for s in others if s.freed[1] > s.freed[0]])
    return SpecRows(spec, h(tok, torch.int64), h(req, torch.int64), h(irow, torch.int64),
                    h(units, torch.int64), h(wlen, torch.int32), h([s.start + 1 for s in spec],
                                                                   torch.int64),
                    h(full, torch.int64),
                    h([s.freed[1] if s.freed[1] > s.freed[0] else 0 for s in spec], torch.int64),
                    h([s.row for s in spec], torch.int64), bt, win.to(rt.device), sp)


def attend(rt, layer: int, sr: SpecRows, q: torch.Tensor, kv: torch.Tensor, scale: float,
          out: torch.Tensor) -> None:
    """A sparse layer's attention of the verify rows (their K/V already written by prefill.layer
    with ``sr.sparse_plan``): q/out (T, Hq, D) the step's tokens, kv (blocks, 2, P, Hkv, D)."""
    ix, K, P = rt.ix, rt.k_sel, rt.P
    R, Tq, dev = len(sr.steps), sr.tok.shape[0], q.device
    qt = q[sr.tok]
    tok_scores = torch.empty(Tq, ix.U, dtype=torch.float32, device=dev)
    ix.score(layer, qt, sr.irow, sr.units, tok_scores)
    # units past a row's ``full`` may hold anything (the selection never reads them)
    scores = torch.full((R, ix.U), float("-inf"), dtype=torch.float32, device=dev)
    scores.scatter_reduce_(0, sr.req[:, None].expand(-1, ix.U), tok_scores, "amax")
    sel = torch.full((R, K), -1, dtype=torch.int32, device=dev)
    locs = torch.full_like(sel, -1)
    hs = rt.hot[layer]
    hot = {} if hs is None else dict(hot=sr.hot, rows=sr.rows, state=hs, host_pt=rt.host_pt.fetch,
                                     host=rt.host_layer(layer), kv=kv, counts=rt._hit_miss)
    decode_ops.select_resolve(scores, sr.seq, sr.full, K, sr.bt, sel, locs, **hot)
    Hkv, D = kv.shape[3], kv.shape[4]
    win = kv[sr.win].transpose(2, 3).reshape(R, 2 * P, 2, Hkv, D)     # pages a, b: (R, 2P, ...)
    o = kernels.sparse_decode_attention(qt, kv, locs[sr.req], sel[sr.req], sr.seq[sr.req].int(),
                                        scale, win[sr.req], sr.win_len)
    out[sr.tok] = o.to(out.dtype)


def multi_layer(rt, layer: int, p: StepPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """The rows of plan ``p`` with several tokens: prefill.layer (writes; dense attention of the
    prefill chunks, and of the verify rows in dense layers), then the verify rows' sparse
    attention in sparse layers. Arguments as prefill.layer."""
    sr = p.spec if layer not in rt.dense_layers else None
    prefill.layer(rt, layer, p if sr is None else sr.sparse_plan, q, k, v, kv, scale, out)
    if sr is not None:
        attend(rt, layer, sr, q, kv, scale, out)
