"""The simulator runs the runtime's resolve: its batched miss counts equal an independent replay,
one row and one resolve call at a time, and it really calls slots.engine.resolve. The lookahead
(engine.Config.lookahead: each step's next m candidates prefetched off the critical path) too; on
a trace whose next selection is this step's next candidates it removes every miss it can (and
without it they stay: the control); it never costs the step a unit it selected."""
import numpy as np
import pytest
import torch

from vllm_hisparse.slots import engine as hot_buffer
from vllm_hisparse.slots.engine import HotBufferState, resolve
from vllm_hisparse.slots import make
from vllm_hisparse.sim import engine, trace

STEPS = 24


@pytest.fixture(scope="module")
def real():
    t = trace.load(trace.default_trace_path())
    t.positions, t.context_len = t.positions[:STEPS, :4, :24], t.context_len[:STEPS]
    t.meta = dict(t.meta, k_max=24)
    return t


def replay_one_row(tr, layer, k, m, slots, policy, wa, window=0):
    """Reference: one state per (layer, config), one resolve a step of [selection, new unit, ranks
    k .. k+m-1 (the lookahead m)]; write-allocate as the issue states it (the new token's unit
    enters with the step, never counts as a miss); with a window, the units in it left out of
    selection and lookahead (a Python filter), no write-allocate. Returns (misses, prefetched)."""
    st = HotBufferState.create(1, slots, tr.max_units(), make(policy))
    misses, fetched = [], []
    for t in range(tr.steps):
        new = (int(tr.context_len[t]) - 1) // tr.unit
        out = (lambda u: u >= 0) if not window else (lambda u: 0 <= u <= new - window)
        sel = [int(u) for u in tr.positions[t, layer, :k] if out(u)]
        extra = [new] if wa and new not in sel else []
        pre = [int(u) for u in tr.positions[t, layer, k:k + m] if out(u) and int(u) not in extra]
        row = sel + extra + pre
        if not row:
            misses.append(0)
            fetched.append(0)
            continue
        _, miss = resolve(st, torch.tensor([row], dtype=torch.int32), step=t)
        flags = miss[0].tolist()
        misses.append(sum(f for u, f in zip(sel, flags) if not (wa and u == new)))
        fetched.append(sum(flags[len(sel) + len(extra):]))
    return np.array(misses), np.array(fetched)


@pytest.mark.parametrize("policy", ["lru", "fifo", "vanilla", "crf"])
def test_batched_sim_equals_row_by_row_resolve(real, policy):
    cfgs = [engine.Config(8, 16, True), engine.Config(16, 32, False), engine.Config(16, 17, True)]
    rep = engine.replay(real, policy, cfgs)
    for c, m in zip(cfgs, rep.misses):
        for layer in range(real.layers):
            ref, _ = replay_one_row(real, layer, c.k, 0, c.slots, policy, c.write_allocate)
            assert np.array_equal(m[:, layer], ref), (policy, c, layer)


def test_sim_calls_the_runtime_resolve(real, monkeypatch):
    calls = []
    orig = hot_buffer.resolve

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(engine, "resolve", spy)
    assert engine.resolve is spy and orig.__module__ == "vllm_hisparse.slots.engine"
    engine.replay(real, "lru", [engine.Config(8, 16), engine.Config(16, 32), engine.Config(4, 16)])
    assert len(calls) == 2 * STEPS            # one call per step per slot count (16 and 32)


def test_write_allocate_turns_self_selections_into_hits(real):
    on, off = engine.replay(real, "lru", [engine.Config(16, 32, True), engine.Config(16, 32, False)]).misses
    assert on.sum() < off.sum()


def test_buffer_must_hold_the_selection(real):
    with pytest.raises(ValueError, match="--buffer"):
        engine.replay(real, "lru", [engine.Config(16, 16, True)])


def replay_one_row_window(tr, layer, k, slots, window, exit_wa=False):
    """Reference for a window of the newest ``window`` units: each step's selection, one row at a
    time, without the units in the window (a Python filter, no compaction in numpy); exit_wa: the
    unit that leaves the window at the next step appended to this step's (not a miss)."""
    st = HotBufferState.create(1, slots, tr.max_units(), make("lru"))
    misses = []
    for t in range(tr.steps):
        new = (int(tr.context_len[t]) - 1) // tr.unit
        row = [int(u) for u in tr.positions[t, layer, :k] if 0 <= u <= new - window]
        n_sel = len(row)
        if exit_wa and t + 1 < tr.steps:
            nxt = (int(tr.context_len[t + 1]) - 1) // tr.unit
            if nxt == new + 1 and nxt - window >= 0:
                row.append(nxt - window)
        if not row:
            misses.append(0)
            continue
        _, miss = resolve(st, torch.tensor([row], dtype=torch.int32), step=t)
        misses.append(int(miss[0, :n_sel].sum()))
    return np.array(misses)


def test_window_equals_a_row_by_row_replay_without_the_window(real):
    cfgs = [engine.Config(16, 32, False, 8), engine.Config(16, 32, True), engine.Config(8, 32, False, 3),
            engine.Config(16, 32, True, 8), engine.Config(8, 32, True, 3)]
    rep = engine.replay(real, "lru", cfgs)
    for c, m, n in zip(cfgs, rep.misses, rep.selected):
        assert np.array_equal(n, (real.positions[:, :, :c.k] >= 0).sum(-1))   # window hits counted
        if c.window:
            for layer in range(real.layers):
                ref = replay_one_row_window(real, layer, c.k, c.slots, c.window, c.write_allocate)
                assert np.array_equal(m[:, layer], ref), (c, layer)
                assert ref.sum() > 0
    # the unit leaving the window written into the buffer: fewer misses than not
    assert rep.misses[3].sum() < rep.misses[0].sum() and rep.misses[4].sum() < rep.misses[2].sum()


def test_a_window_over_the_whole_context_never_misses(real):
    w = int(real.context_len.max())
    (m,) = engine.replay(real, "lru", [engine.Config(16, 32, False, w)]).misses
    assert m.sum() == 0


@pytest.mark.parametrize("policy", ["lru", "fifo", "crf"])
def test_lookahead_equals_row_by_row_resolve(real, policy):
    cfgs = [engine.Config(8, 24, True, 0, 8), engine.Config(8, 24, False, 0, 4),
            engine.Config(8, 24, True)]
    rep = engine.replay(real, policy, cfgs)
    for c, m, f in zip(cfgs, rep.misses, rep.prefetched):
        for layer in range(real.layers):
            rm, rf = replay_one_row(real, layer, c.k, c.lookahead, c.slots, policy, c.write_allocate)
            assert np.array_equal(m[:, layer], rm), (policy, c, layer)
            assert np.array_equal(f[:, layer], rf), (policy, c, layer)
    assert rep.prefetched[2].sum() == 0 < rep.prefetched[0].sum()


def test_lookahead_with_a_window_equals_row_by_row_resolve(real):
    """The prefetch leaves out the window's units as the selection does (they are resident)."""
    cfgs = [engine.Config(8, 24, False, 4, 8), engine.Config(8, 24, False, 4)]
    rep = engine.replay(real, "lru", cfgs)
    for c, m, f in zip(cfgs, rep.misses, rep.prefetched):
        for layer in range(real.layers):
            rm, rf = replay_one_row(real, layer, c.k, c.lookahead, c.slots, "lru", False, c.window)
            assert np.array_equal(m[:, layer], rm), (c, layer)
            assert np.array_equal(f[:, layer], rf), (c, layer)
    new = (real.context_len - 1) // real.unit
    in_window = (real.positions[:, :, 8:16] > (new - 4)[:, None, None]).sum()
    assert in_window > 0            # the filter is exercised: some candidates sit in the window


def shifting(k, steps=20, units=400):
    """Step t selects units t*k .. t*k+k-1 and ranks next the ones step t + 1 will select."""
    pos = np.stack([np.arange(t * k, t * k + 2 * k) for t in range(steps)])[:, None, :]
    return trace.Trace(pos.astype(np.int32), np.full(steps, units * 16, np.int32),
                       dict(model="t", text="t", indexer="t", unit=16, k_max=2 * k), "shift.npz")


@pytest.mark.parametrize("policy", ["lru", "fifo", "random"])
def test_a_lookahead_of_the_next_selection_leaves_only_the_first_steps_misses(policy):
    k = 8
    tr = shifting(k)
    with_la, without = engine.replay(tr, policy, [engine.Config(k, 3 * k, False, 0, k),
                                                  engine.Config(k, 3 * k, False)]).misses
    assert with_la[0, 0] == k and with_la[1:].sum() == 0
    assert (without == k).all()                              # the control: every unit is new


@pytest.mark.parametrize("policy", ["lru", "fifo", "random", "crf"])
def test_a_unit_selected_twice_in_a_row_is_a_hit_with_a_lookahead(policy):
    """The prefetch takes victims like a miss: never the slot of a unit the step selected."""
    rng = np.random.default_rng(7)
    k, m, steps, units = 6, 6, 40, 30
    pos = np.stack([rng.permutation(units)[:k + m] for _ in range(steps)])[:, None, :]
    tr = trace.Trace(pos.astype(np.int32), np.full(steps, units * 16, np.int32),
                     dict(model="r", text="r", indexer="r", unit=16, k_max=k + m), "r.npz")
    rep = engine.replay(tr, policy, [engine.Config(k, k + m, False, 0, m)])
    for t in range(1, steps):
        again = len(set(pos[t, 0, :k]) & set(pos[t - 1, 0, :k]))
        assert rep.misses[0][t, 0] <= k - again, t


def test_lookahead_needs_ranks_and_room(real):
    with pytest.raises(ValueError, match="record it with a larger k_max"):
        engine.replay(real, "lru", [engine.Config(16, 48, True, 0, 16)])
    with pytest.raises(ValueError, match="and its prefetch"):
        engine.replay(real, "lru", [engine.Config(8, 16, True, 0, 8)])
    with pytest.raises(ValueError, match="replay these configs separately"):   # one call of B:
        engine.replay(real, "lru", [engine.Config(16, 20, True), engine.Config(4, 20, True, 0, 8)])
