#!/usr/bin/env bash
# On the GPU box, once every bundle piece is staged: set up, then run GPU test files one pytest
# process each (a crash in one file does not hide the others). One log, OUT/pytest.log (the box
# sends back at most 8 files): the result lines, then each file's whole output.
#   [NO_VLLM=1] bash scripts/gpu_check.sh OUT test_file...
set -uo pipefail
out=$1; shift
source scripts/gpu_setup.sh "$out"
source scripts/gpu_lib.sh
set +e
cuda_tests /tmp 0 "$@" | tee -a "$out/pytest.log"
for f in "$@"; do
  { echo "===== $f"; cat "/tmp/pytest-$(basename "$f" .py).log"; } >> "$out/pytest.log"
done
