#!/usr/bin/env bash
# Issue 18's long soak on the GPU box (one H200): `vllm serve` of the Llama-3-8B shape (random
# weights) with hisparse sized so the host pool fills (16 GiB of sparse layers: ~9-17 requests of
# 4-16K, fewer than the 24 Quest rows) and requests get preempted (4000 GPU blocks of 16 tokens for
# 32 sequences), driven by 48 clients for DURATION_S seconds (default 300: server start ~3 min +
# soak + drain fit the 10-minute limit), a third of them streaming and abandoning mid-stream.
#   bash scripts/gpu_soak.sh OUT [DURATION_S]
# OUT/soak.json holds every figure (exit status 0 = every check passed), OUT/serve.log.gz the log,
# OUT/metrics.txt the final /metrics page. Needs prometheus_fastapi_instrumentator (carry its wheel
# in .whl/, see DEVELOPERS.md).
set -uo pipefail
out=$1; duration=${2:-300}
source scripts/gpu_setup.sh "$out"
set +e                                  # a failed soak still copies its figures and log out
python3 -m vllm_hisparse.bench.model_shapes llama3-8b models/llama3-8b-bench > /dev/null
work=/tmp/soak
mkdir -p "$work"
python3 -m vllm_hisparse.bench.soak --out "$work" --duration-s "$duration" --concurrency 48 \
    --port "${SOAK_PORT:-8766}" \
    --min-context 8192 --max-len 16384 --max-tokens 512 --vocab 500 --ref-tokens 64 \
    --start-timeout-s 400 --idle-timeout-s 120 \
    -- models/llama3-8b-bench --load-format dummy --attention-backend hisparse \
    --additional-config '{"hisparse": {"top_k": 2048, "device_buffer_size": 4096, "host_pool_gib": 16, "dense_pool_gib": 2, "quest_rows": 24}}' \
    --max-model-len 16384 --max-num-seqs 32 --gpu-memory-utilization 0.5 \
    --num-gpu-blocks-override 4000 --seed 0
rc=$?
cp "$work/soak.json" "$work/metrics.txt" "$out/" 2>/dev/null
gzip -c "$work/serve.log" > "$out/serve.log.gz" 2>/dev/null
exit $rc
