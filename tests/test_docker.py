"""docker/Dockerfile checked against the tree (no Docker engine here): the base image is the vLLM
release the project supports, every COPY source exists and survives .dockerignore, the package's
build inputs are copied, the V1-runner setting and the entrypoint are there and the entrypoint
selects hisparse. scripts/gpu_docker_replay.sh replays the build on the GPU box."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")
ENTRYPOINT = os.path.join(ROOT, "docker", "entrypoint.sh")

_spec = importlib.util.spec_from_file_location(
    "dockerfile_replay", os.path.join(ROOT, "scripts", "dockerfile_replay.py"))
replay = sys.modules["dockerfile_replay"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)

STEPS = replay.parse(DOCKERFILE)
IGNORE = replay.dockerignore(ROOT)


def ops(name: str) -> list[str]:
    return [s.args for s in STEPS if s.op == name]


def supported_vllm() -> str:
    """The vLLM release make setup installs on a GPU, checked against compat.py's supported series."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        pin = re.search(r"install vllm==([0-9.]+)", f.read()).group(1)
    with open(os.path.join(ROOT, "vllm_hisparse", "vllm", "compat.py")) as f:
        series = re.search(r'^SUPPORTED = "([0-9.]+)"', f.read(), re.M).group(1)
    assert pin.startswith(series), (pin, series)
    return pin


def test_base_image_is_the_supported_vllm():
    assert ops("FROM") == [f"vllm/vllm-openai:v{supported_vllm()}"]


def test_every_copy_source_exists_and_is_in_the_context():
    copied = set()
    for args in ops("COPY"):
        srcs, _ = replay.copy_args(args)
        for s in srcs:
            assert os.path.exists(os.path.join(ROOT, s)), f"COPY {s}: not in the tree"
            assert not replay.ignored(s, IGNORE), f"COPY {s}: excluded by .dockerignore"
            copied.add(s)
    # what `pip install .` needs: setup.py, the sources of the extension, the package
    assert {"setup.py", "csrc", "vllm_hisparse", "docker/build.sh", "docker/entrypoint.sh"} <= copied


@pytest.mark.parametrize("path, out", [
    (".venv/lib/x.py", True), ("models/smollm2-135m/config.json", True), (".git/HEAD", True),
    ("vllm_hisparse/_C.cpython-312-x86_64-linux-gnu.so", True), ("build/temp/x.o", True),
    ("vllm_hisparse/ops/__pycache__/kernels.cpython-312.pyc", True), ("csrc/bindings.cpp", False),
    ("vllm_hisparse/sim/data/smollm2-gpl3-topk.npz", False), ("setup.py", False),
])
def test_dockerignore_keeps_local_builds_and_models_out(path, out):
    """A local _C*.so would stand in for the image's own build; .venv and models are large."""
    assert replay.ignored(path, IGNORE) is out


def test_v1_runner_build_step_and_entrypoint():
    env = {}
    for args in ops("ENV"):
        env.update(replay.pairs(args, {}))
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "bash docker/build.sh" in ops("RUN")
    (entry,) = ops("ENTRYPOINT")
    (path,) = json.loads(entry)
    assert path == "/opt/vllm-hisparse/docker/entrypoint.sh"
    assert "/opt/vllm-hisparse" in ops("WORKDIR") and "./docker/" in ops("COPY")[-1]
    mode = subprocess.run(["git", "ls-files", "-s", "docker/entrypoint.sh", "docker/build.sh"],
                          cwd=ROOT, capture_output=True, text=True).stdout.split()
    if mode:                                                 # a git checkout: executable bits
        assert mode[0] == "100755" and mode[4] == "100755", mode


def test_replay_copies_the_image_tree(tmp_path):
    """The replay (without its RUN steps) lays out what the image would hold, minus ignored files."""
    rec = replay.replay(DOCKERFILE, str(tmp_path), run=False, log=lambda *a: None)
    assert rec["ok"] and rec["from"] == f"vllm/vllm-openai:v{supported_vllm()}"
    assert rec["entrypoint"] == [str(tmp_path / "opt/vllm-hisparse/docker/entrypoint.sh")]
    assert os.access(rec["entrypoint"][0], os.X_OK)
    assert rec["workdir"] == str(tmp_path / "workspace")
    app = tmp_path / "opt" / "vllm-hisparse"
    assert (app / "vllm_hisparse" / "vllm" / "plugin.py").exists() and (app / "csrc").is_dir()
    assert not list(app.rglob("*.so")) and not list(app.rglob("__pycache__"))
    assert [s["status"] for s in rec["steps"] if s["op"] == "RUN"] == ["not run", "not run"]


def entrypoint(*args, **env) -> list[str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("HISPARSE_CONFIG", "VLLM_USE_V2_MODEL_RUNNER")}
    e.update(HISPARSE_ENTRYPOINT_DRY_RUN="1", **env)
    r = subprocess.run(["bash", ENTRYPOINT, *args], capture_output=True, text=True, env=e, check=True)
    return r.stdout.splitlines()


def test_entrypoint_selects_hisparse_and_the_v1_runner(tmp_path):
    mount = str(tmp_path / "none.json")
    out = entrypoint("MODEL", "--port", "8000", HISPARSE_CONFIG_MOUNT=mount)
    assert out[0] == "VLLM_USE_V2_MODEL_RUNNER=0"
    assert out[-5:] == ["MODEL", "--port", "8000", "--attention-backend", "hisparse"]
    assert out[1:3] in (["vllm", "serve"], ["python3", "-m"])


def test_entrypoint_passes_the_mounted_config(tmp_path):
    mount = tmp_path / "config.json"
    mount.write_text("{}")
    out = entrypoint("MODEL", HISPARSE_CONFIG_MOUNT=str(mount))
    assert out[-4:] == ["--hisparse-config", str(mount), "--attention-backend", "hisparse"]
    # HISPARSE_CONFIG wins over the mount; the command line wins over both
    out = entrypoint("MODEL", HISPARSE_CONFIG_MOUNT=str(mount), HISPARSE_CONFIG="/x.json")
    assert out[-4:-2] == ["--hisparse-config", "/x.json"]
    out = entrypoint("MODEL", "--additional-config", '{"hisparse": {"top_k": 64}}',
                     HISPARSE_CONFIG_MOUNT=str(mount), HISPARSE_CONFIG="/x.json")
    assert "--hisparse-config" not in out
    out = entrypoint("MODEL", "--attention-backend=FLASH_ATTN", HISPARSE_CONFIG_MOUNT=mount.name)
    assert out.count("--attention-backend") == 0 and "--attention-backend=FLASH_ATTN" in out
