"""scripts/gpu_session.sh's part ``ngram`` (issue 47 item 3) dry-run on the CPU: stand-ins for
python3, nvidia-smi, scripts/gpu_setup.sh and scripts/gpu_serving.sh record what the box would run.
(a) four exactness engines (resident, hisparse, resident2, control) with EXACT_SPEC=3 and the
compare; (b) bench.serving only with SPEC_MODEL and SPEC_TEXT, with the ngram config, repeated
real-text blocks, one request."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PY = """#!/bin/sh
echo "EXACT_SPEC=${EXACT_SPEC:-} $*" >> "$FAKE_ARGS"
case "$*" in *" compare "*) echo "EXACT" ;; esac
exit 0
"""
SERVING = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_SERVING"
echo "speedup stock: TPOT 2.00 / 1.00 = 2.000"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="bash / coreutils timeout not found")


def _exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def box(tmp_path):
    tree, bin_dir = tmp_path / "tree", tmp_path / "bin"
    (tree / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    for f in ("gpu_session.sh", "gpu_lib.sh"):
        shutil.copy(os.path.join(ROOT, "scripts", f), tree / "scripts" / f)
    (tree / "scripts" / "gpu_setup.sh").write_text("true\n")
    _exe(tree / "scripts" / "gpu_serving.sh", SERVING)
    _exe(bin_dir / "python3", PY)
    _exe(bin_dir / "nvidia-smi", "#!/bin/sh\necho 81559\n")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               FAKE_ARGS=str(tmp_path / "args.txt"), FAKE_SERVING=str(tmp_path / "serving.txt"))
    for k in ("NGRAM_EXACT", "SPEC_MODEL", "SPEC_TEXT", "SPEC_K", "EXACT_SPEC", "BACKENDS"):
        env.pop(k, None)

    def run(**kw):
        r = subprocess.run(["bash", "scripts/gpu_session.sh", str(tmp_path / "out"), "ngram"],
                           cwd=tree, env=dict(env, **kw), capture_output=True, text=True,
                           timeout=120)
        calls = (tmp_path / "args.txt").read_text().splitlines() if (
            tmp_path / "args.txt").exists() else []
        serving = (tmp_path / "serving.txt").read_text().splitlines() if (
            tmp_path / "serving.txt").exists() else None
        for f in ("args.txt", "serving.txt"):
            (tmp_path / f).unlink(missing_ok=True)
        return r, calls, serving
    return run


def test_exactness_engines_with_speculation_and_no_speedup_without_a_model(box):
    r, calls, serving = box()
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [c for c in calls if "gpu_exactness.py run" in c]
    assert sorted(c.split()[3] for c in runs) == ["control", "hisparse", "resident", "resident2"]
    assert all(c.startswith("EXACT_SPEC=3 ") for c in runs), runs
    cmp = [c for c in calls if "gpu_exactness.py compare" in c]
    assert len(cmp) == 1 and cmp[0].startswith("EXACT_SPEC=3 ") and cmp[0].endswith(" hisparse")
    assert "== verdict ngram rc=0" in r.stdout
    assert serving is None and "ngram speedup: skipped" in r.stdout


def test_speedup_on_a_real_model_only(box):
    r, calls, serving = box(NGRAM_EXACT="0", SPEC_MODEL="/models/q", SPEC_TEXT="/ids.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [c for c in calls if "gpu_exactness.py" in c]            # (a) skipped
    arg = lambda k: serving[serving.index(k) + 1]                         # noqa: E731
    assert (arg("--model"), arg("--text-ids"), arg("--load-format")) == ("/models/q", "/ids.json",
                                                                          "auto")
    assert (arg("--concurrency"), arg("--repeat-block"), arg("--output-len")) == ("1", "256", "256")
    assert arg("--backends") == "stock,hisparse"
    assert json.loads(arg("--speculative")) == {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert "speedup stock: TPOT" in r.stdout
