"""The decode batch's fused ops (ops/decode_ops.py): decode_write and select_resolve.

The references are checked against computations of their own (a per-row loop; the selection's
defining property and the resolve invariants), then the Triton kernels against the references, bit
for bit, on fresh random inputs: on CPU through Triton's interpreter, on the GPU for real."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import run_cases

from vllm_hisparse.ops import decode_ops, reference
from vllm_hisparse.slots import HotBufferState, served
from vllm_hisparse.slots.crf import HIT

# (N rows, P, Hkv, D, W blocks per row)
WRITE_CASES = [(5, 16, 2, 64, 6), (3, 4, 1, 32, 9), (8, 16, 8, 128, 4)]
# (N rows, P, Hkv, D, U pages per row, k selected, S slots)
SELECT_CASES = [(4, 4, 2, 32, 40, 5, 8), (3, 2, 1, 16, 70, 31, 33), (5, 4, 2, 16, 33, 32, 32),
                (2, 4, 1, 16, 300, 16, 17), (7, 4, 2, 16, 40, 8, 12)]
STEPS = 6
POLICIES = served()          # every policy the kernel has a branch for


def write_inputs(N, P, Hkv, D, W, gen, dev="cpu", dt=torch.float32):
    blocks = N * W + 3
    kv = torch.randn(blocks, 2, P, Hkv, D, generator=gen).to(dt)
    bt = torch.randperm(blocks, generator=gen)[:N * W].view(N, W).int()
    seq = torch.randint(1, W * P + 1, (N,), generator=gen)
    seq[0] = 0                                          # a padding row
    seq[1] = P + 1 if N > 2 else seq[1]                 # a page's first token
    k = torch.randn(N, Hkv, D, generator=gen).to(dt)
    v = torch.randn(N, Hkv, D, generator=gen).to(dt)
    dst = torch.randn(N + 4, 2, P, Hkv, D, generator=gen).to(dt)
    dst_page = torch.randperm(N + 4, generator=gen)[:N]
    dst_page[-1] = -1
    R, U = N + 1, W
    kmin = torch.randn(R, U, Hkv, D, generator=gen).to(dt)
    kmax = kmin + torch.rand(R, U, Hkv, D, generator=gen).to(dt)
    qrow = torch.randperm(R, generator=gen)[:N]
    q_page = qrow * U + (seq - 1).clamp(min=0) // P
    q_page[N // 2] = -1
    t = [kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page]
    return [x.to(dev) for x in t]


def write_loop(kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page):
    """decode_write row by row, the obvious way (the reference's reference)."""
    P = kv.shape[2]
    newest = torch.full((len(seq),), -1, dtype=torch.int32)
    for r in range(len(seq)):
        if seq[r] <= 0:
            continue
        pos = int(seq[r]) - 1
        b, off = int(bt[r, pos // P]), pos % P
        newest[r] = b
        kv[b, 0, off], kv[b, 1, off] = k[r], v[r]
        if dst_page[r] >= 0:
            dst[dst_page[r], 0, off], dst[dst_page[r], 1, off] = k[r], v[r]
        if q_page[r] >= 0:
            U = kmin.shape[1]
            qr, pg = divmod(int(q_page[r]), U)
            if off == 0:
                kmin[qr, pg], kmax[qr, pg] = k[r], k[r]
            else:
                kmin[qr, pg] = torch.minimum(kmin[qr, pg], k[r])
                kmax[qr, pg] = torch.maximum(kmax[qr, pg], k[r])
    return newest


def run_write(fn, t):
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page = [x.clone() for x in t]
    newest = torch.full((len(seq),), 7, dtype=torch.int32, device=kv.device)
    fn(kv, k, v, bt, seq, newest, dst, dst_page, kmin, kmax, q_page)
    return kv, dst, kmin, kmax, newest


@pytest.mark.parametrize("case", WRITE_CASES)
def test_decode_write_reference_equals_loop(case):
    t = write_inputs(*case, torch.Generator().manual_seed(sum(case)))
    got = run_write(reference.decode_write, t)
    kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page = [x.clone() for x in t]
    newest = write_loop(kv, bt, seq, k, v, dst, dst_page, kmin, kmax, q_page)
    for a, b in zip(got, (kv, dst, kmin, kmax, newest)):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], t[0]), "nothing was written"


def select_inputs(N, P, Hkv, D, U, k, S, gen, dev="cpu", policy="lru"):
    """N rows over a (M = N + 2)-row state: row 0 padding, the last one resident (hot 0, when N > 2),
    rows 3, 5, ... before it partially spilled (pages [hot, full) in the block table, hot >= S as
    in the runtime, moved up by ``advance``), the rest hot (every page through the slots, hot >
    full); rows 3 and 4 with seeded slots; scores rounded so ties happen; a host pool of distinct
    bytes per page."""
    M = N + 2
    W = U + 1
    blocks = N * W + 2
    kv = torch.full((blocks, 2, P, Hkv, D), float("nan"))
    bt = (torch.randperm(blocks - 2, generator=gen)[:N * W] + 2).view(N, W).int()
    host = torch.randn(N * U + 5, 2, P, Hkv, D, generator=gen)
    host_pt = torch.full((M, U), -1, dtype=torch.int32)
    rows = torch.randperm(M, generator=gen)[:N]
    for i in range(N):
        host_pt[rows[i]] = torch.randperm(N * U + 5, generator=gen)[:U].int()
    seq = torch.full((N,), U * P + 1, dtype=torch.int64)
    seq[0] = 0
    full = torch.randint(1, U + 1, (N,), generator=gen)
    full[1] = min(k, U)                                  # exactly k pages: all taken
    if N > 3:
        full[2] = 0                                      # no complete page yet: all -1
    hot = torch.full((N,), U + 1, dtype=torch.int64)
    for i in range(3, N - 1, 2):
        full[i] = U
        hot[i] = int(torch.randint(S, max(S, U - 4) + 1, (1,), generator=gen))
    if N > 2:
        hot[-1] = 0
    # rows 3 (partially spilled) and 4 (hot) seeded when N > 5 / 6 (core/hot_rows.py): slot s holds
    # page s for s < S - 1, its block holding the page's bytes; one slot left empty, a victim
    # before any seeded one
    seeded = [i for i in (3, 4) if i < N - 1]
    for i in seeded:
        kv[bt[i, :S - 1].long()] = host[host_pt[rows[i], :S - 1].long()]
    t = dict(kv=kv, bt=bt, host=host, host_pt=host_pt, rows=rows, seq=seq, full=full, hot=hot,
             counts=torch.zeros(3, dtype=torch.int64))
    t = {n: v.to(dev) for n, v in t.items()}
    t["state"] = HotBufferState.create(M, S, U, policy, dev)
    for i in seeded:
        t["state"].seed(int(rows[i]), S - 1)
    return t


def advance(t, by=2):
    """The KV manager takes more blocks from the partially spilled rows: their hot boundary moves
    up (never down), as freed_pages' does when keep shrinks."""
    U = t["host_pt"].shape[1]
    part = (t["hot"] > 0) & (t["hot"] <= U)
    t["hot"].copy_(torch.where(part, (t["hot"] + by).clamp(max=U), t["hot"]))


def clone_state(st: HotBufferState) -> HotBufferState:
    return HotBufferState.wrap(st.slot_unit.clone(), st.unit_slot.clone(),
                               {n: x.clone() for n, x in st.pstate.items()}, st.policy)


def policy_state(st: HotBufferState) -> torch.Tensor:
    return st.pstate[st.policy.kernel_state]


def random_scores(N, U, gen, dev):
    return (torch.randn(N, U, generator=gen) * 4).round().div(4).to(dev)   # many ties


def run_select(fn, t, scores, k, work=None, fetch=True):
    """sel, locs of one step; t["missed"] the step's per-row miss flags (-7 before it)."""
    N = scores.shape[0]
    sel = torch.full((N, k), -7, dtype=torch.int32, device=scores.device)
    locs = torch.full_like(sel, -7)
    t["missed"] = torch.full((N,), -7, dtype=torch.int32, device=scores.device)
    kw = {} if work is None else {"work": work}
    if not fetch:
        kw["fetch"] = False
    fn(scores, t["seq"], t["full"], k, t["bt"], sel, locs, hot=t["hot"], rows=t["rows"],
       state=t["state"], host_pt=t["host_pt"], host=t["host"], kv=t["kv"], counts=t["counts"],
       missed=t["missed"], **kw)
    return sel, locs


def check_select_properties(t, scores, k, sel, locs, before, us_before):
    """What the selection and RESOLVE must satisfy, checked without the reference's code
    (us_before: the page table before the step)."""
    st = t["state"]
    su, us, ps = st.slot_unit, st.unit_slot, policy_state(st)
    for r in range(scores.shape[0]):
        n = int(t["full"][r])
        if int(t["seq"][r]) == 0:
            assert (sel[r] == -7).all() and (locs[r] == -7).all(), "padding row written"
            assert int(t["missed"][r]) == 0, "a padding row flagged as missed"
            continue
        got = [int(x) for x in sel[r] if x >= 0]
        assert got == sorted(got) and len(got) == min(n, k)
        if n > k:                   # every unselected live score <= every selected one
            s = scores[r, :n]
            chosen = torch.zeros(n, dtype=torch.bool)
            chosen[got] = True
            assert s[~chosen].max() <= s[chosen].min()
        h = int(t["hot"][r])
        for j, p in enumerate(got):
            b = int(locs[r, j])
            if p >= h:              # resident, or kept by a partially spilled row
                assert b == int(t["bt"][r, p])
            else:                   # resident now, in one of the row's S hot blocks, holding p
                row = int(t["rows"][r])
                slot = int(us[row, p])
                assert slot >= 0 and int(su[row, slot]) == p and b == int(t["bt"][r, slot])
                hp = int(t["host_pt"][row, p])
                assert torch.equal(t["kv"][b], t["host"][hp]), "wrong bytes in the hot block"
        got = [p for p in got if p < h]                  # the pages of the hot slots
        row = int(t["rows"][r])
        assert int(t["missed"][r]) == any(int(us_before[row, p]) < 0 for p in got), \
            "the row's miss flag"
        if h and not got:
            assert torch.equal(before[row], ps[row]), "a row with no slot page was touched"
        if h and st.policy.name == "lru":
            lru = ps
            assert sorted(lru[row].tolist()) == list(range(lru.shape[1]))
            assert (before[row] == lru[row]).all() or set(lru[row, :len(got)].tolist()) == {
                int(us[row, p]) for p in got}, "the selected slots are not the most recent"
        if h and st.policy.name == "crf":   # empty slots hold -1; this step's units >= HIT // 2
            assert torch.equal(ps[row] == -1, su[row] == -1)
            assert all(int(ps[row, int(us[row, p])]) >= HIT // 2 for p in got)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", SELECT_CASES)
def test_select_resolve_reference_properties(case, policy):
    N, P, Hkv, D, U, k, S = case
    gen = torch.Generator().manual_seed(sum(case))
    t = select_inputs(*case, gen, policy=policy)
    total = on_bt = 0
    for step in range(STEPS):
        if step == STEPS // 2:
            advance(t)
        scores = random_scores(N, U, gen, "cpu")
        before = policy_state(t["state"]).clone()
        us_before = t["state"].unit_slot.clone()
        sel, locs = run_select(decode_ops.select_resolve, t, scores, k)
        check_select_properties(t, scores, k, sel, locs, before, us_before)
        live = t["seq"] > 0
        total += int((sel[live] >= 0).sum())
        on_bt += int(((sel >= t["hot"][:, None]) & live[:, None]).sum())
    # every selected page counted once: a hit or a miss of the slots, or a block-table page
    assert int(t["counts"].sum()) == total and int(t["counts"][2]) == on_bt
    assert int(t["counts"][1]) > 0 and (N < 3 or on_bt > 0)


def test_unfetched_select_then_fetch_marked_equals_the_fetching_select():
    """select_resolve(fetch=False) leaves its misses marked -2 - block and kv untouched;
    reference.fetch_marked then copies them: the locs and bytes of select_resolve(fetch=True)."""
    case = SELECT_CASES[0]
    N, P, Hkv, D, U, k, S = case
    gen = torch.Generator().manual_seed(7)
    a = select_inputs(*case, gen)
    b = {n: (clone_state(v) if n == "state" else v.clone()) for n, v in a.items()}
    marked = 0
    for step in range(STEPS):
        scores = random_scores(N, U, gen, "cpu")
        want = run_select(reference.select_resolve, a, scores, k)
        kv_before = b["kv"].clone()
        sel, locs = run_select(reference.select_resolve, b, scores, k, fetch=False)
        assert torch.equal(b["kv"].nan_to_num(-9.0), kv_before.nan_to_num(-9.0)), "kv written"
        marked += int((locs[b["seq"] > 0] <= -2).sum())       # padding rows keep their -7
        got = reference.fetch_marked(b["kv"], locs, sel, b["seq"], b["rows"], b["host_pt"],
                                     b["host"])
        assert torch.equal(sel, want[0]) and torch.equal(got, want[1]), f"step {step}"
        assert torch.equal(a["kv"].nan_to_num(-9.0), b["kv"].nan_to_num(-9.0)), f"step {step}"
        assert torch.equal(a["state"].slot_unit, b["state"].slot_unit)
    assert marked == int(a["counts"][1]) > 0, "every miss marked once"


def compare_select(case, gen, dev, fn_triton, pinned_host=False, policy="lru", fetch=True):
    """Triton vs reference over STEPS steps of one episode: everything bit for bit, the policy's
    replacement state included (pinned_host: the kernel's host pool is a pinned CPU copy of the
    reference's)."""
    N, P, Hkv, D, U, k, S = case
    a = select_inputs(*case, gen, dev, policy)
    b = {n: (clone_state(v) if n == "state" else v.clone()) for n, v in a.items()}
    if pinned_host:
        b["host"] = a["host"].cpu().pin_memory()
    shapes = decode_ops.workspace_shapes(N, k, S)
    work = tuple(torch.zeros(s, dtype=torch.int32, device=dev) for s in shapes)
    scores = None
    for step in range(STEPS):
        if step == STEPS // 2:
            advance(a)
            advance(b)
        if step % 3 != 2:   # every third step repeats the last scores: all hits where k <= S
            scores = random_scores(N, U, gen, dev)
        want = run_select(reference.select_resolve, a, scores, k, fetch=fetch)
        got = run_select(fn_triton, b, scores, k, work, fetch=fetch)
        for name, x, y in (("sel", want[0], got[0]), ("locs", want[1], got[1]),
                           ("slot_unit", a["state"].slot_unit, b["state"].slot_unit),
                           ("unit_slot", a["state"].unit_slot, b["state"].unit_slot),
                           (policy, policy_state(a["state"]), policy_state(b["state"])),
                           ("counts", a["counts"], b["counts"]),
                           ("missed", a["missed"], b["missed"])):
            assert torch.equal(x, y), f"step {step}: {name} differs"
        assert torch.equal(a["kv"].nan_to_num(-9.0), b["kv"].nan_to_num(-9.0)), f"step {step}: kv"
    return a


def compare_write(case, gen, dev, fn):
    t = write_inputs(*case, gen, dev)
    want = run_write(reference.decode_write, t)
    got = run_write(fn, t)
    for name, x, y in zip(("kv", "dst", "kmin", "kmax", "newest"), want, got):
        assert torch.equal(x, y), f"{name} differs"


def run_interpreter_cases():
    """Called in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    from vllm_hisparse.ops import triton_decode_write, triton_select
    for i, case in enumerate(WRITE_CASES):
        compare_write(case, torch.Generator().manual_seed(40 + i), "cpu",
                      triton_decode_write.decode_write)

    def tri(scores, seq, full, k, bt, sel, locs, work, **kw):
        triton_select.select_resolve(scores, seq, full, k, bt, sel, locs, *work, **kw)

    for policy in POLICIES:
        for i, case in enumerate(SELECT_CASES):
            triton_select.RADIX_BITS = (8, 11)[i % 2]     # both top-k radix widths
            compare_select(case, torch.Generator().manual_seed(50 + i), "cpu", tri, policy=policy,
                           fetch=i % 2 == 0)
    print("interpreter ok")


def test_triton_kernels_in_interpreter():
    run_cases("test_decode_ops")


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("case", WRITE_CASES)
def test_gpu_decode_write(case):
    compare_write(case, torch.Generator().manual_seed(60 + sum(case)), "cuda",
                  decode_ops.decode_write)


# cases only the CUDA select runs: selections and slots wider than its CTA (each thread a chunk of
# entries), rows of pages beyond its register-held keys
CUDA_SELECT_CASES = [(2, 4, 1, 16, 20000, 1100, 1300), (3, 4, 1, 16, 3000, 200, 600)]


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("fetch", [True, False])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", SELECT_CASES + [(4, 16, 8, 128, 2048, 127, 256)])
def test_gpu_select_resolve(case, policy, impl, fetch, monkeypatch):
    """On the GPU the kernel reads the host pool as pinned CPU memory, through its UVA alias
    (fetch False: no copies, the misses marked as the reference marks them)."""
    monkeypatch.setattr(decode_ops, "SELECT_IMPL", impl)
    a = compare_select(case, torch.Generator().manual_seed(70 + sum(case)), "cuda",
                       decode_ops.select_resolve, pinned_host=True, policy=policy, fetch=fetch)
    assert int(a["counts"][1]) > 0


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("threads", [256, 512, 1024])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CUDA_SELECT_CASES + [(4, 16, 8, 128, 2048, 127, 256)])
def test_gpu_cuda_select_widths(case, policy, threads, monkeypatch):
    """The CUDA select at each CTA width, on rows wider than the CTA; the rows' page tables held
    in shared memory but in the 20,000-page case (probed in global memory there)."""
    monkeypatch.setattr(decode_ops, "SELECT_IMPL", "cuda")
    monkeypatch.setattr(decode_ops, "SELECT_THREADS", threads)
    a = compare_select(case, torch.Generator().manual_seed(90 + sum(case)), "cuda",
                       decode_ops.select_resolve, pinned_host=True, policy=policy)
    assert int(a["counts"][1]) > 0


def test_fetch_in_attention_knob_refuses_other_values():
    """HISPARSE_FETCH_IN_ATTENTION is read once, at import: 0 or 1, anything else refused with one
    line naming the variable (a fresh interpreter, since the module is imported already here)."""
    import os
    import subprocess
    import sys
    code = "from vllm_hisparse.ops import decode_ops as d; print(d.FETCH_IN_ATTENTION)"
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, HISPARSE_FETCH_IN_ATTENTION=value)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0 and r.stdout.split() == [want], r.stderr
    env = dict(os.environ, HISPARSE_FETCH_IN_ATTENTION="off")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode != 0
    assert "HISPARSE_FETCH_IN_ATTENTION='off': use 1 (misses copied in" in r.stderr.splitlines()[-1]
