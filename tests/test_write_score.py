"""The decode write and the Quest scores in one launch (ops/triton_write_score.py,
ops/decode_ops.decode_write_score) against the two things it fuses, on fresh random inputs: the
written bytes exactly as reference.decode_write writes them, the scores bit for bit as the
standalone Quest kernel gives them (and close to reference.quest_scores, which sums in another
order), pages at or past a row's count not scored (tiles wholly past it left as they were). On
CPU through Triton's interpreter, on the GPU for real."""
from __future__ import annotations

import pytest
import torch

from test_decode_ops import run_write, write_inputs
from triton_interpreter import run_cases

from vllm_hisparse.ops import decode_ops, reference
from vllm_hisparse.ops.triton_quest import block_u

# (N rows, P, Hkv, D, W pages per row, G query heads per KV head): tiles of 32 / 128 / 4 / 8
# pages (ops/triton_quest.block_u), so rows of 1, 1, 5 and 5 tiles
CASES = [(5, 16, 2, 64, 6, 2), (3, 2, 1, 32, 70, 4), (6, 4, 8, 128, 20, 4), (4, 2, 4, 128, 40, 1)]
SENTINEL = 123.0


def inputs(N, P, Hkv, D, W, G, gen, dev="cpu", dt=torch.float32):
    """write_inputs' rows, plus the scores' query, indexer rows (the rows the write folds into)
    and complete-page counts: a Quest row's count is its new token's page or less (the fused
    launch's contract); a row without a Quest write reads a row nobody writes (as dense and
    padding rows read the scratch row) and may count any number of pages, past U too."""
    t = write_inputs(N, P, Hkv, D, W, gen, dt=dt)
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page = t
    U = kmin.shape[1]
    written = set((q_page[q_page >= 0] // U).tolist())
    spare = [i for i in range(N + 1) if i not in written]     # rows no program writes into
    rows = torch.where(q_page >= 0, q_page // U, spare[-1])
    page = (seq - 1).clamp(min=0) // P
    lower = (torch.rand(N, generator=gen) * (page + 1).float()).long()     # 0 .. page
    full = torch.where(q_page >= 0, torch.where(torch.arange(N) % 3 == 2, lower, page),
                       torch.randint(0, 2 * U, (N,), generator=gen))
    bu = block_u(Hkv, D)
    quest = torch.nonzero((q_page >= 0) & (seq > 0))[:, 0].tolist()
    full[quest[0]] = page[quest[0]] // bu * bu     # its token's tile has no live page before it
    full[N // 2] = 2 * U - 1                       # (no Quest write) counts past U: the clamp
    q = torch.randn(N, Hkv * G, D, generator=gen).to(dt)
    out = torch.full((N, U), SENTINEL)
    return [x.to(dev) for x in t + [q, rows, full, out]]


def run(fn, t):
    """fn(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax, q_page, q, rows, full, out) on
    copies: (kv, dst, kmin, kmax, newest, out)."""
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page, q, rows, full, out = \
        [x.clone() for x in t]
    newest = torch.full((len(seq),), 7, dtype=torch.int32, device=kv.device)
    fn(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax, q_page, q, rows, full, out)
    return kv, dst, kmin, kmax, newest, out


def two_launches(quest_scores):
    def fn(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax, q_page, q, rows, full, out):
        decode_ops.decode_write(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax, q_page)
        quest_scores(q, kmin, kmax, rows, full, out, live_only=True)
    return fn


def compare(t, fused, quest_scores, skips_tiles=True):
    got = run(fused, t)
    written = run_write(reference.decode_write, t[:10])
    for name, a, b in zip(("kv", "dst", "kmin", "kmax", "newest"), written, got):
        assert torch.equal(a, b), f"{name} differs from reference.decode_write"
    assert not torch.equal(got[0], t[0]), "nothing was written"
    want = run(two_launches(quest_scores), t)[5]
    s, full, U = got[5], t[12], t[7].shape[1]
    live = torch.arange(U, device=s.device)[None, :] < full[:, None]
    assert live.any() and (~live).any()
    assert torch.equal(s, want), "scores differ from the standalone Quest kernel"
    past = s[~live]                       # a live tile's pages past the count score -inf
    assert ((past == SENTINEL) | (past == float("-inf"))).all(), "pages past a count were scored"
    if skips_tiles:                       # the kernels (the CPU reference writes -inf there)
        assert (past == SENTINEL).any(), "tiles wholly past a row's count were written"
    _, _, kmin, kmax, _ = written
    ref = reference.quest_scores(t[10].float().cpu(), kmin[t[11]].float().cpu(),
                                 kmax[t[11]].float().cpu(), full.cpu())
    torch.testing.assert_close(s.cpu()[live.cpu()], ref[live.cpu()], rtol=1e-5, atol=1e-4)


def test_cpu_path_meets_the_kernels_expectations():
    """On CPU decode_write_score is the two references in a row (the CPU engines' path): the
    same checks as the kernel's, the standalone scores from the CPU reference."""
    from vllm_hisparse.ops.quest import quest_scores_rows
    compare(inputs(*CASES[2], torch.Generator().manual_seed(3)), decode_ops.decode_write_score,
            quest_scores_rows, skips_tiles=False)


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1."""
    from vllm_hisparse.ops import triton_quest, triton_write_score
    for i, case in enumerate(CASES):
        t = inputs(*case, torch.Generator().manual_seed(80 + i))
        compare(t, triton_write_score.write_score, triton_quest.quest_scores_rows)
    print("interpreter ok")


def test_fused_kernel_in_interpreter():
    run_cases("test_write_score")


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + [(3, 16, 8, 128, 2048, 4)])
def test_gpu_write_score(case, dt):
    """The Llama-3-8B shape at 32K (2048 pages per row) among them."""
    from vllm_hisparse.ops.quest import quest_scores_rows
    t = inputs(*case, torch.Generator().manual_seed(90 + sum(case)), dev="cuda", dt=dt)
    compare(t, decode_ops.decode_write_score, quest_scores_rows)


def test_a_decode_batch_refuses_two_sparse_rows_on_one_indexer_row():
    """The fused launch's precondition, checked where the batch is filled: a shared indexer row
    would let one row's scores race another's write."""
    from types import SimpleNamespace

    from vllm_hisparse.core import decode_batch
    from vllm_hisparse.core.step_plan import ReqStep

    ix = SimpleNamespace(scratch=9, decode_unit=lambda irow, seq: irow * 100 + (seq - 1) // 16)
    rt = SimpleNamespace(P=16, scratch_row=7, ix=ix,
                         h2d=lambda a, out: out.copy_(torch.from_numpy(a)))
    db = decode_batch.DecodeBatch(4, "cpu")

    def step(i, irow):
        return ReqStep(i, f"r{i}", i, i + 1, 40, 41, i, True, (0, 0), irow)

    decode_batch.fill(rt, db, [step(0, 1), step(1, 2)], {})
    assert db.field("irow")[:2].tolist() == [1, 2]
    with pytest.raises(RuntimeError, match="share an indexer row"):
        decode_batch.fill(rt, db, [step(0, 3), step(1, 3)], {})
