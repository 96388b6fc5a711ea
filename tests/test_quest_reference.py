"""Quest reference: per-page min/max kept up to date as tokens are written, page score bounds, and
top-page selection with the newest page always in."""
import pytest
import torch

from vllm_hisparse.ops import reference as ref


def brute_minmax(keys, page):
    n = keys.shape[0]
    pages = (n + page - 1) // page
    mn = torch.stack([keys[p * page:(p + 1) * page].amin(0) for p in range(pages)])
    mx = torch.stack([keys[p * page:(p + 1) * page].amax(0) for p in range(pages)])
    return mn, mx


@pytest.mark.parametrize("page", [1, 4, 16])
def test_update_incremental_equals_brute_force(page):
    R, U, H, D = 2, 20, 2, 8
    kmin = torch.randn(R, U, H, D)          # stale garbage must be overwritten at a page's 1st token
    kmax = torch.randn(R, U, H, D)
    n = int(torch.randint(page + 1, U * page, ()))
    keys = torch.randn(R, n, H, D)
    pre = int(torch.randint(1, n, ()))
    # prefill in one call (both rows), then token by token
    rows = torch.arange(R).repeat_interleave(pre)
    pos = torch.arange(pre).repeat(R)
    ref.quest_update(kmin, kmax, rows, pos, keys[:, :pre].reshape(-1, H, D), page)
    for t in range(pre, n):
        ref.quest_update(kmin, kmax, torch.arange(R), torch.full((R,), t), keys[:, t], page)
    for r in range(R):
        mn, mx = brute_minmax(keys[r], page)
        P = mn.shape[0]
        assert torch.equal(kmin[r, :P], mn) and torch.equal(kmax[r, :P], mx)


def test_scores_are_upper_bounds_and_match_formula():
    R, U, H, G, D, page = 2, 6, 2, 3, 8, 4
    keys = torch.randn(R, U * page, H, D)
    kmin, kmax = torch.zeros(R, U, H, D), torch.zeros(R, U, H, D)
    for r in range(R):
        kmin[r], kmax[r] = brute_minmax(keys[r], page)
    q = torch.randn(R, H * G, D)
    s = ref.quest_scores(q, kmin, kmax, torch.tensor([U, 3]))
    assert torch.isinf(s[1, 3:]).all() and (s[1, 3:] < 0).all()
    for r in range(R):
        for u in range(3):
            want = sum(torch.maximum(q[r, h] * kmin[r, u, h // G], q[r, h] * kmax[r, u, h // G]).sum()
                       for h in range(H * G))
            torch.testing.assert_close(s[r, u], want, rtol=1e-5, atol=1e-5)
            # an upper bound of the true summed q.k of every token of the page
            true = max(sum(q[r, h] @ keys[r, u * page + j, h // G] for h in range(H * G)) for j in range(page))
            assert s[r, u] >= true - 1e-4


def test_select_newest_first_top_by_score_and_padding():
    scores = torch.tensor([[5.0, 1.0, 9.0, 3.0, 7.0, -1.0],
                           [1.0, 2.0, float("-inf"), float("-inf"), float("-inf"), float("-inf")]])
    out = torch.empty(2, 3, dtype=torch.int32)
    ref.quest_select(scores, torch.tensor([21, 5]), 4, out)   # row0: 6 pages (newest 5), row1: 2 pages
    assert out[0].tolist() == [5, 2, 4]
    assert out[1].tolist() == [1, 0, -1]
    empty = torch.empty(1, 2, dtype=torch.int32)
    ref.quest_select(torch.full((1, 6), float("-inf")), torch.tensor([0]), 4, empty)
    assert empty.tolist() == [[-1, -1]]


def test_select_random_against_sort():
    R, U, k, page = 4, 50, 7, 16
    scores = torch.randn(R, U)
    lens = torch.randint(1, U * page, (R,))
    out = torch.empty(R, k, dtype=torch.int32)
    ref.quest_select(scores, lens, page, out)
    for r in range(R):
        n = int((lens[r] + page - 1) // page)
        want = [n - 1] + [u for u in torch.argsort(scores[r, :n], descending=True).tolist() if u != n - 1]
        got = [u for u in out[r].tolist() if u >= 0]
        assert got[0] == n - 1 and set(got) == set(want[:min(k, n)])
