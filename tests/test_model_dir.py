"""model_dir.build_once: a model folder appears whole or not at all, whoever builds it first."""
from __future__ import annotations

import os

from vllm_hisparse.model_dir import build_once


def ready(d: str) -> bool:
    return os.path.exists(os.path.join(d, "done"))


def make_into(tag: str):
    def make(d: str) -> None:
        with open(os.path.join(d, "weights"), "w") as f:
            f.write(tag)
        open(os.path.join(d, "done"), "w").close()
    return make


def content(d: str) -> str:
    with open(os.path.join(d, "weights")) as f:
        return f.read()


def test_built_once_then_reused(tmp_path):
    out = str(tmp_path / "m")
    assert build_once(out, ready, make_into("first")) == out and content(out) == "first"
    build_once(out, ready, make_into("second"))                 # ready: make is not called
    assert content(out) == "first"
    assert sorted(os.listdir(tmp_path)) == ["m"]                # no temporary folder left


def test_a_stale_folder_is_replaced_whole(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "weights").write_text("half-written")                # no "done": not ready
    build_once(str(out), ready, make_into("new"))
    assert content(str(out)) == "new" and ready(str(out))
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_the_first_published_wins(tmp_path):
    out = str(tmp_path / "m")

    def racing(d: str) -> None:              # another process publishes while we build
        os.makedirs(d + "-x")
        make_into("other")(d + "-x")
        os.rename(d + "-x", out)
        make_into("ours")(d)

    build_once(out, ready, racing)
    assert content(out) == "other"
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_a_failed_build_leaves_nothing(tmp_path):
    out = str(tmp_path / "m")

    def broken(d: str) -> None:
        open(os.path.join(d, "weights"), "w").close()
        raise RuntimeError("disk full")

    try:
        build_once(out, ready, broken)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the build's error must reach the caller")
    assert os.listdir(tmp_path) == []
