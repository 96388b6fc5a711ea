"""`hisparse sim` end to end on the shipped real trace (small k to stay fast)."""
import csv
import os

import pytest

from vllm_hisparse.cli import main
from vllm_hisparse.sim import cli

REQUIRED = {"trace", "layer", "k", "buffer", "policy", "miss_rate", "steady_miss_rate"}


def test_sim_on_shipped_trace_writes_results(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["sim", "--policies", "lru,belady,crf", "--k", "8", "--buffer", "2k,24",
               "--write-allocate", "both", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert REQUIRED <= set(rows[0])
    allrows = [r for r in rows if r["layer"] == "all"]
    assert len(allrows) == 3 * 2 * 2                               # policies x buffers x wa
    assert {r["buffer"] for r in allrows} == {"16", "24"}
    assert len([r for r in rows if r["layer"] == "29"]) == 12      # per-layer breakdown
    rate = {(r["policy"], r["buffer"], r["write_allocate"]): float(r["steady_miss_rate"]) for r in allrows}
    assert all(0 < v < 1 for v in rate.values())
    for b in ("16", "24"):
        for wa in ("on", "off"):
            assert rate[("belady", b, wa)] <= rate[("lru", b, wa)]
    assert rate[("lru", "24", "on")] <= rate[("lru", "16", "on")]
    for png in ("miss_per_step.png", "miss_vs_buffer.png"):
        assert os.path.getsize(out / png) > 1000
    assert os.path.exists(out / "per_step.csv")
    assert "steady miss rate" in capsys.readouterr().out


def test_sim_window_rows(tmp_path, capsys):
    """--window: one more row per window (write-allocate there: of the unit leaving the window),
    and a window of the whole context leaves no miss."""
    out = tmp_path / "simw"
    rc = main(["sim", "--policies", "lru", "--k", "8", "--buffer", "2k", "--window", "0,1k,99999",
               "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    rows = {r["window"]: r for r in csv.DictReader(open(out / "results.csv")) if r["layer"] == "all"}
    assert set(rows) == {"0", "8", "99999"}
    assert rows["0"]["write_allocate"] == rows["8"]["write_allocate"] == "on"
    assert int(rows["99999"]["misses"]) == 0 < int(rows["8"]["misses"])
    assert rows["0"]["selected"] == rows["8"]["selected"]
    assert "W" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--policies", "lru,nope"], "unknown nope"),
    (["--buffer", "xk"], "--buffer"),
    (["--window", "-1"], "--window"),
    (["--buffer", "1k"], "B must hold"),
    (["--k", "a"], "--k"),
    (["--k", "4096"], r"no --k \(\+ --lookahead\) value fits"),
    (["/nonexistent.npz"], "not found"),
])
def test_cli_errors_name_the_flag(tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["sim", *argv, "--out", str(tmp_path), "--no-progress", "--no-plots"])


def test_buffer_spec():
    assert cli.parse_buffer("2k", 64) == 128 and cli.parse_buffer("512", 64) == 512
    assert cli.parse_buffer("1.5k", 64) == 96


def test_report_gain_and_gap_share():
    from vllm_hisparse.sim import report
    rows = [dict(trace=t, layer="all", k="64", buffer="128", write_allocate="on", policy=p,
                 steady_miss_rate=str(v)) for t in ("a", "b")
            for p, v in (("lru", 0.14), ("crf", 0.12), ("belady", 0.06))]
    table = report.compact(rows)
    assert "| 64 | 128 (2k) | on | 14.00 | 12.00 | 6.00 | +2.00 | 25.0% |" in table
    assert "belady < crf < lru; crf vs lru: +2.00 points, 25.0% of the LRU->Bélády gap" in report.tables(rows)


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
