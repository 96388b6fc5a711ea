"""bench.server_spread: backends over several servers each, against numpy on fresh random CSVs."""
import csv
import random

import numpy as np
import pytest

from vllm_hisparse.bench import server_spread


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["backend", "concurrency", "tpot_mean_ms", "misses"])
        w.writeheader()
        w.writerows(rows)


def test_spread_matches_numpy_over_two_files(tmp_path):
    rng = random.Random()
    rows = [{"backend": rng.choice(["resident", "elastic", "stock"]),
             "concurrency": rng.choice([1, 8]), "tpot_mean_ms": rng.uniform(4, 8), "misses": ""}
            for _ in range(40)]
    rows[0].update(backend="resident", concurrency=1)       # the baseline exists at both points
    rows[1].update(backend="resident", concurrency=8)
    _write(tmp_path / "a.csv", rows[:17])
    _write(tmp_path / "b.csv", rows[17:])
    got = server_spread.spread(
        server_spread.read_rows([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]),
        "tpot_mean_ms", "resident")
    keys = [(r["backend"], str(r["concurrency"])) for r in rows]
    assert [(g["backend"], g["concurrency"]) for g in got] == list(dict.fromkeys(keys))
    for g in got:
        v = np.array([r["tpot_mean_ms"] for r in rows
                      if (r["backend"], str(r["concurrency"])) == (g["backend"], g["concurrency"])])
        base = np.array([r["tpot_mean_ms"] for r in rows if r["backend"] == "resident"
                         and str(r["concurrency"]) == g["concurrency"]])
        assert g["servers"] == len(v)
        assert g["mean"] == pytest.approx(v.mean(), rel=1e-12)
        assert (g["lo"], g["hi"]) == pytest.approx((v.min(), v.max()), rel=1e-12)
        if g["backend"] == "resident":
            assert g["vs_base"] is None
        else:
            assert g["vs_base"] == pytest.approx(v.mean() / base.mean() - 1, rel=1e-9)


def test_default_baseline_empty_cells_and_errors(tmp_path, capsys):
    _write(tmp_path / "s.csv", [
        {"backend": "elastic", "concurrency": 1, "tpot_mean_ms": 6.0, "misses": 0},
        {"backend": "resident", "concurrency": 1, "tpot_mean_ms": 5.0, "misses": ""},
        {"backend": "elastic", "concurrency": 1, "tpot_mean_ms": 7.0, "misses": 4},
        {"backend": "resident", "concurrency": 2, "tpot_mean_ms": 9.0, "misses": ""}])
    rows = server_spread.read_rows([str(tmp_path / "s.csv")])
    by = {(g["backend"], g["concurrency"]): g for g in server_spread.spread(rows, "tpot_mean_ms")}
    assert by["elastic", "1"]["vs_base"] is None                    # the first backend
    assert by["resident", "1"]["vs_base"] == pytest.approx(5.0 / 6.5 - 1)
    assert by["resident", "2"]["vs_base"] is None                   # no baseline row at 2
    miss = server_spread.spread(rows, "misses")                     # stock-like empty cells skipped
    assert [(g["backend"], g["servers"], g["mean"]) for g in miss] == [("elastic", 2, 2.0)]
    with pytest.raises(ValueError, match="--figure tpot: not a column"):
        server_spread.spread(rows, "tpot")
    with pytest.raises(ValueError,
                       match=r"--baseline stock: no such backend .*\(elastic, resident\)"):
        server_spread.spread(rows, "tpot_mean_ms", "stock")
    assert server_spread.main([str(tmp_path / "s.csv"), "--baseline", "resident"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[1].split()[:3] == ["elastic", "1", "2"]
    assert out[1].endswith("+30.00%")
    assert server_spread.main([str(tmp_path / "s.csv"), "--baseline", "stock"]) == 2
    assert "no such backend" in capsys.readouterr().err
