#!/usr/bin/env bash
# Issue 6's serving sweep on the GPU box, in parts that each fit one 10-minute call (once every
# bundle piece is staged). 8B shape, util 0.3, prefix caching off, outputs forced; the hisparse
# config is serving.py's default (84 GiB host pool, 22 Quest rows, 6 GiB dense pool: sized for 32K).
#   bash scripts/gpu_sweep.sh OUT 32k-base       # stock + resident, 32K / 512   (~6 min)
#   bash scripts/gpu_sweep.sh OUT 32k-hisparse   # hisparse, 32K / 512           (~8 min)
#   bash scripts/gpu_sweep.sh OUT 4k             # all three, 4K / 512           (~9 min)
set -euo pipefail
out=$1; part=$2
common=(--output-len 512 --rounds 1 --gpu-memory-utilization 0.3)
case "$part" in
  32k-base)     args=(--input-len 32768 --backends stock,resident --concurrency 1,2,4,8,16
                      --hisparse '{"top_k": 2048, "device_buffer_size": 4096}') ;;  # resident: no pools
  32k-hisparse) args=(--input-len 32768 --backends hisparse --concurrency 1,2,4,8,16,22,32,64) ;;
  4k)           args=(--input-len 4096 --backends stock,resident,hisparse --concurrency 1,4,16,64,256) ;;
  *) echo "part: 32k-base, 32k-hisparse or 4k" >&2; exit 2 ;;
esac
exec bash scripts/gpu_serving.sh "$out" "${common[@]}" "${args[@]}"
