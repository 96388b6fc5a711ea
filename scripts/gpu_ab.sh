#!/usr/bin/env bash
# The A/Bs prepared on 2026-12-04 (sixth session, no device lent), as device calls with no vLLM
# (each under the 10-minute limit; the extensions built here: scripts/build_for_box.sh for the
# tree, scripts/ab_tree.sh for the branches). The decode-step bench runs 16 layers a graph, so a
# launch made once a step weighs as it would in a 32-layer model, not 4x more.
#   bash scripts/gpu_ab.sh OUT wt     # this tree (~7 min): the step write-through's GPU tests;
#       at 32K, one row: resident, resident-first with the write-through per layer / at the step's
#       end / none; hot rows at 1 and 8 rows, per layer / at the step's end; ~6% misses
#   bash scripts/gpu_ab.sh OUT trees  # build/ab/m0fast's GPU tests (the select, the split, the
#       body: it holds miss-flag's commits too), then hot rows at 1 and 8 rows, 0% and ~6% misses,
#       in build/ab/missflag and build/ab/m0fast (carry both; ~7 min). TREES="..." for others.
# Each tree's results: OUT/NAME/summary.txt and OUT/NAME/kernels.tgz (decode_step.csv and the
# torch profiles per case); AB_REF in a branch tree names its commit.
set -uo pipefail
top=$(mkdir -p "$1" && cd "$1" && pwd); what=$2     # (absolute: the trees' parts run in their folders)
export KLAYERS=${KLAYERS:-16} KSTEPS=${KSTEPS:-40} NO_VLLM=1   # (40 replays: median and min too)
case "$what" in
  wt)
    KTESTS="tests/test_write_through_step.py tests/test_decode_body_gpu.py" \
    KBENCH="32768 0 1 --resident;32768 0 1 --resident-first;32768 0 1 --resident-first --write-through step;32768 0 1 --resident-first --no-write-through;32768 0 1,8;32768 0 1,8 --write-through step;32768 0.3 1,8" \
      bash scripts/gpu_session.sh "$top/main" kernels ;;
  trees)
    first=1
    for t in ${TREES:-build/ab/m0fast build/ab/missflag}; do
      n=$(basename "$t")
      tests=" "
      [ -n "$first" ] && tests="tests/test_decode_ops.py tests/test_decode_attention.py tests/test_decode_body_gpu.py"
      first=
      echo "== tree $n: $(cat "$t/AB_REF" 2>/dev/null)"
      (cd "$t" && KTESTS="$tests" KBENCH="32768 0 1,8;32768 0.3 1,8" \
         bash scripts/gpu_session.sh "$top/$n" kernels)
    done ;;
  *) echo "gpu_ab.sh OUT wt|trees" >&2; exit 2 ;;
esac
