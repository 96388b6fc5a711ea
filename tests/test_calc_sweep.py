"""bench/calc_sweep.py: every point is `hisparse calc`'s figure (auto sizes; hostless dense and the
default sparse), the host-less count only adds requests, and a context no pool can serve is
reported as refused."""
import csv

from calc_cli import calc_json, model_dir  # noqa: F401

from vllm_hisparse.bench import calc_sweep


def test_sweep_points_are_calcs_figures(model_dir, tmp_path):
    out = tmp_path / "sweep"
    assert calc_sweep.main(["--model", str(model_dir), "--gpu-gib", "80", "--weights-gib", "15",
                            "--host-ram-gib", "120", "--contexts", "8192,32768,131072",
                            "--utils", "0.3,0.9", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "calc_sweep.csv")))
    assert len(rows) == 6 and (out / "calc_sweep.png").stat().st_size > 0
    by = {(int(r["context"]), float(r["util"])): r for r in rows}
    r = by[(32768, 0.9)]
    kv = 0.9 * 80 - 15 - 3
    ref = calc_json(model_dir, "--context", 32768, "--gpu-kv-gib", f"{kv:.3f}", "--host-ram-gib",
                    120, "--hostless", "dense")
    assert int(r["stock"]) == ref["baseline"]["max_requests"]
    assert int(r["hisparse"]) == ref["hisparse"]["max_requests"]
    assert int(r["hostless"]) == ref["hisparse"]["hostless_requests"]
    assert float(r["ratio_dense"]) >= float(r["ratio_wait"]) >= 1.0
    # the default "sparse": the auto rows include its host-less requests (calc without --hostless)
    sp = calc_json(model_dir, "--context", 32768, "--gpu-kv-gib", f"{kv:.3f}", "--host-ram-gib",
                   120)["hisparse"]
    assert int(r["hostless_sparse"]) == sp["hostless_requests"] > 0
    assert sp["max_requests"] == int(r["hisparse"]) and sp["quest_rows"] == (
        int(r["hisparse"]) + int(r["hostless_sparse"]))
    assert float(r["ratio_sparse"]) == round((sp["max_requests"] + sp["hostless_requests"])
                                             / int(r["stock"]), 3) > float(r["ratio_wait"])
    # 128K at util 0.3 (6 GiB of KV, 16 GiB a request): neither serves one; hisparse refuses
    assert by[(131072, 0.3)]["bound_by"] == "refused" and by[(131072, 0.3)]["stock"] == "0"
