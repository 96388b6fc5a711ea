"""The simulator's lookahead (engine.Config.lookahead): the indexer's next m candidates of each
step prefetched off the critical path. Its counts equal a row-by-row replay through the runtime's
resolve; on a trace whose next selection is this step's next candidates it removes every miss that
it can (and without it they stay: the control); it never costs the step a unit it selected."""
import csv

import numpy as np
import pytest
import torch

from vllm_hisparse.cli import main
from vllm_hisparse.slots import make
from vllm_hisparse.slots.engine import HotBufferState, resolve
from vllm_hisparse.sim import engine, trace

STEPS = 24


@pytest.fixture(scope="module")
def real(shipped_trace_head):
    return shipped_trace_head(STEPS, 4, 24)


def replay_one_row(tr, layer, k, m, slots, policy, wa, window=0):
    """Reference: one state, one resolve a step of [selection, new unit, ranks k .. k+m-1]; with a
    window, the units in it left out of both (a Python filter) and no write-allocate."""
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


def test_cli_lookahead_table_and_errors(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["sim", "--policies", "lru", "--k", "8", "--buffer", "4k", "--lookahead", "0,1k",
                 "--out", str(out), "--no-progress", "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "prefetched by the lookahead" in text
    rows = {r["lookahead"]: r for r in csv.DictReader(open(out / "results.csv")) if r["layer"] == "all"}
    assert set(rows) == {"0", "8"} and int(rows["0"]["prefetched"]) == 0 < int(rows["8"]["prefetched"])
    assert int(rows["8"]["misses"]) < int(rows["0"]["misses"])
    for argv, match in ((["--lookahead", "9999"], "--lookahead"), (["--lookahead", "xk"], "--lookahead"),
                        (["--buffer", "2k", "--lookahead", "1k"], "and its prefetch")):
        with pytest.raises(SystemExit, match=match):
            main(["sim", "--k", "8", *argv, "--out", str(tmp_path), "--no-progress", "--no-plots"])
    # a lookahead past the trace's ranks (k_max 256) is skipped with a line, the rest still runs
    assert main(["sim", "--policies", "lru", "--k", "8,128", "--buffer", "4k", "--lookahead",
                 "0,1k", "--out", str(out), "--no-progress", "--no-plots"]) == 0
    assert "k=128 + lookahead 128 > its k_max=256" not in capsys.readouterr().out
    assert main(["sim", "--policies", "lru", "--k", "8,200", "--buffer", "4k", "--lookahead",
                 "0,1k", "--out", str(out), "--no-progress", "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "k=200 + lookahead 200 > its k_max=256" in text
    rows = {(r["k"], r["lookahead"]) for r in csv.DictReader(open(out / "results.csv"))}
    assert rows == {("8", "0"), ("8", "8"), ("200", "0")}


def test_report_keeps_lookaheads_apart():
    from vllm_hisparse.sim import report
    rows = [dict(trace="a", layer="all", k="32", buffer="128", write_allocate="on", policy="lru",
                 lookahead=str(la), steady_miss_rate=str(v)) for la, v in ((0, 0.10), (16, 0.20))]
    table = report.compact(rows)
    assert "| 32 | 128 (4k) | on | 10.00 |" in table and "| 32 | 128 (4k) + lookahead 16 | on | 20.00 |" in table
    text = report.tables(rows)
    assert "B=128 (4k), write-allocate on" in text and "lookahead 16, write-allocate on" in text
