#!/usr/bin/env bash
# Nsight Compute on the select (select_resolve_kernel) of the decode-step bench, hot slots against
# resident, at 0% misses: where a hot row's RESOLVE time goes (issue 14). Needs no vLLM.
#   NO_VLLM=1 bash scripts/lab/gpu_ncu.sh OUT            # ROWS="1 8" by default
# Writes OUT/ncu.tgz (the .ncu-rep reports, each one's details page and its per-instruction source
# page as CSV) and OUT/ncu-summary.txt (durations and warp stall reasons, side by side).
set -uo pipefail
top=$1
out=/tmp/ncu
mkdir -p "$top" "$out"
exec > >(tee -a "$top/ncu-summary.txt") 2>&1
trap 'tar czf "$top/ncu.tgz" -C /tmp ncu' EXIT
source scripts/gpu_lib.sh
box_setup "$out"
set +e
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this box"; exit 1; }
"$ncu" --version | tail -1
for rows in ${ROWS:-1 8}; do
  for mode in hot resident; do
    opt=; [ $mode = resident ] && opt=--resident
    rep=$out/sel-$rows-$mode
    # 2 layers x (warm-up + 10 steps): skip the first 12 selects, profile 4
    timeout 240 "$ncu" --clock-control none --kernel-name regex:select_resolve --launch-skip 12 \
      --launch-count 4 --warp-sampling-interval ${NCU_SAMPLING:-0} --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section SourceCounters \
      --section MemoryWorkloadAnalysis --import-source yes -f -o "$rep" \
      python3 -m vllm_hisparse.bench.decode_step --context 32768 --rows $rows --layers 2 --steps 10 \
      --q-noise 0 --eager $opt --out "$out/ds-$rows-$mode" > "$rep.log" 2>&1
    echo "== rows $rows $mode rc=$?"
    "$ncu" --import "$rep.ncu-rep" --page details > "$rep-details.txt" 2>&1
    "$ncu" --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>&1
    "$ncu" --import "$rep.ncu-rep" --page source --csv --print-source cuda > "$rep-cuda.csv" 2>&1
    grep -E "Duration|Registers Per|Block Size|Warp Cycles Per Issued|Issued Warp|Achieved Occ|Stall" \
      "$rep-details.txt" | sort | uniq -c | head -30
    "$ncu" --import "$rep.ncu-rep" --page raw --csv --metrics \
      gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_elapsed.max,smsp__pcsamp_sample_count \
      > "$rep-raw.csv" 2>&1
    cut -c1-200 "$rep-raw.csv" | tail -4
  done
done
