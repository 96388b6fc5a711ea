#!/usr/bin/env bash
# Issue 18, tensor parallelism on two GPUs (nvidia-h200-x2), one check per call (each fits the
# 10-minute limit). Not run yet: no two-GPU machine was lent when it was written (2026-12-01).
#   bash scripts/gpu_tp.sh OUT mp       # resident + hisparse at TP=2, vLLM's mp executor, compared
#   bash scripts/gpu_tp.sh OUT ray      # the same with --distributed-executor-backend ray; also
#                                       # checks HISPARSE_STATS_FILE reached both Ray workers
#   bash scripts/gpu_tp.sh OUT refuse   # host_pool_gib far above the host's RAM at TP=2: refused
#                                       # at startup, one line naming host_pool_gib
# Ray is not in the vLLM bundle and its wheel (79 MB) is over one call's 64 MiB: here
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl ray==2.60.0 (+ any of its requirements the box lacks)
#   bash scripts/wheel_pieces.sh split .whl      # ray -> .whl/ray-*.whl.part0, .part1
# then one call per piece, carrying it and .whl/PIECES.sha256: `bash scripts/wheel_pieces.sh stage`;
# scripts/gpu_setup.sh joins the staged pieces and installs .whl/*.whl (--no-deps).
# Writes OUT/tp-<mode>/ (the runs' JSON and logs) and OUT/tp-<mode>.txt (the summary).
set -uo pipefail
out=$1; mode=$2
source scripts/gpu_setup.sh "$out"
dir="$out/tp-$mode"
mkdir -p "$dir"
export HISPARSE_TP=2
case "$mode" in
  mp|ray)
    [ "$mode" = ray ] && export HISPARSE_EXECUTOR=ray
    { python3 scripts/gpu_exactness.py run resident "$dir"
      HISPARSE_STATS_FILE="$dir/stats.json" python3 scripts/gpu_exactness.py run hisparse "$dir"
      python3 scripts/gpu_exactness.py compare "$dir"
      # one stats file per rank (rank 0 keeps the name): written by each worker, so with Ray this
      # shows HISPARSE_STATS_FILE reached both
      for f in "$dir/stats.json" "$dir/stats.json.rank1"; do
        if [ -f "$f" ]; then echo "stats file $f: $(head -c 300 "$f")"; else echo "MISSING $f"; fi
      done
    } 2>&1 | tee "$out/tp-$mode.txt"
    ;;
  refuse)
    { start=$(date +%s)
      HISPARSE_EXTRA='{"host_pool_gib": 100000}' python3 scripts/gpu_exactness.py run hisparse "$dir"
      echo "rc=$? after $(( $(date +%s) - start )) s"
      grep -m1 -o "hisparse: host_pool_gib=100000 needs[^\[]*" "$dir/hisparse.log" || echo "NO REFUSAL LINE"
    } 2>&1 | tee "$out/tp-$mode.txt"
    ;;
  *) echo "mode: mp, ray or refuse"; exit 2 ;;
esac
