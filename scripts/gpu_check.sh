#!/usr/bin/env bash
# On the GPU box, once every bundle piece is staged: set up, then run GPU test files one pytest
# process each (a crash in one file does not hide the others). One log, OUT/pytest.log (the box
# sends back at most 8 files).
#   [NO_VLLM=1] bash scripts/gpu_check.sh OUT test_file...
set -uo pipefail
out=$1; shift
source scripts/gpu_setup.sh "$out"
set +e
for f in "$@"; do
  name=$(basename "$f" .py)
  python3 -X faulthandler -m pytest -q -m "cuda" -p no:cacheprovider "$f" > "/tmp/pytest-$name.log" 2>&1
  rc=$?
  { echo "===== $f rc=$rc"; cat "/tmp/pytest-$name.log"; } >> "$out/pytest.log"
  echo "== $f rc=$rc: $(tail -1 "/tmp/pytest-$name.log")"
done
