#!/usr/bin/env bash
# Builds the CUDA extension here for the GPU box's Python 3.12 (torch 2.11.0 + CUDA 13, sm_90), so
# a device call can carry vllm_hisparse/_C.cpython-312-x86_64-linux-gnu.so instead of building it
# on the box (~65 s of device time; gpu_setup.sh uses a carried build when it imports). ~3 min on
# 2 cores; the first run also downloads torch 2.11.0 for Python 3.12 (~900 MB, --no-deps) into
# a venv under /tmp. Needs python3.12 (pyenv's 3.12 here), nvcc 13 and `make setup`'s .venv (its
# nvidia/ headers, CUDA 13 builds, are linked into the 3.12 venv).
#   bash scripts/build_for_box.sh            # then carry vllm_hisparse/_C.cpython-312-x86_64-linux-gnu.so
# BOX_REF=<commit>: build that commit's tracked files instead; BOX_OUT=<dir>: put the .so there
# (scripts/lab/ab_tree.sh uses both for a second tree).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${BOX_VENV:-/tmp/py312-box}
py=
for c in "$(command -v python3.12 2>/dev/null)" /root/.pyenv/versions/3.12*/bin/python3.12; do
  [ -n "$c" ] && "$c" -V > /dev/null 2>&1 && { py=$c; break; }   # (a pyenv shim may not run)
done
[ -n "$py" ] || { echo "build_for_box: no python3.12 on this machine" >&2; exit 1; }
nv=$(ls -d "$root"/.venv/lib/python3.*/site-packages/nvidia 2>/dev/null | head -1)
[ -n "$nv" ] || { echo "build_for_box: no .venv/.../nvidia (run make setup first)" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --no-deps torch==2.11.0
  "$venv/bin/pip" install -q setuptools wheel numpy typing_extensions sympy filelock jinja2 networkx fsspec
fi
ln -sfn "$nv" "$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/nvidia"
# a copy of the tracked tree (the working tree's edits included), so the build leaves no files here
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${BOX_REF:-}" ]; then
  git -C "$root" archive "$BOX_REF" | tar -xf - -C "$work"
else
  (cd "$root" && git ls-files -z | tar --null -cf - -T -) | tar -xf - -C "$work"
fi
(cd "$work" && MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" setup.py build_ext --inplace > build.log 2>&1) \
  || { tail -20 "$work/build.log"; exit 1; }
dest=${BOX_OUT:-$root/vllm_hisparse}
cp "$work"/vllm_hisparse/_C.cpython-312-x86_64-linux-gnu.so "$dest/"
echo "built $dest/_C.cpython-312-x86_64-linux-gnu.so"
