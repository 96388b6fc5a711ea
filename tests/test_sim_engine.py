"""The simulator runs the runtime's resolve: its batched miss counts equal an independent replay,
one row and one resolve call at a time, and it really calls slots.engine.resolve."""
import numpy as np
import pytest
import torch

from vllm_hisparse.slots import engine as hot_buffer
from vllm_hisparse.slots.engine import HotBufferState, resolve
from vllm_hisparse.slots import make
from vllm_hisparse.sim import engine

STEPS = 24


@pytest.fixture(scope="module")
def real(shipped_trace_head):
    return shipped_trace_head(STEPS, 4, 16)


def replay_one_row(tr, layer, k, slots, policy, wa):
    """Reference: one state per (layer, config); write-allocate as the issue states it (the new
    token's unit enters with the step, never counts as a miss)."""
    st = HotBufferState.create(1, slots, tr.max_units(), make(policy))
    misses = []
    for t in range(tr.steps):
        sel = [int(u) for u in tr.positions[t, layer, :k] if u >= 0]
        new = (int(tr.context_len[t]) - 1) // tr.unit
        row = sel + ([new] if wa and new not in sel else [])
        _, miss = resolve(st, torch.tensor([row], dtype=torch.int32), step=t)
        misses.append(sum(m for u, m in zip(row[:len(sel)], miss[0].tolist()) if not (wa and u == new)))
    return np.array(misses)


@pytest.mark.parametrize("policy", ["lru", "fifo", "vanilla", "crf"])
def test_batched_sim_equals_row_by_row_resolve(real, policy):
    cfgs = [engine.Config(8, 16, True), engine.Config(16, 32, False), engine.Config(16, 17, True)]
    rep = engine.replay(real, policy, cfgs)
    for c, m in zip(cfgs, rep.misses):
        for layer in range(real.layers):
            ref = replay_one_row(real, layer, c.k, c.slots, policy, c.write_allocate)
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
