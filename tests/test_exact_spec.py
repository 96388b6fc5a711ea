"""The GPU exactness harness with ngram speculation (issue 47 item 3; EXACT_SPEC=k in
scripts/gpu_exactness.py): the verdict's acceptance rule (scripts/exact_verdict.py, check 5) on
doctored results (equal counters: EXACT; any counter differing: MISMATCH; no accepted draft in the
reference, or counters not recorded: VOID), schedules compared only before the first decode step,
the harness's prompts and engine arguments, scripts/hisparse_generate.py's --speculative-config
reaching vLLM's LLM, and (vllm marker, ~20 s) its per-batch counters on the CPU engine."""
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
from test_exact_verdict import _case, _doctor  # noqa: E402

DRAFTS, TOKENS, ACCEPTED = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                            "vllm:spec_decode_num_accepted_tokens")
COUNTERS = {DRAFTS: 40, TOKENS: 120, ACCEPTED: 70}


def _kw(seed):
    ref, same, shuf = _case(seed)
    return ref, same, dict(control=_doctor(ref, "token", random.Random(seed)), shuffled=shuf)


@pytest.mark.parametrize("seed", range(3))
def test_acceptance_counters_must_equal_the_references(seed):
    ref, same, kw = _kw(seed)
    spec = {"reference": dict(COUNTERS), "hisparse": dict(COUNTERS)}
    code, lines = ev.verdict(ref, {"hisparse": same}, **kw, spec=spec)
    assert code == ev.EXACT, lines
    assert "hisparse acceptance: identical to the reference's" in lines
    assert "reference acceptance: 40 drafts, 70 of 120 draft tokens accepted" in lines
    # identical outputs, one counter off by one: MISMATCH, printed
    for key in COUNTERS:
        bad = dict(COUNTERS, **{key: COUNTERS[key] + random.Random(seed).choice((-1, 1))})
        code, lines = ev.verdict(ref, {"hisparse": same}, **kw,
                                 spec={"reference": dict(COUNTERS), "hisparse": bad})
        assert code == ev.MISMATCH and lines[-1] == "MISMATCH", (key, lines)
        assert any(x.startswith("hisparse acceptance:") and "DIFFERS" in x for x in lines)
    # a reference that accepted no draft: VOID, whatever else holds
    none = dict(COUNTERS, **{ACCEPTED: 0})
    code, lines = ev.verdict(ref, {"hisparse": same}, **kw,
                             spec={"reference": none, "hisparse": dict(none)})
    assert code == ev.VOID and "no draft was accepted in the reference" in lines[-1], lines
    # counters not recorded (an engine's, or the reference's): VOID
    for sp in ({"reference": dict(COUNTERS), "hisparse": None}, {"reference": None}):
        code, lines = ev.verdict(ref, {"hisparse": same}, **kw, spec=sp)
        assert code == ev.VOID and "not recorded" in lines[-1], (sp, lines)
    # not a speculative run (spec None): the verdict as before
    assert ev.verdict(ref, {"hisparse": same}, **kw)[0] == ev.EXACT


def test_schedules_compared_before_the_first_decode_step():
    """Drafts follow each engine's own outputs: under speculation a control (or an engine) whose
    batches differ only from the first decode step on still counts; one whose prefill batches
    differ does not."""
    ref, same, kw = _kw(4)
    for i, r in enumerate(ref):
        r["prompt_len"] = 20 + i
    sched = [[[0, 16]], [[0, 4], [1, 12]], [[0, 1], [1, 9]], [[0, 4], [1, 1]]]
    assert ev.before_decode(sched, [20, 21]) == sched[:2]       # request 0 decodes at step 2
    assert ev.before_decode(sched, [20, None]) == sched          # a length unknown: all of it
    late = copy.deepcopy(sched)
    late[3] = [[0, 2], [1, 4]]                                   # other drafts: after decode began
    early = copy.deepcopy(sched)
    early[1] = [[0, 4], [1, 8]]                                  # other prefill chunks
    spec = {"reference": dict(COUNTERS), "hisparse": dict(COUNTERS)}
    for ctl, want in ((late, ev.EXACT), (early, ev.VOID)):
        code, lines = ev.verdict(ref, {"hisparse": same}, **kw, spec=spec,
                                 schedules={"reference": sched, "hisparse": sched, "control": ctl})
        assert code == want, lines
    # without speculation the whole schedule counts: the late difference voids the control
    code, _ = ev.verdict(ref, {"hisparse": same}, **kw,
                         schedules={"reference": sched, "hisparse": sched, "control": late})
    assert code == ev.VOID


def _write(tmp, mode, batches, spec=None, misses=10):
    info = [{"schedule": None, **({} if spec is None else {"spec": spec})}]
    json.dump({"batches": batches, "stats": {"misses": misses}, "peak_decode_blocks": 1,
               "elapsed_s": 1.0, "batch_info": info}, open(tmp / f"{mode}.json", "w"))


def _compare(tmp, env=None):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_exactness.py"),
                        "compare", str(tmp), "hisparse"], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    return r.returncode, r.stdout + r.stderr


def test_gpu_exactness_compare_reads_each_modes_counters(tmp_path):
    ref, same, kw = _kw(8)
    _write(tmp_path, "resident", [ref, kw["shuffled"]], COUNTERS)
    _write(tmp_path, "resident2", [copy.deepcopy(ref)], COUNTERS)
    _write(tmp_path, "control", [kw["control"]], dict(COUNTERS, **{ACCEPTED: 50}))
    _write(tmp_path, "hisparse", [same], dict(COUNTERS))
    code, out = _compare(tmp_path)
    assert code == ev.EXACT and "hisparse acceptance: identical" in out, out
    assert "control acceptance:" in out
    _write(tmp_path, "hisparse", [same], dict(COUNTERS, **{TOKENS: 119}))
    code, out = _compare(tmp_path)
    assert code == ev.MISMATCH and "DIFFERS" in out, out
    _write(tmp_path, "resident", [ref, kw["shuffled"]], dict(COUNTERS, **{ACCEPTED: 0}))
    _write(tmp_path, "hisparse", [same], dict(COUNTERS, **{ACCEPTED: 0}))
    code, out = _compare(tmp_path)
    assert code == ev.VOID and "no draft was accepted" in out, out
    # EXACT_SPEC set but nothing recorded (an engine run without it): VOID; unset: as before
    for m, b in (("resident", [ref, kw["shuffled"]]), ("hisparse", [same])):
        _write(tmp_path, m, b)
    assert _compare(tmp_path)[0] == ev.EXACT
    code, out = _compare(tmp_path, {"EXACT_SPEC": "3"})
    assert code == ev.VOID and "reference acceptance: NOT RECORDED" in out, out


def _exactness(env: dict):
    import importlib

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        sys.modules.pop("gpu_exactness", None)
        return importlib.import_module("gpu_exactness")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        sys.modules.pop("gpu_exactness", None)


@pytest.mark.parametrize("spec", ["", "3"])
def test_run_gives_every_mode_the_speculative_config_and_repeated_prompts(tmp_path, monkeypatch,
                                                                          spec):
    ge = _exactness({"EXACT_SPEC": spec, "EXACT_PROMPTS": "700,300", "EXACT_MODEL": str(tmp_path)})
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ge.subprocess, "run", fake_run)
    for mode in ("resident", "hisparse", "control"):
        assert ge.run(mode, str(tmp_path / "out")) == 0
    prompts = json.load(open(tmp_path / "out" / "prompts.json"))
    assert [len(p) for p in prompts] == [700, 300]
    for cmd in seen:
        if spec:
            got = json.loads(cmd[cmd.index("--speculative-config") + 1])
            assert got == {"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        else:
            assert "--speculative-config" not in cmd
    b = ge.REPEAT_BLOCK
    repeats = [p[b:] == p[:len(p) - b] for p in prompts]
    assert repeats == ([True, True] if spec else [False, False])


def test_generate_passes_the_speculative_config_to_llm(tmp_path):
    """scripts/hisparse_generate.py --speculative-config JSON reaches vllm.LLM (with its stats on,
    which the acceptance counters need); without it neither is passed."""
    prompts = tmp_path / "p.json"
    prompts.write_text("[[1, 2, 3]]")
    code = (
        "import json, sys, vllm\n"
        "class Stop(Exception): pass\n"
        "def fake(*a, **kw):\n"
        "    print('KW', json.dumps({k: kw.get(k) for k in ('speculative_config', "
        "'disable_log_stats')}) + ' ' + str('disable_log_stats' in kw)); raise Stop\n"
        "vllm.LLM = fake\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import hisparse_generate as hg\n"
        "try: hg.main(sys.argv[2:])\n"
        "except Stop: pass\n")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    outs = []
    for extra in (["--speculative-config", json.dumps(spec)], []):
        r = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "scripts"), "--model",
                            str(tmp_path), "--prompts", str(prompts), "--out",
                            str(tmp_path / "o.json"), *extra],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1"))
        line = [x for x in r.stdout.splitlines() if x.startswith("KW ")]
        assert line, r.stdout[-2000:] + r.stderr[-4000:]
        outs.append(line[0])
    got, present = outs[0][3:].rsplit(" ", 1)
    assert json.loads(got) == {"speculative_config": spec, "disable_log_stats": False}
    assert present == "True"
    assert outs[1].endswith(" False")            # no stats argument: LLM's own default, as before
    assert json.loads(outs[1][3:].rsplit(" ", 1)[0])["speculative_config"] is None


@pytest.mark.vllm
def test_generate_records_each_batchs_acceptance_on_the_cpu_engine(tmp_path):
    """The tiny model on vLLM's CPU engine, ngram through hisparse (test_spec_decode's config),
    the same prompts as two batches: each batch's counters are its own (equal here, prefix caching
    off), the totals their sum, drafts proposed and accepted through the verify rows."""
    from engine_generate import finish, generate_job
    from engine_jobs import tiny_model

    cfg = {"top_k": 48, "device_buffer_size": 64, "page_size": 16, "dense_layers": [0],
           "host_pool_gib": 0.05, "resident_first": False, "min_context": 0}
    prompts = [[5, 17, 33, 81, 99, 120, 7, 64] * 20, [200, 11, 300, 42, 9] * 30]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    argv, env = generate_job(tmp_path, tiny_model(), cfg, [prompts, prompts], "ngram",
                             ["--skip-tokenizer", "--speculative-config", json.dumps(spec)], 24)
    env["NUMBA_DISABLE_JIT"] = "1"        # the ngram proposer in plain Python (no 30 s compile)
    res = finish(tmp_path, "ngram", subprocess.run(argv, capture_output=True, text=True, env=env,
                                                   timeout=300))
    first, second = (b["spec"] for b in res["batch_info"])
    assert first == second and first[ACCEPTED] > 0 and first[DRAFTS] > 0, res["batch_info"]
    assert res["spec"] == {k: 2 * v for k, v in first.items()}
    assert res["stats"]["spec_rows"] > 0
    assert res["batches"][0] == res["batches"][1]
