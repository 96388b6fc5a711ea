#!/usr/bin/env bash
# Source on the GPU box once every bundle piece is staged: installs vLLM, builds our extension in
# place, exposes our entry points without pip (a dist-info folder on the path), sets the env.
#   source scripts/gpu_setup.sh OUT
# NO_VLLM=1: kernels only (while bundle pieces are still being staged): no install, no plugin.
set -euo pipefail
out=$1
mkdir -p "$out"
site=${GPU_SITE:-/tmp/site}     # where the bundle installs vLLM (a test points it elsewhere)
if [ -z "${NO_VLLM:-}" ] && [ ! -d $site/vllm ]; then
  bash .gpu-bundle/install-vllm-bundle.sh install > "$out/install.log" 2>&1 || { tail -30 "$out/install.log"; exit 1; }
fi
# wheels that came in pieces (scripts/wheel_pieces.sh: ray's is over one call's 64 MiB)
if [ -f /tmp/wheel-stage/PIECES.sha256 ]; then mkdir -p .whl && bash scripts/wheel_pieces.sh join .whl; fi
if ls .whl/*.whl > /dev/null 2>&1; then pip install -q --no-index --no-deps --target $site .whl/*.whl; fi
# the tree first: a copy of vllm_hisparse installed into /tmp/site (gpu_docker_replay.sh) must
# not shadow the working tree that the later calls of a session carry
export PYTHONPATH=$PWD:$site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 PYTHONUNBUFFERED=1
# Sourced again by a script this one's caller runs (a chain -> gpu_session.sh -> gpu_serving.sh):
# the tree's extension was checked here already, so the two Python starts below (each imports
# torch and the extension) are skipped; HISPARSE_GPU_SETUP names the tree that passed them.
again=$([ "${HISPARSE_GPU_SETUP:-}" = "$PWD" ] && [ -z "${NO_VLLM:-}" ] && echo 1 || true)
# A carried build (vllm_hisparse/_C*.so, same torch) is used when it imports; else build here.
if [ -z "$again" ] && ! python3 -c "from vllm_hisparse.ops import kernels as k; assert k.available(), k.import_error()" 2>/dev/null; then
  ( time MAX_JOBS=16 python3 setup.py build_ext --inplace ) > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi
d=$site/vllm_hisparse-0.1.0.dist-info
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: vllm-hisparse\nVersion: 0.1.0\n' > "$d/METADATA"
printf '[vllm.general_plugins]\nhisparse = vllm_hisparse.vllm.plugin:register\n\n[vllm.stat_logger_plugins]\nhisparse_steps = vllm_hisparse.vllm.step_log:StepLogger\n' > "$d/entry_points.txt"
if [ -z "$again" ]; then
  python3 -c "from vllm_hisparse.ops import kernels as k; assert k.available(), k.import_error(); print('extension ok')"
  [ -n "${NO_VLLM:-}" ] || export HISPARSE_GPU_SETUP=$PWD
else
  echo "extension ok (checked when this tree was set up)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# the box's git metadata may be older than the carried tree: say how many files differ from it
{ c=$(git rev-parse --short HEAD 2>/dev/null) && n=$(git status --porcelain 2>/dev/null | wc -l) \
  && echo "$c$([ "$n" -gt 0 ] && echo " + $n files changed since")"; } | tee "$out/commit.txt" || true
