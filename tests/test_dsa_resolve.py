"""Token-level RESOLVE episodes with MLA latent rows (576 bf16 values = 1152 B per token): the
existing opaque-row select_resolve (top-k + RESOLVE + miss copies from the host pool) driven by
the DSA indexer's logits over a growing context (the latent rows in core/host_pool.py's pool with
one token per page, written through as the context grows), with a hot buffer smaller than the context so
that rows miss; sparse-MLA decode attention over the hot slots RESOLVE returns must be
``torch.equal`` to the same computation over the fully resident latent KV, every step.

Three drivers of the same episode: the plain-torch reference (top_k 2048, on the CPU), the Triton
kernel through Triton's interpreter (smaller sizes: the interpreter is slow), and the Triton kernel
on a GPU with the host pool pinned (``-m cuda``); each under the served policies (lru, crf)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_interpreter import run_cases
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import indexers
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.ops import decode_ops, reference
from vllm_hisparse.ops.dsa_indexer import indexer_topk
from vllm_hisparse.ops.resolve_given import resolve_given, resolve_given_reference
from vllm_hisparse.ops.sparse_mla import LATENT_ROW, LATENT_ROW_BYTES, sparse_mla_decode
from vllm_hisparse.slots import HotBufferState

H_IDX, D_IDX = 8, 128          # indexer heads (DeepSeek-V3.2: 64) and index_head_dim
H_MLA = 4                      # attention heads of one rank (DeepSeek-V3.2: 128 / TP)
POLICIES = ["lru", "crf"]      # the served policies (slots.served())
POISON_ROWS = 5                # hot-buffer rows owned by no slot: must stay as they were


def episode(select, dev, K, S, starts, steps, seed, pinned_host=False, attend=sparse_mla_decode,
            heads=H_MLA, policy="lru"):
    """One episode: requests with contexts ``starts`` (some > S so that they miss, one may be
    < K) each decode ``steps`` tokens; every step one decode batch of len(starts) rows + one
    padding row goes through ``select`` (select_resolve's signature) on a hot buffer under
    ``policy``, and ``attend`` (sparse_mla_decode's signature) over the hot slots must equal it
    over the resident rows.
    Returns (hits, misses)."""
    g = torch.Generator().manual_seed(seed)
    R = len(starts)
    N, M = R + 1, R + 2                              # batch rows (last: padding), runtime rows
    C = max(starts) + steps                          # tokens per request at the end
    rows = torch.randperm(M, generator=g)[:N].long()  # runtime row of each batch row
    # the model's latent rows; fully resident, request i's token u is row i * C + u
    full = torch.randn(R * C, LATENT_ROW, generator=g).to(torch.bfloat16)
    # host pool (core/host_pool.py) with token pages: one page = one latent row (its K / V halves
    # are the row's two halves, 1152 B a page); pages handed out as contexts grow, interleaved
    pool = HostKVPool(1, R * C, 1, 1, LATENT_ROW // 2, torch.bfloat16, pin=pinned_host)
    assert pool.page_bytes(1, 1, LATENT_ROW // 2, torch.bfloat16) == LATENT_ROW_BYTES
    host = pool.data[0].view(R * C, LATENT_ROW)
    keys = [None] * M
    for i in range(R):
        keys[int(rows[i])] = i

    def write_through(i, lo, hi):                    # request i's tokens [lo, hi) to the pool
        pages = pool.ensure(i, hi)
        host[torch.tensor(pages[lo:hi])] = full[i * C + lo:i * C + hi]

    for lo in range(0, max(starts), 97):             # the prompts, in interleaved chunks
        for i in range(R):
            if lo < starts[i]:
                write_through(i, lo, min(lo + 97, starts[i]))
    # hot buffer: S slots per request at random physical rows, + rows nobody owns, all poison
    kv = torch.randn(N * S + POISON_ROWS, LATENT_ROW, generator=g).to(torch.bfloat16) * 100
    # a row's block table: its S hot slots first (select_resolve's contract), then columns up to
    # C that a resident row would read (never read here: every row resolves through its slots)
    bt = torch.cat([torch.randperm(N * S, generator=g).int().view(N, S),
                    torch.zeros(N, C - S, dtype=torch.int32)], 1)
    poison = kv[N * S:].clone()
    counts = torch.zeros(3, dtype=torch.int64)       # [hits, misses, block-table pages]
    # the DSA indexer (core/indexers/dsa) holds the requests' indexer keys, one row each
    cfg = HiSparseConfig(indexer="dsa", top_k=K, device_buffer_size=S, dense_layers=())
    ix = indexers.get("dsa")(cfg, 1, M, C, 1, D_IDX, torch.bfloat16, "cpu")
    k_idx = torch.randn(R, C, D_IDX, generator=g)

    def add_tokens(lo, hi):                           # tokens [lo[i], hi[i]) of every request
        upd = ix.plan_tokens(lo, hi, rows[:R].numpy())
        kk = torch.cat([k_idx[i, lo[i]:hi[i]] for i in range(R)])
        ix.update(0, ix.device_update({n: torch.from_numpy(a) for n, a in upd.items()}), kk)

    seq = np.array(starts, dtype=np.int64)
    add_tokens(np.zeros(R, dtype=np.int64), seq)
    scale = 192 ** -0.5
    to = (lambda t: t.to(dev)) if dev != "cpu" else (lambda t: t)
    host_d = host if pinned_host else to(host)
    state = HotBufferState.create(M, S, C, policy, dev)
    kv_d, counts_d = to(kv), to(counts)
    for step in range(steps):
        seq_b = torch.from_numpy(np.append(seq, 0))                 # the padding row: seq 0
        q, w = torch.randn(N, H_IDX, D_IDX, generator=g), torch.rand(N, H_IDX, generator=g)
        scores = torch.empty(N, C, dtype=torch.float32)
        ix.score(0, (q, w), rows, seq_b, scores)
        sel = torch.full((N, K), -7, dtype=torch.int32)
        locs = torch.full_like(sel, -7)
        sel_d, locs_d = to(sel), to(locs)
        host_pt = pool.page_table_tensor(keys, C)    # (M, C): host page of each token, -1 after
        select(to(scores), to(seq_b), to(seq_b), K, to(bt), sel_d, locs_d,
               hot=to(seq_b), rows=to(rows), state=state,           # every token: slots
               host_pt=to(host_pt), host=host_d, kv=kv_d, counts=counts_d)
        sel, locs, kvc = sel_d.cpu(), locs_d.cpu(), kv_d.cpu()
        assert (sel[R] == -7).all() and (locs[R] == -7).all(), "the padding row was written"
        want = indexer_topk(scores[:R], seq_b[:R], K)
        for i in range(R):                            # the indexer's top-k, as a set
            assert sorted(x for x in sel[i].tolist() if x >= 0) == sorted(
                x for x in want[i].tolist() if x >= 0), (step, i)
        # attention over the hot slots == over the resident latent KV, bit for bit
        ql = torch.randn(R, heads, 512, generator=g).to(torch.bfloat16)
        qpe = torch.randn(R, heads, 64, generator=g).to(torch.bfloat16)
        res_idx = torch.where(sel[:R] >= 0, sel[:R] + torch.arange(R)[:, None] * C, -1)
        assert torch.equal(kvc[locs[:R].long().clamp(min=0)][sel[:R] >= 0],
                           full[res_idx.long().clamp(min=0)][sel[:R] >= 0]), "wrong latent rows"
        got = attend(to(ql), to(qpe), kv_d, locs_d[:R], scale)
        ref = attend(to(ql), to(qpe), to(full), to(res_idx.int()), scale)
        assert torch.equal(got, ref), step
        assert torch.equal(kvc[N * S:], poison), "a row owned by no slot was written"
        su_c = state.slot_unit.cpu()
        for i in range(R):                            # every occupied slot holds its token's row
            held = su_c[rows[i]]
            occ = held >= 0
            assert torch.equal(kvc[bt[i, :S][occ].long()], full[i * C + held[occ].long()]), i
        add_tokens(seq, seq + 1)                      # the step's new token: indexer key,
        for i in range(R):                            # latent row through to the host pool
            write_through(i, int(seq[i]), int(seq[i]) + 1)
        seq = seq + 1
    hits, misses, on_bt = (int(x) for x in counts_d.cpu())
    assert on_bt == 0
    return hits, misses


def _ref_select(scores, seq, full, k, bt, sel, locs, **kw):
    decode_ops.select_resolve(scores, seq, full, k, bt, sel, locs, **kw)


def given(resolve):
    """select_resolve's signature over ``resolve`` (resolve_given's): the rows' selection is the
    indexer's own top-k in its own order (what the GPU hook gets from vLLM, docs/dsa.md
    section 4), not select_resolve's ascending one."""
    def select(scores, seq, full, k, bt, sel, locs, hot, rows, state, host_pt, host, kv, counts):
        mine = indexer_topk(scores.cpu(), seq.cpu(), k).to(sel.device)   # descending logit
        sel.copy_(torch.where((seq > 0)[:, None], mine, sel))
        resolve(sel, seq, bt, locs, hot, rows, state, host_pt, host, kv, counts)
    return select


@pytest.mark.parametrize("policy", POLICIES)
def test_resolve_episode_given_selection_order(policy):
    """The selection as vLLM's indexer hands it over (not sorted): hot == resident still."""
    hits, misses = episode(given(resolve_given_reference), "cpu", K=2048, S=2560,
                           starts=[4000, 3100, 1500], steps=3, seed=2, policy=policy)
    assert misses > 0 and hits > 0


def test_resolve_episode_reference_top2048():
    """top_k 2048, hot buffer 2560 rows, contexts of 1500 (fits, never misses) to 4000."""
    assert decode_ops.select_resolve is not None and reference.select_resolve is not None
    hits, misses = episode(_ref_select, "cpu", K=2048, S=2560, starts=[4000, 3100, 1500],
                           steps=4, seed=1)
    assert misses > 0 and hits > 0


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import decode_ops as dops
    from vllm_hisparse.ops import triton_select

    def tri(scores, seq, full, k, bt, sel, locs, **kw):
        work = tuple(torch.empty(s, dtype=torch.int32)
                     for s in dops.workspace_shapes(scores.shape[0], k, kw["state"].slots))
        triton_select.select_resolve(scores, seq, full, k, bt, sel, locs, *work, **kw)

    from vllm_hisparse.ops import triton_resolve_given as trg
    from vllm_hisparse.ops.resolve_given import workspace_shapes

    def tri_given(sel, seq, bt, locs, hot, rows, state, host_pt, host, kv, counts):
        work = tuple(torch.empty(s, dtype=torch.int32)
                     for s in workspace_shapes(sel.shape[0], sel.shape[1], state.slots))
        trg.resolve_given(sel, seq, bt, locs, *work, hot, rows, state, host_pt, host, kv, counts)

    for seed, (K, S, starts) in enumerate([(64, 80, [200, 130, 50]), (32, 33, [97, 33, 31])]):
        for fn in (tri, given(tri_given)):
            for policy in POLICIES:
                hits, misses = episode(fn, "cpu", K, S, starts, steps=3, seed=10 + seed,
                                       policy=policy)
                assert misses > 0 and hits > 0
    print("interpreter ok")


def test_resolve_episode_triton_interpreter():
    run_cases("test_dsa_resolve")


def fa3_sparse_mla(ql, q_pe, kv, idx, scale):
    """vLLM 0.26's FLASH_ATTN_MLA_SPARSE call (flashattn_mla_sparse.py forward_mqa) on latent rows
    kv (M, 576) with global row indices idx (R, K), valid entries first."""
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func
    R = ql.shape[0]
    return flash_attn_varlen_func(
        q=q_pe, k=kv[:, 512:].view(-1, 1, 1, 64), v=kv[:, :512].view(-1, 1, 1, 512), q_v=ql,
        max_seqlen_q=1, cu_seqlens_q=torch.arange(R + 1, dtype=torch.int32, device=ql.device),
        max_seqlen_k=idx.shape[1], seqused_k=(idx >= 0).sum(1).int(), block_table=idx.int(),
        softmax_scale=scale, causal=True, fa_version=3)


@pytest.mark.cuda
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("attend", ["reference", "fa3"])
@pytest.mark.parametrize("resolve", ["select_resolve", "resolve_given"])
def test_resolve_episode_gpu(attend, resolve, policy):
    """The Triton kernels on the GPU, the host pool pinned (read through its UVA alias): top-k +
    RESOLVE over the logits, or RESOLVE of the indexer's own selection; attention by the
    reference or by vLLM's own FA3 sparse MLA call (128 heads: DeepSeek-V3.2 at TP 1)."""
    fn, heads = (sparse_mla_decode, H_MLA) if attend == "reference" else (fa3_sparse_mla, 128)
    sel_fn = decode_ops.select_resolve if resolve == "select_resolve" else given(resolve_given)
    hits, misses = episode(sel_fn, "cuda", K=2048, S=2560,
                           starts=[32768, 9000, 1500], steps=4, seed=3, pinned_host=True,
                           attend=fn, heads=heads, policy=policy)
    assert misses > 0 and hits > 0


@pytest.mark.cuda
def test_fa3_sparse_mla_matches_the_reference():
    """vLLM's FA3 sparse MLA vs the plain-torch reference, both against fp64: FA3's error at most
    2x that of the same computation in torch bf16 (+ a floor for exact ties)."""
    g = torch.Generator().manual_seed(9)
    R, H, N, K = 5, 128, 4000, 2048
    kv = torch.randn(N, 576, generator=g).to(torch.bfloat16).cuda()
    ql = torch.randn(R, H, 512, generator=g).to(torch.bfloat16).cuda()
    qpe = torch.randn(R, H, 64, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(R)]).int().cuda()
    idx[1, 1000:] = -1
    scale = 192 ** -0.5
    truth = sparse_mla_decode(ql.double(), qpe.double(), kv.double(), idx, scale)
    fa = fa3_sparse_mla(ql, qpe, kv, idx, scale).double()
    c = kv[idx.long().clamp(min=0)]                                  # torch, all in bf16
    s = (torch.einsum("rhl,rkl->rhk", ql, c[..., :512]) + torch.einsum(
        "rhd,rkd->rhk", qpe, c[..., 512:])) * scale
    p = torch.softmax(s.masked_fill((idx < 0)[:, None], float("-inf")), -1)
    tb = torch.einsum("rhk,rkl->rhl", p, c[..., :512]).double()
    assert (fa - truth).abs().max() <= 2 * (tb - truth).abs().max() + 1e-3
