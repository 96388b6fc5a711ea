#!/usr/bin/env bash
# The image's build step (docker/Dockerfile runs it; scripts/gpu_docker_replay.sh replays it on the
# GPU box): compile the CUDA extension and install this package offline without dependencies
# (vLLM and torch come with the base image), then check the installed copy from outside the source
# tree. Any failure fails the build.
#   HISPARSE_PIP_TARGET=DIR  install into DIR (pip --target: the GPU box's /tmp/site) instead of
#                            the interpreter's site-packages
#   HISPARSE_CUDA_ARCHS, MAX_JOBS  as for setup.py (the Dockerfile sets both)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc > /dev/null || { echo "build.sh: no nvcc: the CUDA extension cannot be built" >&2; exit 1; }
echo "build.sh: $(nvcc --version | tail -1); archs ${HISPARSE_CUDA_ARCHS:-90}; MAX_JOBS ${MAX_JOBS:-}"
target=()
[ -n "${HISPARSE_PIP_TARGET:-}" ] && target=(--target "$HISPARSE_PIP_TARGET")
python3 -m pip install --no-build-isolation --no-deps --no-index --upgrade "${target[@]}" .
rm -rf build ./*.egg-info            # pip built in the tree; the image keeps the installed copy only
cd /                                 # import the installed package, not ./vllm_hisparse
python3 - <<'PY'
import importlib.metadata as md
import os

import vllm_hisparse
from vllm_hisparse.ops import kernels

assert kernels.available(), f"the CUDA extension does not load: {kernels.import_error()}"
pkg = os.path.dirname(vllm_hisparse.__file__)
assert os.path.dirname(kernels._ext.__file__) == pkg, f"extension {kernels._ext.__file__} not in {pkg}"
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "hisparse"]
assert eps == ["vllm_hisparse.vllm.plugin:register"], f"vLLM plugin entry point: {eps}"
v = md.version("vllm")
assert v.startswith("0.26."), f"vllm-hisparse supports vLLM 0.26.x; found {v}"
print(f"build.sh: check ok: vllm {v}, extension {kernels._ext.__file__}")
PY
