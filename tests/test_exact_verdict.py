"""The GPU exactness harnesses' verdict (scripts/exact_verdict.py) and their compare steps
(scripts/gpu_exactness.py, scripts/gpu_dsa.py) on doctored result files: EXACT only when attention
matters and the negative control mismatched; any engine difference is a MISMATCH; otherwise VOID."""
from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import exact_verdict as ev  # noqa: E402


def _requests(seed: int, n: int = 4, steps: int = 12) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_len": rng.randrange(100, 999), "tokens": [rng.randrange(50) for _ in range(steps)],
             "logprobs": [[[rng.randrange(50), -rng.random()]] for _ in range(steps)]}
            for _ in range(n)]


def _case(seed=0):
    ref = _requests(seed)
    return ref, copy.deepcopy(ref), _requests(seed + 100)     # reference, an equal engine, shuffled


def _doctor(reqs, what: str, rng: random.Random):
    out = copy.deepcopy(reqs)
    r = rng.randrange(len(out))
    j = rng.randrange(len(out[r]["tokens"]))
    if what == "token":
        out[r]["tokens"][j] += 1
    else:
        out[r]["logprobs"][j][0][1] = out[r]["logprobs"][j][0][1] - 1e-6
    return out


def _doctor_steps(reqs, n: int, rng: random.Random):
    """n distinct (request, step) logprobs moved by 1e-6, every token kept."""
    out = copy.deepcopy(reqs)
    cells = [(r, j) for r in range(len(out)) for j in range(len(out[r]["logprobs"]))]
    for r, j in rng.sample(cells, n):
        out[r]["logprobs"][j][0][1] -= 1e-6
    return out


@pytest.mark.parametrize("seed", range(3))
def test_exact_needs_attention_that_matters_and_a_control_that_mismatches(seed):
    rng = random.Random(seed)
    ref, same, shuf = _case(seed)
    control = _doctor(ref, "token", rng)
    code, lines = ev.verdict(ref, {"hisparse": same, "elastic": copy.deepcopy(ref)}, control, shuf)
    assert code == ev.EXACT and lines[-1] == "EXACT"
    # a doctored engine (one token, or one logprob by 1e-6): MISMATCH, whatever else holds
    for what in ("token", "logprob"):
        code, lines = ev.verdict(ref, {"hisparse": same, "elastic": _doctor(ref, what, rng)},
                                 control, shuf)
        assert code == ev.MISMATCH and lines[-1] == "MISMATCH"
        assert any(line.startswith("elastic request") and "False" in line for line in lines)
    # inert attention (the shuffled context changes nothing): VOID
    code, lines = ev.verdict(ref, {"hisparse": same}, control, copy.deepcopy(ref))
    assert code == ev.VOID and "attention did not matter" in lines[-1]
    # a control that matched, or one that fetched nothing, or none: VOID
    for ctl, misses in ((copy.deepcopy(ref), None), (control, 0), (None, None)):
        code, lines = ev.verdict(ref, {"hisparse": same}, ctl, shuf, misses)
        assert code == ev.VOID and "the negative control did not mismatch" in lines[-1]
    # a control that barely differs (its tokens all equal, logprobs of < CONTROL_STEPS steps):
    # VOID; from CONTROL_STEPS steps on it counts
    n = ev.CONTROL_STEPS
    for k, want in ((1, ev.VOID), (n - 1, ev.VOID), (n, ev.EXACT), (n + 3, ev.EXACT)):
        code, lines = ev.verdict(ref, {"hisparse": same}, _doctor_steps(ref, k, rng), shuf)
        assert code == want, (k, lines)
        assert (f"0 requests' tokens and {k} steps' logprobs differ" in lines[-2]), lines
        assert ("barely differs" in lines[-2]) == (want == ev.VOID)


@pytest.mark.parametrize("seed", range(3))
def test_a_reference_that_does_not_reproduce_voids_the_verdict(seed):
    rng = random.Random(seed)
    ref, same, shuf = _case(seed)
    control = _doctor(ref, "token", rng)
    code, lines = ev.verdict(ref, {"hisparse": same}, control, shuf, again=copy.deepcopy(ref))
    assert code == ev.EXACT and "reference reproducible: yes" in "\n".join(lines)
    for what in ("token", "logprob"):
        flaky = _doctor(ref, what, rng)
        # whether the engine matches the first reference or not: nothing is attributable
        for engine in (same, _doctor(ref, "token", rng), flaky):
            code, lines = ev.verdict(ref, {"hisparse": engine}, control, shuf, again=flaky)
            assert code == ev.VOID and "not reproducible" in lines[-1], lines
            assert "reference reproducible: NO" in "\n".join(lines)
    code, lines = ev.verdict(ref, {"hisparse": same}, control, shuf, again=[])   # second run missing
    assert code == ev.VOID and "reference reproducible: NOT SHOWN" in "\n".join(lines)


def test_differences_under_other_batches_are_unattributable():
    """vLLM is not batch-invariant: an engine that ran other batches and differs proves nothing
    (VOID); one that ran the same batches and differs is a MISMATCH; unrecorded: MISMATCH."""
    rng = random.Random(9)
    ref, same, shuf = _case(9)
    control = _doctor(ref, "token", rng)
    sched = [[[0, 16], [1, 16]], [[0, 1], [1, 1]], [[0, 1], [1, 1]]]
    other = copy.deepcopy(sched)
    other[1] = [[0, 1]]
    diff = _doctor(ref, "logprob", rng)
    kw = dict(control=control, shuffled=shuf)
    # a control that ran other batches: its difference is not the fetch's (VOID); the same
    # batches, or none recorded for it: it counts
    for ctl_sched, want in ((other, ev.VOID), (sched, ev.EXACT), (None, ev.EXACT)):
        sch = {"reference": sched, "hisparse": sched}
        if ctl_sched is not None:
            sch["control"] = ctl_sched
        code, lines = ev.verdict(ref, {"hisparse": same}, **kw, schedules=sch)
        assert code == want, (ctl_sched, lines)
        assert ("its schedule differs from the reference's at step 1" in "\n".join(lines)) == \
            (want == ev.VOID)
    code, lines = ev.verdict(ref, {"hisparse": same, "elastic": diff}, **kw,
                             schedules={"reference": sched, "hisparse": sched, "elastic": other})
    assert code == ev.VOID and "elastic: outputs differ but so do the batches" in lines[-1]
    assert "elastic schedule: differs from the reference's at step 1" in lines
    assert "hisparse schedule: identical to the reference's" in lines
    for sch in ({"reference": sched, "hisparse": sched, "elastic": sched}, {"reference": sched}, None):
        code, lines = ev.verdict(ref, {"hisparse": same, "elastic": diff}, **kw, schedules=sch)
        assert code == ev.MISMATCH, (sch, lines)
    # a true mismatch beside an unattributable one: MISMATCH
    code, _ = ev.verdict(ref, {"hisparse": _doctor(ref, "token", rng), "elastic": diff}, **kw,
                         schedules={"reference": sched, "hisparse": sched, "elastic": other})
    assert code == ev.MISMATCH
    # same outputs under other batches: fine
    code, _ = ev.verdict(ref, {"hisparse": same}, **kw,
                         schedules={"reference": sched, "hisparse": other})
    assert code == ev.EXACT


def test_attention_matters_takes_most_prompts():
    ref = _requests(0, n=4)
    shuf = copy.deepcopy(ref)
    for i in range(2):
        shuf[i]["tokens"][0] += 1
    assert not ev.attention_matters(ref, shuf)[0]               # 2 of 4 is not most
    shuf[2]["tokens"][-1] += 1
    assert ev.attention_matters(ref, shuf) == (
        True, "attention matters: yes, a shuffled context changes the greedy tokens of 3 of 4 prompts")
    assert not ev.attention_matters(ref, shuf[:3])[0]           # one shuffled output missing


def test_shuffle_keeps_the_last_token_and_the_multiset():
    p = list(range(100))
    s = ev.shuffle_context(p, 3)
    assert s[-1] == 99 and sorted(s) == p and s != p and s == ev.shuffle_context(p, 3)


def _run(script: str, *args) -> tuple[int, str]:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def test_gpu_exactness_compare_on_doctored_files(tmp_path):
    rng = random.Random(5)
    ref, same, shuf = _case(5)

    def write(mode, batches, misses=10):
        json.dump({"batches": batches, "stats": {"misses": misses}, "peak_decode_blocks": 1,
                   "elapsed_s": 1.0}, open(tmp_path / f"{mode}.json", "w"))

    write("resident", [ref, shuf])
    write("hisparse", [same])
    write("elastic", [_doctor(ref, "logprob", rng)])
    write("control", [_doctor(ref, "token", rng)])
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse")
    assert code == ev.VOID and "NOT SHOWN" in out                # no resident2.json
    write("resident2", [_doctor(ref, "token", rng)])            # a reference that drifts
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse")
    assert code == ev.VOID and "reference reproducible: NO" in out
    write("resident2", [copy.deepcopy(ref)])
    # elastic ran other batches and differs: unattributable; then the same batches: MISMATCH
    res = json.load(open(tmp_path / "resident.json"))
    res["batch_info"] = [{"schedule": [[[0, 8]], [[0, 1]]]}]
    json.dump(res, open(tmp_path / "resident.json", "w"))
    el = json.load(open(tmp_path / "elastic.json"))
    el["batch_info"] = [{"schedule": [[[0, 8]], [[0, 1], [1, 4]]]}]
    json.dump(el, open(tmp_path / "elastic.json", "w"))
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse", "elastic")
    assert code == ev.VOID and "differs from the reference's at step 1" in out, out
    el["batch_info"] = [{"schedule": [[[0, 8]], [[0, 1]]]}]
    json.dump(el, open(tmp_path / "elastic.json", "w"))
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse", "elastic")
    assert code == ev.MISMATCH and "elastic schedule: identical" in out, out
    write("resident", [ref, shuf])
    write("elastic", [_doctor(ref, "logprob", rng)])
    write("control", [_doctor(ref, "token", rng)])
    assert _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse")[0] == ev.EXACT
    ctl = json.load(open(tmp_path / "control.json"))             # the control ran other batches
    res = json.load(open(tmp_path / "resident.json"))
    res["batch_info"] = [{"schedule": [[[0, 8]], [[0, 1]]]}]
    ctl["batch_info"] = [{"schedule": [[[0, 8]], [[0, 1], [1, 4]]]}]
    for path, d in (("resident.json", res), ("control.json", ctl)):
        json.dump(d, open(tmp_path / path, "w"))
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse")
    assert code == ev.VOID and "not the fetch's" in out, out
    write("resident", [ref, shuf])
    write("control", [_doctor(ref, "token", rng)])
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse", "elastic")
    assert code == ev.MISMATCH and out.rstrip().endswith("MISMATCH")
    write("control", [ref], misses=3)                           # the control matched
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse")
    assert code == ev.VOID and "negative control: MATCHED (3 misses)" in out
    write("resident", [ref])                                    # no shuffled batch
    write("control", [_doctor(ref, "token", rng)])
    code, out = _run("gpu_exactness.py", "compare", str(tmp_path), "hisparse")
    assert code == ev.VOID and "attention matters: not shown" in out


def test_gpu_dsa_compare_on_doctored_files(tmp_path):
    rng = random.Random(6)
    ref, same, shuf = _case(6)

    def write(mode, reqs, **kw):
        json.dump({"mode": mode, "requests": reqs, "stats": {"misses": 7}, **kw},
                  open(tmp_path / f"{mode}.json", "w"))

    write("resident", ref, shuffled=shuf, load_format="scaled_dummy")
    write("resident2", _doctor(ref, "logprob", rng))
    write("hisparse", same)
    write("stock", copy.deepcopy(ref))
    write("control", _doctor(ref, "token", rng))
    code, out = _run("gpu_dsa.py", "compare", str(tmp_path))
    assert code == ev.VOID and "reference reproducible: NO" in out
    write("resident2", copy.deepcopy(ref))
    write("stock", copy.deepcopy(ref))
    write("control", _doctor(ref, "logprob", rng))          # one step's 1e-6: not clearly caught
    code, out = _run("gpu_dsa.py", "compare", str(tmp_path))
    assert code == ev.VOID and "negative control: barely differs" in out, out
    write("control", _doctor(ref, "token", rng))
    code, out = _run("gpu_dsa.py", "compare", str(tmp_path))
    assert code == ev.EXACT and "weights: scaled_dummy" in out
    write("stock", _doctor(ref, "token", rng))
    code, out = _run("gpu_dsa.py", "compare", str(tmp_path))
    assert code == ev.MISMATCH and "stock request" in out
    write("stock", copy.deepcopy(ref))
    write("resident", ref, shuffled=copy.deepcopy(ref))      # dummy weights: attention inert
    assert _run("gpu_dsa.py", "compare", str(tmp_path))[0] == ev.VOID


def test_cli_on_files(tmp_path):
    ref, same, shuf = _case(7)
    json.dump({"requests": ref, "shuffled": shuf}, open(tmp_path / "ref.json", "w"))
    json.dump({"requests": same}, open(tmp_path / "hs.json", "w"))
    json.dump({"requests": _doctor(ref, "token", random.Random(0))}, open(tmp_path / "c.json", "w"))
    code, out = _run("exact_verdict.py", str(tmp_path / "ref.json"), str(tmp_path / "hs.json"),
                     "--control", str(tmp_path / "c.json"))
    assert code == ev.EXACT, out
    code, out = _run("exact_verdict.py", str(tmp_path / "ref.json"), str(tmp_path / "c.json"),
                     "--control", str(tmp_path / "c.json"))
    assert code == ev.MISMATCH, out
    code, out = _run("exact_verdict.py", str(tmp_path / "ref.json"), str(tmp_path / "hs.json"),
                     "--control", str(tmp_path / "c.json"), "--again", str(tmp_path / "c.json"))
    assert code == ev.VOID and "not reproducible" in out, out


def test_generate_compilation_kwargs():
    """scripts/hisparse_generate.py's compilation settings: eager runs pass none; graphs the
    capture sizes; mode 0 (the bisection's no-Inductor engines) FULL decode graphs only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hg", os.path.join(ROOT, "scripts", "hisparse_generate.py"))
    hg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hg)
    assert hg.compilation(False, 0) == {}
    assert hg.compilation(True, None) == {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}}
    cc = hg.compilation(True, 0)["compilation_config"]
    assert cc["mode"] == 0 and cc["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert "cudagraph_mode" not in hg.compilation(True, 3)["compilation_config"]
