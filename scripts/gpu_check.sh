#!/usr/bin/env bash
# On the GPU box, once every bundle piece is staged: set up, run the GPU tests (kernels, runtime
# pieces), then the decode-step profile. Logs under OUT.
#   bash scripts/gpu_check.sh OUT [pytest paths...]
set -uo pipefail
out=$1; shift
source scripts/gpu_setup.sh "$out"
set +e
python3 -m pytest -q -m "cuda" -p no:cacheprovider "${@:-tests}" > "$out/pytest-gpu.log" 2>&1
echo "pytest rc=$?"; tail -15 "$out/pytest-gpu.log"
