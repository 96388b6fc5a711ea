"""Every Triton kernel of the decode path compiles for the H200 (sm_90) with the launch parameters
its launcher picks, Llama-3-8B's attention shape (32 query / 8 KV heads, D 128, 16-token pages,
bf16): compiled by Triton's NVIDIA backend on the CPU (tests/triton_sm90.py), not run. What the
kernels compute is tested against the references in the interpreter and on the GPU."""
from __future__ import annotations

import pytest
import torch

from test_decode_ops import select_inputs, write_inputs
from test_kernels_attention import _newest_inputs
from test_quest_rows import random_inputs
from test_quest_update import make_case
from triton_sm90 import compile_only, ptxas_available

pytestmark = pytest.mark.skipif(not ptxas_available(), reason="Triton's ptxas is not installed")

BF = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("bits,policy", [(8, "lru"), (11, "lru"), (8, "crf")])
def test_select_resolve_compiles(bits, policy, monkeypatch):
    from vllm_hisparse.ops import decode_ops, triton_select
    monkeypatch.setattr(triton_select, "RADIX_BITS", bits)
    N, P, Hkv, D, U, k, S = 4, 16, 8, 128, 2048, 128, 256
    t = select_inputs(N, P, Hkv, D, U, k, S, torch.Generator().manual_seed(0), policy=policy)
    t["kv"], t["host"] = t["kv"].to(BF), t["host"].to(BF)
    work = tuple(torch.zeros(s, dtype=torch.int32) for s in decode_ops.workspace_shapes(N, k, S))
    scores = torch.randn(N, U)
    sel = torch.zeros(N, k, dtype=torch.int32)
    locs = sel.clone()
    with compile_only() as seen:
        triton_select.select_resolve(scores, t["seq"], t["full"], k, t["bt"], sel, locs, *work,
                                     hot=t["hot"], rows=t["rows"], state=t["state"],
                                     host_pt=t["host_pt"], host=t["host"], kv=t["kv"],
                                     counts=t["counts"])
        triton_select.select_resolve(scores, t["seq"], t["full"], k, t["bt"], sel, locs, *work)
    assert seen == {"_select_kernel", "_miss_io_kernel"}


def test_decode_write_compiles():
    from vllm_hisparse.ops import triton_decode_write
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page = write_inputs(
        8, 16, 8, 128, 4, torch.Generator().manual_seed(1), dt=BF)
    newest = torch.zeros(8, dtype=torch.int32)
    with compile_only() as seen:
        triton_decode_write.decode_write(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax,
                                         q_page)
        triton_decode_write.decode_write(kv, k, v, bt, seq, newest, dst, dst_page)
    assert seen == {"_decode_write_kernel"}


def test_write_score_compiles():
    from test_write_score import inputs

    from vllm_hisparse.ops import triton_write_score
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page, q, rows, full, out = inputs(
        8, 16, 8, 128, 64, 4, torch.Generator().manual_seed(5), dt=BF)
    newest = torch.zeros(8, dtype=torch.int32)
    with compile_only() as seen:
        triton_write_score.write_score(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax,
                                       q_page, q, rows, full, out)
        triton_write_score.write_score(kv, k, v, bt, seq, newest, None, None, kmin, kmax,
                                       q_page, q, rows, full, out)
    assert seen == {"_write_score_kernel"}


@pytest.mark.parametrize("live_only", [False, True])
def test_quest_scores_compile(live_only):
    from vllm_hisparse.ops import triton_quest
    q, kmin, kmax, rows, n = random_inputs(4, 6, 2048, 8, 4, 128, BF,
                                           torch.Generator().manual_seed(2))
    out = torch.empty(4, 2048)
    with compile_only() as seen:
        triton_quest.quest_scores_rows(q, kmin, kmax, rows, n, out, live_only=live_only)
    assert seen == {"_quest_rows_kernel"}


def test_quest_update_compiles():
    from vllm_hisparse.ops import triton_quest_update
    kmin, kmax, page, new, tp, k, *_ = make_case("mixed", BF, 3)
    with compile_only() as seen:
        triton_quest_update.quest_update_pages(kmin, kmax, page, new, tp, k)
    assert seen == {"_quest_update_kernel"}


def test_sparse_attention_compiles():
    from vllm_hisparse.ops import triton_attention
    q, kv, locs, units, seq, newest, _, _ = _newest_inputs(
        4, 32, 8, 128, 16, 128, BF, torch.Generator().manual_seed(4), dev="cpu")
    out = torch.empty_like(q)
    with compile_only() as seen:
        triton_attention.sparse_decode_attention_newest(q, kv, locs, units, seq, newest, 0.1, out)
    assert seen == {"_split_kernel", "_combine_kernel"}


@pytest.mark.parametrize("rows", [False, True])
def test_dense_decode_compiles(rows):
    from vllm_hisparse.ops import triton_dense_decode as td
    g = torch.Generator().manual_seed(5)
    R, Hq, Hkv, D, P, W = 3, 32, 8, 128, 16, 20
    q = torch.randn(R, Hq, D, generator=g).to(BF)
    kv = torch.randn(R * W + 2, 2, P, Hkv, D, generator=g).to(BF)
    bt = torch.randperm(R * W + 2, generator=g)[:R * W].view(R, W).int()
    seq = torch.tensor([1, 200, W * P], dtype=torch.int32)
    table_rows = torch.tensor([2, 0, 1]) if rows else None
    n_o, n_m = td.partials_numel(R, Hq, D)
    work = (torch.empty(n_o), torch.empty(n_m))
    with compile_only() as seen:
        td.dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.1, table_rows=table_rows,
                                  work=work)
    assert seen == {"_dense_split_kernel", "_ordered_combine_kernel"}


def test_decode_attention_compiles():
    """Both variants of the split launch: every page resident, and misses read from the host."""
    from test_decode_attention import fused, mixed_batch, with_misses
    from vllm_hisparse.ops import triton_decode_attention as tda
    gen = torch.Generator().manual_seed(6)
    t = mixed_batch(4, 32, 8, 128, 16, 128, 4096, BF, gen)
    m, miss = with_misses(t, gen)
    work = tuple(torch.empty(n, dtype=torch.float32)
                 for n in tda.partials_numel(4, 32, 8, 128, 16, 128))
    with compile_only() as seen:
        fused(*t, 0.1)
        tda.decode_attention(*m[:-1], 0.1, m[-1], work, miss)
    assert seen == {"_mixed_split_kernel", "_mixed_combine_kernel"}


@pytest.mark.parametrize("policy", ["lru", "crf"])
def test_resolve_given_compiles(policy):
    from test_resolve_given import make, selection, step
    from vllm_hisparse.ops import resolve_given as rg, triton_resolve_given as trg
    N, M, S, U, K = 4, 6, 2560, 4096, 2048
    gen = torch.Generator().manual_seed(7)
    t = make(N, M, S, U, K, gen, policy)

    def tri(sel, seq, bt, locs, hot, rows, state, host_pt, host, kv, counts):
        work = tuple(torch.empty(s, dtype=torch.int32)
                     for s in rg.workspace_shapes(sel.shape[0], sel.shape[1], state.slots))
        trg.resolve_given(sel, seq, bt, locs, *work, hot, rows, state, host_pt, host, kv, counts)

    with compile_only() as seen:
        step(tri, t, selection(N, U, K, gen))
    assert seen == {"_resolve_given_kernel", "_miss_rows_kernel"}


@pytest.mark.parametrize("policy", ["lru", "crf"])
def test_latent_index_kernels_compile(policy):
    """ops/triton_latent_index.py at DSA's K = 2048 (an 8-token call, 3 decode entries, 2560
    slots): the convert launch pair, region_rows and valid_counts."""
    from test_resolve_given import make
    from vllm_hisparse.ops import latent_index as li, triton_latent_index as tli
    T, n, M, S, U, K = 8, 3, 6, 2560, 4096, 2048
    t = make(n, M, S, U, K, torch.Generator().manual_seed(8), policy)
    topk = torch.randint(-1, U, (T, K), dtype=torch.int32)
    out, valid = torch.empty(T + 1, K, dtype=torch.int32), torch.empty(T, dtype=torch.int32)
    sel, locs = torch.empty(n, K, dtype=torch.int32), torch.empty(n, K, dtype=torch.int32)
    base = torch.tensor([-2, 0, 4096, -1, -2, -2, 0, 0])
    i64 = dict(dtype=torch.int64)
    work = tuple(torch.empty(s, dtype=torch.int32) for s in li.workspace_shapes(n, K, S))
    with compile_only() as seen:
        tli.convert_rows(topk, base, U, torch.tensor([0, 4, 5], **i64),
                         torch.tensor([0, 4, 5], **i64), torch.full((n,), U, **i64), t["bt"],
                         torch.ones(n, **i64), t["rows"], t["state"], t["host_pt"], t["host"],
                         t["kv"], t["counts"], sel, locs, out, valid, *work)
        tli.region_rows(topk, base, U, out[:T], valid)
        tli.valid_counts(out[:T], valid)
    assert seen == {"_convert_kernel", "_miss_rows_kernel", "_valid_counts_kernel"}


def test_latent_write_compiles():
    """ops/triton_latent_write.py: bf16 [kv_c, k_pe] from two strided parts with a host pool, and
    fp8_ds_mla's 656 packed bytes as one part without one (resident mode)."""
    from vllm_hisparse.ops import triton_latent_write as tlw
    T = 4
    row = torch.tensor([0, -1, 3, 1])
    src = torch.zeros(T, 600, dtype=BF)
    packed = torch.zeros(T, 656, dtype=torch.uint8)
    with compile_only() as seen:
        tlw.write_rows(src[:, :512], src[:, 520:584], torch.zeros(5, 576, dtype=BF), row,
                       torch.zeros(5, 576, dtype=BF), row)
        tlw.write_rows(packed, None, None, row, torch.zeros(5, 656, dtype=torch.uint8), row)
    assert seen == {"_write_rows_kernel"}


def test_latent_plan_compiles():
    """ops/triton_latent_plan.py: the plan's buffers from the base plan, with a host page table
    and without one (resident mode)."""
    from vllm_hisparse.ops import triton_latent_plan as tlp
    T, D = 8192, 64
    base = torch.zeros(3 * T + 4 * D, dtype=torch.int64)
    meta, host_row = torch.empty_like(base), torch.empty(T, dtype=torch.int64)
    with compile_only() as seen:
        tlp.materialize(base, meta, host_row, torch.zeros(4, 40976, dtype=torch.int32), 3, T, D)
        tlp.materialize(base, meta, host_row, None, 1, T, D)
    assert seen == {"_materialize_kernel"}
