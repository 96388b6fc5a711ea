"""scripts/wheel_pieces.sh: a wheel too big for one device call is split here and joined on the
box byte for byte; a missing or damaged piece is refused; small wheels are left whole."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "wheel_pieces.sh")


def sh(*args, cwd, env):
    return subprocess.run(["bash", SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.fixture
def wheels(tmp_path):
    if shutil.which("split") is None or shutil.which("sha256sum") is None:
        pytest.skip("coreutils split/sha256sum not found")
    d = tmp_path / ".whl"
    d.mkdir()
    big = os.urandom(2500)
    (d / "big-1.0-py3-none-any.whl").write_bytes(big)
    (d / "small-1.0-py3-none-any.whl").write_bytes(b"tiny")
    env = dict(os.environ, WHEEL_STAGE=str(tmp_path / "stage"), WHEEL_PIECE_BYTES="1000")
    return tmp_path, d, big, env


def test_split_stage_join_round_trip(wheels):
    root, d, big, env = wheels
    r = sh("split", cwd=root, env=env)
    assert r.returncode == 0, r.stderr
    parts = sorted(p for p in os.listdir(d) if ".part" in p)
    assert parts == [f"big-1.0-py3-none-any.whl.part{i}" for i in range(3)]
    assert not (d / "big-1.0-py3-none-any.whl").exists() and (d / "small-1.0-py3-none-any.whl").exists()
    assert sh("stage", cwd=root, env=env).returncode == 0
    for p in parts:                                   # the box's tree: pieces are not carried again
        os.remove(d / p)
    r = sh("join", cwd=root, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (d / "big-1.0-py3-none-any.whl").read_bytes() == big


def test_join_refuses_a_damaged_or_missing_piece(wheels):
    root, d, big, env = wheels
    sh("split", cwd=root, env=env)
    sh("stage", cwd=root, env=env)
    stage = root / "stage"
    (stage / "big-1.0-py3-none-any.whl.part1").write_bytes(b"x" * 1000)
    r = sh("join", cwd=root, env=env)
    assert r.returncode == 1 and "damaged" in r.stdout
    assert not (d / "big-1.0-py3-none-any.whl").exists()
    for p in stage.glob("big-*.part*"):
        p.unlink()
    r = sh("join", cwd=root, env=env)
    assert r.returncode == 1 and "no pieces" in r.stdout
