#!/usr/bin/env bash
# Kernel A/Bs as device calls with no vLLM (each under the 10-minute limit; the extensions built
# here: scripts/build_for_box.sh for the tree, scripts/lab/ab_tree.sh for branches). The
# decode-step bench runs 16 layers a graph, so a launch made once a step weighs as it would in a
# 32-layer model, not 4x more.
#   bash scripts/lab/gpu_ab.sh OUT share  # this tree (~4 min): the decode body's GPU test, then
#       at 32K RESOLVE's share (hot rows against --resident and --resident-first, 1 and 8 rows,
#       0% misses) and ~6% misses
#   bash scripts/lab/gpu_ab.sh OUT trees  # the first tree's select/split/body GPU tests, then hot
#       rows at 1 and 8 rows, 0% and ~6% misses, in each of TREES (default build/ab/*; carry them;
#       ~3.5 min a tree)
# Each tree's results: OUT/NAME/summary.txt and OUT/NAME/kernels.tgz (decode_step.csv and the
# torch profiles per case); AB_REF in a branch tree names its commit.
set -uo pipefail
top=$(mkdir -p "$1" && cd "$1" && pwd); what=$2     # (absolute: the trees' parts run in their folders)
export KLAYERS=${KLAYERS:-16} KSTEPS=${KSTEPS:-40} NO_VLLM=1   # (40 replays: median and min too)
case "$what" in
  share)
    KTESTS="tests/test_decode_body_gpu.py" \
    KBENCH="32768 0 1,8 --resident;32768 0 1,8 --resident-first;32768 0 1,8;32768 0.3 1,8" \
      bash scripts/gpu_session.sh "$top/main" kernels ;;
  trees)
    first=1
    for t in ${TREES:-$(ls -d build/ab/*/)}; do
      n=$(basename "$t")
      tests=" "
      [ -n "$first" ] && tests="tests/test_decode_ops.py tests/test_decode_attention.py tests/test_decode_body_gpu.py"
      first=
      echo "== tree $n: $(cat "$t/AB_REF" 2>/dev/null)"
      (cd "$t" && KTESTS="$tests" KBENCH="32768 0 1,8;32768 0.3 1,8" \
         bash scripts/gpu_session.sh "$top/$n" kernels)
    done ;;
  *) echo "gpu_ab.sh OUT share|trees" >&2; exit 2 ;;
esac
