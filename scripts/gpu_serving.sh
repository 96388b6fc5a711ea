#!/usr/bin/env bash
# On the GPU box, once every bundle piece is staged: set up (scripts/gpu_setup.sh), then run the
# serving benchmark.
#   bash scripts/gpu_serving.sh OUT [serving.py args...]
set -euo pipefail
out=$1; shift
source scripts/gpu_setup.sh "$out"
python3 -m vllm_hisparse.bench.model_shapes llama3-8b models/llama3-8b-bench > /dev/null
python3 -m vllm_hisparse.bench.serving --model models/llama3-8b-bench --out "$out" "$@"
for f in "$out"/server-*.log; do echo "== $f"; grep -E "Available KV cache memory|GPU KV cache size|Maximum concurrency|cudagraph_mode|hit rate" "$f" | head -8; done
