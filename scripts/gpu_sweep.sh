#!/usr/bin/env bash
# The serving sweep on the GPU box, in parts that each fit one 10-minute call (once every bundle
# piece is staged). 8B shape, util 0.3, prefix caching off, outputs forced; the hisparse config is
# serving.py's default (84 GiB host pool, 22 Quest rows, 6 GiB dense pool: sized for 32K; FULL
# decode graphs on by default since 2026-12-01).
#   bash scripts/gpu_sweep.sh OUT 32k-base       # stock + resident, 32K / 512   (~6 min)
#   bash scripts/gpu_sweep.sh OUT 32k-hisparse   # hisparse, 32K / 512           (~8 min)
#   bash scripts/gpu_sweep.sh OUT 4k             # stock + hisparse, 4K / 512    (~7 min)
#   bash scripts/gpu_sweep.sh OUT 32k-2k-cap     # the paper-like workload at capacity: 32K in /
#                                                # 2K out, stock 8 requests, hisparse 22  (~10 min)
#   bash scripts/gpu_sweep.sh OUT 4k-resident    # resident mode, 4K / 512, up to 256   (~5 min)
#   bash scripts/gpu_sweep.sh OUT 4k-256         # stock + hisparse at 256 requests, 4K  (~6 min)
#   bash scripts/gpu_sweep.sh OUT 32k-1k-stock   # stock, 32K / 1024 outputs             (~5 min)
#   bash scripts/gpu_sweep.sh OUT 32k-1k-hisparse  # hisparse, 32K / 1024 outputs         (~8 min)
#   bash scripts/gpu_sweep.sh OUT 4k-sized       # hisparse with pools sized for 4K work (no dense
#                                                # pool, 1 Quest row): stock's KV at 4K  (~4 min)
# Issue 15's elastic residency (backend elastic = hisparse + resident_first; miss_rate, shrinks,
# resident_units in the CSV, residency per request in stats-elastic.json):
#   bash scripts/gpu_sweep.sh OUT 32k-elastic-1    # resident + elastic, 32K / 512, 1 request (~6)
#   bash scripts/gpu_sweep.sh OUT 32k-elastic-cap  # hisparse + elastic, 32K / 512, 22 requests (~8)
# Issue 16's decode-heavy workloads (bench/serving.py --workload; `cap` = each backend's capacity
# from its startup log; the decode-only rate, running requests and host ms per step in the CSV):
#   bash scripts/gpu_sweep.sh OUT paper-1               # stock + hisparse, 32K / 8K, 1 request (~7 min)
#   bash scripts/gpu_sweep.sh OUT paper-cap-stock       # stock, 32K / 8K at capacity (~5)
#   bash scripts/gpu_sweep.sh OUT paper-cap-hisparse --output-len 4096  # hisparse at capacity
#   bash scripts/gpu_sweep.sh OUT reasoning-1           # stock + hisparse, 1K / 16K, 1 request (~8)
#   bash scripts/gpu_sweep.sh OUT reasoning-cap-stock   # stock, 1K / 16K at capacity
#   bash scripts/gpu_sweep.sh OUT reasoning-cap-hisparse  # hisparse, 1K / 16K at capacity
# (times are guesses from the per-token figures in docs/gpu-results.md; arguments after the part
# go to serving.py, e.g. --output-len 4096 where a 10-minute call cannot hold the whole output.)
# Carry .whl/ (prometheus wheels: `vllm serve` imports them, the bundle lacks them).
set -euo pipefail
out=$1; part=$2; shift 2
common=(--output-len 512 --rounds 1 --gpu-memory-utilization 0.3)
decode=(--rounds 1 --gpu-memory-utilization 0.3)
cfg='{"top_k": 2048, "device_buffer_size": 4096, "dense_pool_gib": 6, "host_pool_gib": 84, "quest_rows": 22'
case "$part" in
  32k-base)     args=(--input-len 32768 --backends stock,resident --concurrency 1,2,4,8
                      --hisparse '{"top_k": 2048, "device_buffer_size": 4096}') ;;  # resident: no pools
  32k-hisparse) args=(--input-len 32768 --backends hisparse --concurrency 1,2,4,8,22,32) ;;
  4k)           args=(--input-len 4096 --backends stock,hisparse --concurrency 1,4,16,64,128) ;;
  32k-2k-cap)   args=(--input-len 32768 --output-len 2048 --backends stock,hisparse
                      --concurrency 8,22) ;;
  4k-resident)  args=(--input-len 4096 --backends resident --concurrency 1,16,64,256
                      --hisparse '{"top_k": 2048, "device_buffer_size": 4096}') ;;
  4k-256)       args=(--input-len 4096 --backends stock,hisparse --concurrency 256) ;;
  4k-sized)     args=(--input-len 4096 --backends hisparse --concurrency 1,16,64,128
                      --hisparse '{"top_k": 2048, "device_buffer_size": 4096, "dense_pool_gib": 0,
                                   "host_pool_gib": 16, "quest_rows": 1}') ;;
  32k-elastic-1) args=(--input-len 32768 --backends resident,elastic --concurrency 1) ;;
  32k-elastic-cap) args=(--input-len 32768 --backends hisparse,elastic --concurrency 22) ;;
  32k-1k-stock) args=(--input-len 32768 --output-len 1024 --backends stock --concurrency 1,8) ;;
  32k-1k-hisparse) args=(--input-len 32768 --output-len 1024 --backends hisparse
                         --concurrency 1,8,32) ;;
  paper-1)      common=("${decode[@]}"); args=(--workload paper --backends stock,hisparse --concurrency 1) ;;
  paper-cap-stock) common=("${decode[@]}"); args=(--workload paper --backends stock --concurrency cap) ;;
  paper-cap-hisparse) common=("${decode[@]}"); args=(--workload paper --backends hisparse
                                                       --concurrency cap) ;;
  reasoning-1)  common=("${decode[@]}"); args=(--workload reasoning --backends stock,hisparse
                                                 --concurrency 1) ;;
  reasoning-cap-stock) common=("${decode[@]}"); args=(--workload reasoning --backends stock
                                                        --concurrency cap) ;;
  reasoning-cap-hisparse) common=("${decode[@]}"); args=(--workload reasoning --backends hisparse
                                                           --concurrency cap) ;;
  *) echo "part: see the list at the top of this script" >&2; exit 2 ;;
esac
exec bash scripts/gpu_serving.sh "$out" "${common[@]}" "${args[@]}" "$@"
