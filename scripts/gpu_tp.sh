#!/usr/bin/env bash
# Issue 18, tensor parallelism on two GPUs (nvidia-h200-x2), one check per call (each fits the
# 10-minute limit). Not run yet: no two-GPU machine was lent when it was written (2026-12-01).
#   bash scripts/gpu_tp.sh OUT mp       # resident + hisparse at TP=2, vLLM's mp executor, compared
#   bash scripts/gpu_tp.sh OUT ray      # the same with --distributed-executor-backend ray; also
#                                       # checks HISPARSE_STATS_FILE reached both Ray workers
#   bash scripts/gpu_tp.sh OUT refuse   # host_pool_gib far above the host's RAM at TP=2: refused
#                                       # at startup, one line naming host_pool_gib
# Ray is not in the vLLM bundle: carry its wheel in .whl/ (`pip download ray==<version> --no-deps
# -d .whl` on a machine with a registry; scripts/gpu_setup.sh installs .whl/*.whl with --no-deps, so
# ray's own requirements must already be in the bundle or carried as well).
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
