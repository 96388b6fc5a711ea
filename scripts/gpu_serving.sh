#!/usr/bin/env bash
# On the GPU box, once every bundle piece is staged: install vLLM, build our extension, expose our
# entry points without pip (a dist-info folder on the path), then run the serving benchmark.
#   bash scripts/gpu_serving.sh OUT [serving.py args...]
set -euo pipefail
out=$1; shift
bash .gpu-bundle/install-vllm-bundle.sh install
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 PYTHONUNBUFFERED=1
( time MAX_JOBS=16 python3 setup.py build_ext --inplace ) > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
d=/tmp/site/vllm_hisparse-0.1.0.dist-info
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: vllm-hisparse\nVersion: 0.1.0\n' > "$d/METADATA"
printf '[vllm.general_plugins]\nhisparse = vllm_hisparse.vllm.plugin:register\n' > "$d/entry_points.txt"
python3 -c "from vllm_hisparse.ops import kernels as k; assert k.available(), k.import_error(); print('extension ok')"
python3 -m vllm_hisparse.bench.model_shapes llama3-8b models/llama3-8b-bench > /dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$out/commit.txt" || true
python3 -m vllm_hisparse.bench.serving --model models/llama3-8b-bench --out "$out" "$@"
for f in "$out"/server-*.log; do echo "== $f"; grep -E "Available KV cache memory|GPU KV cache size|Maximum concurrency|cudagraph_mode|hit rate" "$f" | head -8; done
