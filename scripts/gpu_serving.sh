#!/usr/bin/env bash
# On the GPU box, once every bundle piece is staged: set up (scripts/gpu_setup.sh), then run the
# serving benchmark. CSV and plot come back in OUT, the server logs in OUT/serving.tgz (the box
# sends back at most 8 files).
#   bash scripts/gpu_serving.sh OUT [serving.py args...]
# SERVING_LIMIT=S: stop the benchmark (SIGINT: it stops its servers) after S seconds, so the logs
# still come back when the device call's own limit is near (a call killed from outside returns
# nothing of /tmp/serving).
set -euo pipefail
out=$1; shift
source scripts/gpu_setup.sh "$out"
# MODEL_POSITIONS: the model's max_position_embeddings (vLLM's RoPE table); past 65536 for 128K
# MODEL_SHAPE: bench/model_shapes.py's name (default llama3-8b; deepseek-v3.2-l16: the DSA path)
shape=${MODEL_SHAPE:-llama3-8b}
python3 -m vllm_hisparse.bench.model_shapes $shape models/$shape-bench ${MODEL_POSITIONS:-65536} > /dev/null
work=/tmp/serving
mkdir -p "$work"
set +e
timeout -s INT -k 30 "${SERVING_LIMIT:-1000000}" \
  python3 -m vllm_hisparse.bench.serving --model models/$shape-bench --out "$work" "$@" 2>&1 | tee "$work/stdout.txt" "$out/serving-stdout.txt" | grep --line-buffered -E '^\{|warm-up|speedup'
rc=${PIPESTATUS[0]}
set -e
cp "$work"/serving.csv "$work"/serving.png "$out"/ 2>/dev/null || true
# server logs, step records, worker counters, profile summaries (not the raw traces: too large)
tar czf "$out/serving.tgz" --exclude='trace-*' -C /tmp serving
for f in "$work"/server-*.log; do echo "== $f"; grep -E "Available KV cache memory|GPU KV cache size|Maximum concurrency|hisparse: room for|hisparse dsa: admission|cudagraph_mode|hit rate" "$f" | head -8; done
exit "$rc"
