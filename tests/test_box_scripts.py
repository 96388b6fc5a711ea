"""The GPU-box shell scripts on the CPU: each one parses (bash -n); the GPU test loop is written once,
in scripts/gpu_lib.sh, and no other script runs `pytest -m cuda` in a loop of its own; cuda_tests
and box_setup run here with a stand-in python3 and a stand-in scripts/gpu_setup.sh."""
from __future__ import annotations

import glob
import os
import re
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LIB = os.path.join(ROOT, "scripts", "gpu_lib.sh")
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
                 + glob.glob(os.path.join(ROOT, "scripts", "lab", "*.sh")))
# the scripts that run GPU test files, each through the library's cuda_tests
USERS = ("gpu_check.sh", "gpu_validate.sh", "gpu_session.sh", "gpu_dsa.sh")

# a pytest-like stand-in: the file named last decides the outcome (pass, fail, hang); every
# call's arguments are appended to $FAKE_ARGS
FAKE_PYTHON = """#!/bin/sh
for a; do f=$a; done
echo "$*" >> "$FAKE_ARGS"
case "$f" in
  *fail*) echo "FAILED $f::test_one - AssertionError: 3 != 4"; echo "1 failed, 2 passed in 0.10s"; exit 1 ;;
  *hang*) sleep 30 ;;
  *) echo "..."; echo "3 passed in 0.10s"; exit 0 ;;
esac
"""

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="bash / coreutils timeout not found")


def pytest_loops(text):
    """Line numbers of `pytest ... -m cuda` runs inside a for/while loop of a shell script."""
    depth, found = 0, []
    for n, line in enumerate(text.splitlines(), 1):
        code = re.sub(r"(^|\s)#.*", "", line)                 # (not ${n##*_})
        depth += len(re.findall(r"(?:^|[;\s])do(?=$|[;\s])", code))
        if depth > 0 and re.search(r"pytest\b.*-m\s+[\"']?cuda", code):
            found.append(n)
        depth -= len(re.findall(r"(?:^|[;\s])done(?=$|[;\s|>)])", code))
    return found


@needs_bash
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_script_parses(path):
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_loop_detector_finds_a_loop():
    old = ('for f in "$@"; do\n'
           '  python3 -X faulthandler -m pytest -q -m "cuda" -p no:cacheprovider "$f" > log 2>&1\n'
           'done\n')
    assert pytest_loops(old) == [2]
    one = 'timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/a.py -k stock\n'
    assert pytest_loops(one) == []
    assert pytest_loops("for b in 8 11; do for w in 4 8; do\n  echo\ndone; done\n" + one) == []


def test_only_the_library_loops_over_gpu_tests():
    assert LIB in SCRIPTS and pytest_loops(open(LIB).read())      # (the one loop is the library's)
    loops = {os.path.relpath(p, ROOT): pytest_loops(open(p).read()) for p in SCRIPTS if p != LIB}
    assert {p: n for p, n in loops.items() if n} == {}
    for name in USERS:
        text = open(os.path.join(ROOT, "scripts", name)).read()
        assert "source scripts/gpu_lib.sh" in text and "cuda_tests " in text, name


@pytest.fixture
def fake_python(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    py = bin_dir / "python3"
    py.write_text(FAKE_PYTHON)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               FAKE_ARGS=str(tmp_path / "args.txt"))
    return tmp_path, env


def cuda_tests(args, env):
    return subprocess.run(["bash", "-c", 'source "$0"; cuda_tests "$@"; echo "returned $?"', LIB, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True)


@needs_bash
def test_cuda_tests_one_line_a_file(fake_python):
    tmp, env = fake_python
    logs = tmp / "logs"
    r = cuda_tests([str(logs), "20", "-x", "-k", "not slow", "tests/test_ok.py", "tests/test_fail.py"],
                   env)
    assert r.stdout.splitlines() == [
        "== tests/test_ok.py rc=0: 3 passed in 0.10s",
        "== tests/test_fail.py rc=1: 1 failed, 2 passed in 0.10s",
        "FAILED tests/test_fail.py::test_one - AssertionError: 3 != 4",
        "returned 0",
    ], r.stderr
    assert (logs / "pytest-test_ok.log").read_text() == "...\n3 passed in 0.10s\n"
    assert "1 failed" in (logs / "pytest-test_fail.log").read_text()
    calls = (tmp / "args.txt").read_text().splitlines()
    assert calls == [f"-X faulthandler -m pytest -q -m cuda -p no:cacheprovider -x -k not slow {f}"
                     for f in ("tests/test_ok.py", "tests/test_fail.py")]


@needs_bash
def test_cuda_tests_limit_and_no_files(fake_python):
    tmp, env = fake_python
    r = cuda_tests([str(tmp / "logs"), "1", "tests/test_hang.py", "tests/test_ok.py"], env)
    assert r.stdout.splitlines()[:2] == ["== tests/test_hang.py rc=124: ",
                                         "== tests/test_ok.py rc=0: 3 passed in 0.10s"], r.stderr
    r = cuda_tests([str(tmp / "none"), "1"], env)                # KTESTS=" ": the tests left out
    assert r.stdout == "returned 0\n" and r.stderr == ""


@needs_bash
@pytest.mark.parametrize("ok", [True, False])
def test_box_setup(tmp_path, ok):
    # a stand-in scripts/gpu_setup.sh in a scratch tree, sourced as the box's scripts do
    (tmp_path / "scripts").mkdir()
    shutil.copy(LIB, tmp_path / "scripts" / "gpu_lib.sh")
    (tmp_path / "scripts" / "gpu_setup.sh").write_text(
        'set -euo pipefail\nout=$1\necho "setting up $out"\n'
        + ('export SETUP_DONE=1\n' if ok else 'echo "build failed"; false\n'))
    out = tmp_path / "o"
    r = subprocess.run(["bash", "-c", 'source scripts/gpu_lib.sh; box_setup "$0"; set +e; '
                        'echo "after setup: ${SETUP_DONE:-none} $-"', str(out)],
                       cwd=tmp_path, capture_output=True, text=True)
    assert (out / "setup.log").read_text().startswith(f"setting up {out}\n")
    if ok:
        assert r.returncode == 0 and r.stdout.startswith("after setup: 1 ") and "u" in r.stdout
    else:
        assert r.returncode == 1 and r.stdout == f"setting up {out}\nbuild failed\n"


@needs_bash
def test_gpu_setup_sourced_again_skips_its_python_checks(tmp_path):
    """scripts/gpu_setup.sh sourced by a chain, then by the scripts it runs (children inherit
    HISPARSE_GPU_SETUP): the extension's two Python checks run once per tree, again for another
    tree, and always under NO_VLLM (the kernels-only build, which exports nothing)."""
    bin_, site, log = tmp_path / "bin", tmp_path / "site", tmp_path / "calls"
    bin_.mkdir()
    (site / "vllm").mkdir(parents=True)
    for name, body in (("python3", 'echo "$*" >> "$FAKE_ARGS"; exit 0\n'),
                       ("nvidia-smi", "echo 'GPU, 1 MiB, 0'\n")):
        p = bin_ / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    for tree in ("a", "b"):
        (tmp_path / tree / "scripts").mkdir(parents=True)
        shutil.copy(os.path.join(ROOT, "scripts", "gpu_setup.sh"), tmp_path / tree / "scripts")
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", FAKE_ARGS=str(log),
               GPU_SITE=str(site))
    env.pop("HISPARSE_GPU_SETUP", None)

    def run(script):
        log.write_text("")
        r = subprocess.run(["bash", "-c", script], cwd=tmp_path / "a", env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout, len(log.read_text().splitlines())

    out, calls = run("source scripts/gpu_setup.sh o1")
    assert calls == 2
    out, calls = run('source scripts/gpu_setup.sh o1 > /dev/null; : > "$FAKE_ARGS"; '
                     'bash -c "source scripts/gpu_setup.sh o2"')
    assert calls == 0 and "checked when this tree was set up" in out
    out, calls = run('source scripts/gpu_setup.sh o1 > /dev/null; : > "$FAKE_ARGS"; '
                     'cd ../b && bash -c "source scripts/gpu_setup.sh o2"')
    assert calls == 2, "another tree is checked again"
    out, calls = run('source scripts/gpu_setup.sh o1 > /dev/null; : > "$FAKE_ARGS"; '
                     'NO_VLLM=1 bash -c "source scripts/gpu_setup.sh o2"')
    assert calls == 2, "NO_VLLM checks the build every time"
    assert (site / "vllm_hisparse-0.1.0.dist-info" / "entry_points.txt").exists()
