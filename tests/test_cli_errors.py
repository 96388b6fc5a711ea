"""Bad hisparse input on the `vllm serve` command line ends in one line (field, value, fix) and exit
code 2, before the engine starts (vllm/cli_check.py). The cases run through vLLM's own CLI entry
point (`vllm.entrypoints.cli.main.main`, what the `vllm` script calls), one process for all of them;
one case also runs as a real `vllm serve` process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from vllm_hisparse.config import GIB, HiSparseConfig, HiSparseConfigError
from vllm_hisparse.vllm import cli_check

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = re.compile(r"^\(\w+ pid=\d+\) ")          # vLLM's per-process prefix on its output lines

# Runs vLLM's CLI main() once per case (argv lists in sys.argv[1]); one JSON line each on stdout
# (vLLM may prefix it with its process tag): exit code and what went to stderr.
DRIVER = r"""
import contextlib, io, json, socket, sys
from vllm.entrypoints.cli.main import main
for argv in json.loads(sys.argv[1]):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.argv = ["vllm", *argv[:2], "--port", str(port), *argv[2:]]
    err, code = io.StringIO(), None
    with contextlib.redirect_stderr(err):
        try:
            main()
            code = "returned"
        except SystemExit as e:
            code = e.code
        except BaseException as e:
            code = "raised " + type(e).__name__
    sys.__stdout__.write("CASE " + json.dumps({"code": code, "stderr": err.getvalue()}) + "\n")
    sys.__stdout__.flush()
"""


def _ram_gib() -> int:
    from vllm_hisparse.core.host_pool import host_memory

    mem = host_memory()
    return int(min(mem[k] for k in ("total", "limit") if k in mem) / GIB) * 2 + 1


def hs(**kw) -> list[str]:
    return ["--attention-backend", "hisparse", "--additional-config", json.dumps({"hisparse": kw})]


# (name, extra argv, words the one line must hold): every item of issue 18's list, and more
CASES = [
    ("field", hs(top_k=0), "top_k=0 is invalid: use a positive token count"),
    ("unknown key", hs(top_kk=5), "hisparse config: unknown key(s) ['top_kk']; known keys:"),
    ("not an object", ["--attention-backend", "hisparse", "--additional-config", '{"hisparse": 5}'],
     "hisparse=5 is invalid: give an object of settings"),
    ("missing file", ["--hisparse-config", "/nonexistent/hs.json"],
     "'/nonexistent/hs.json' cannot be read (No such file or directory)"),
    ("inline JSON typo", ["--attention-backend", "hisparse", "--additional-config",
                          '{"hisparse": {"top_k": 64,}}'],
     """--additional-config='{"hisparse": {"top_k": 64,}}' is not valid JSON (Expecting"""),
    ("flag JSON typo", ["--hisparse-config", '{"top_k": 64,'],
     """the JSON string '{"top_k": 64,' is not valid JSON (Expecting"""),
    ("file JSON typo", ["--hisparse-config", "@typo"], "is not valid JSON: Expecting"),
    ("no flag value", ["--hisparse-config"], "--hisparse-config has no value"),
    ("unknown policy", hs(policy="mru"),
     'policy=\'mru\' is invalid: use "lru" (what vLLM serves; also served: crf)'),
    ("policy not served", ["--hisparse-config", "@fifo"], "policy='fifo' is available in the simulator"),
    ("prefetch not served", hs(prefetch=True), "prefetch=True is not implemented"),
    ("NaN", hs(host_pool_gib=float("nan")),          # Python's JSON reads NaN (issue 44)
     "host_pool_gib=nan is invalid: NaN and Infinity are not numbers here; give a finite number"),
    ("pool larger than RAM", hs(host_pool_gib=_ram_gib()),
     f"host_pool_gib={_ram_gib()} is invalid: more than "),
    # model-dependent: raised while vLLM builds its config (through pydantic), before the engine
    # (min_context 0: a request of this 1024-token server can be sparse; where none can, vLLM's own
    # backend serves and pins nothing, so the size does not matter; no dense pool: the host holds
    # all 4 layers)
    ("tiny pool", hs(host_pool_gib=0.0001, min_context=0, dense_pool_gib=0),
     "host_pool_gib=0.0001 is invalid: one request of max_model_len=1024 needs 2.0 MiB; set "
     "host_pool_gib to at least 0.00196"),
    ("dense layer beyond the model", hs(dense_layers=[0, 9]),
     "dense_layers=[0, 9] is invalid: the model has 4 layers; drop [9]"),
    # min_context 0: this 1024-token server can hold sparse requests (where none can, vLLM's own
    # backend serves it and any block size stock takes is fine: setup_check.serve_as_stock)
    ("block size", hs(min_context=0) + ["--block-size", "32"],
     "--block-size 32 must equal the hisparse page_size=16"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vllm_hisparse import tiny_model

    return tiny_model.build(str(tmp_path_factory.mktemp("m") / "tiny-llama"))


def _argv(extra, files):
    return [files.get(a[1:], a) if a.startswith("@") else a for a in extra]


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    files = {"typo": d / "typo.json", "fifo": d / "fifo.json"}
    files["typo"].write_text('{"top_k": 64,')
    files["fifo"].write_text('{"policy": "fifo"}')
    files = {k: str(v) for k, v in files.items()}
    base = ["serve", tiny, "--dtype", "float32", "--max-model-len", "1024"]
    cases = [base + _argv(extra, files) for _, extra, _ in CASES]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    r = subprocess.run([PY, "-c", DRIVER, json.dumps(cases)], capture_output=True, text=True,
                       timeout=600, env=env, cwd=ROOT)
    out = [json.loads(m) for m in re.findall(r"^(?:\(\w+ pid=\d+\) )?CASE (\{.*\})$", r.stdout, re.M)]
    assert len(out) == len(CASES), r.stdout[-3000:] + r.stderr[-3000:]
    return {name: res for (name, _, _), res in zip(CASES, out)}, r.stdout


@pytest.mark.vllm
@pytest.mark.parametrize("name, extra, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_and_exit_2(results, name, extra, words):
    res = results[0][name]
    lines = [PREFIX.sub("", x) for x in res["stderr"].splitlines()]
    assert res["code"] == 2 and len(lines) == 1, res
    assert words in lines[0] and lines[0].startswith("hisparse"), lines[0]


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_serve_process_exits_2_with_the_line_last(tiny):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    """The whole process: a model-dependent error (raised inside vLLM's pydantic VllmConfig) is the
    last line of the output, no traceback, exit status 2."""
    vllm = os.path.join(os.path.dirname(PY), "vllm")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    r = subprocess.run([vllm, "serve", tiny, "--dtype", "float32", "--max-model-len", "1024",
                        "--port", str(port), *hs(dense_layers=[0, 9])], capture_output=True, text=True,
                       timeout=600, env=env)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, out[-20:]
    assert "Traceback" not in r.stdout + r.stderr
    assert PREFIX.sub("", r.stderr.strip().splitlines()[-1]) == (
        "hisparse config: dense_layers=[0, 9] is invalid: the model has 4 layers; drop [9]")


# ---- the pieces, without vLLM's parser ---------------------------------------------------------
def test_check_argv_only_when_hisparse_is_concerned():
    cli_check.check_argv(["serve", "m", "--additional-config", "{not json"])    # not ours: vLLM's
    cli_check.check_argv(["serve", "m", "--additional-config", '{"hisparse": {}}'])
    for argv in (["--additional-config", '{"hisparse": {'], ["--additional_config={'hisparse': 1}"],
                 ["--hisparse-config", "f.json", "--additional-config", "{x"]):
        with pytest.raises(SystemExit) as e:
            cli_check.check_argv(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("ns, yes", [
    ({"attention_backend": "hisparse"}, True), ({"attention_backend": "HISPARSE"}, True),
    ({"attention_backend": "FLASH_ATTN"}, False), ({"attention_backend": None}, False),
    ({"attention_backend": None, "attention_config": {"backend": "hisparse"}}, True), ({}, False),
])
def test_selected(ns, yes):
    from types import SimpleNamespace

    assert cli_check.selected(SimpleNamespace(**ns)) is yes


MEM = {"total": 64 * GIB, "available": 40 * GIB}


@pytest.mark.parametrize("gib, mem, line", [
    (65, MEM, "host_pool_gib=65 is invalid: more than this machine's RAM (64.0 GiB); use at most "
              "about 24.0 (60% of the 40.0 GiB available now)"),
    (33, dict(MEM, limit=32 * GIB), "host_pool_gib=33 is invalid: more than the container's memory "
                                    "limit (32.0 GiB); use at most about 19.2 (60% of the 32.0 GiB "
                                    "available now)"),
    (65, {"total": 64 * GIB}, "more than this machine's RAM (64.0 GiB); use at most about 38.4 "
                              "(60% of it)"),
    (64, MEM, None), (1000, {}, None),
])
def test_host_pool_larger_than_ram(capsys, gib, mem, line):
    cfg = HiSparseConfig(host_pool_gib=gib)
    if line is None:
        cli_check.check_host_ram(cfg, mem)
        return
    with pytest.raises(SystemExit) as e:
        cli_check.check_host_ram(cfg, mem)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.rstrip("\n").endswith(line), err


def test_resident_mode_pins_no_host_pool():
    cli_check.check_host_ram(HiSparseConfig(host_pool_gib=10**6, host_tier=False), MEM)


def test_hisparse_error_found_inside_pydantic_and_chains():
    pydantic = pytest.importorskip("pydantic")

    @pydantic.dataclasses.dataclass
    class Cfg:
        x: int = 1

        def __post_init__(self):
            HiSparseConfig(top_k=0)

    with pytest.raises(pydantic.ValidationError) as e:
        Cfg()
    assert cli_check.hisparse_error(e.value) == (
        "hisparse config: top_k=0 is invalid: use a positive token count such as 2048")
    try:
        try:
            raise HiSparseConfigError("hisparse: inner")
        except HiSparseConfigError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        assert cli_check.hisparse_error(outer) == "hisparse: inner"
    assert cli_check.hisparse_error(RuntimeError("Engine core initialization failed")) is None


def test_guard_turns_only_hisparse_errors_into_exit_2(capsys):
    def bad():
        raise HiSparseConfigError("hisparse: x")

    with pytest.raises(SystemExit) as e:
        cli_check.guard(bad)()
    assert e.value.code == 2 and capsys.readouterr().err == "hisparse: x\n"
    with pytest.raises(KeyError):
        cli_check.guard(lambda: {}["k"])()
    assert cli_check.guard(lambda: 7)() == 7
