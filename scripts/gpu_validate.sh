#!/usr/bin/env bash
# On the GPU box, once every bundle piece is staged: everything written since the last GPU run, in
# one call (~8 min): the GPU test files (one pytest.log), the decode-layer profile eager vs graphs, and the 8B-shape
# exactness run with decode graphs and the dense pool on. The rest in OUT/validate.tgz.
#   bash scripts/gpu_validate.sh OUT
set -uo pipefail
out=$1
bash scripts/gpu_check.sh "$out" tests/test_decode_graph_gpu.py tests/test_quest_update.py \
  tests/test_topk_pages.py tests/test_hot_rows.py tests/test_kernels_attention.py \
  tests/test_write_through.py tests/test_pinned.py tests/test_kernels_resolve.py tests/test_quest_rows.py
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 PYTHONUNBUFFERED=1
for g in "" --decode-graphs; do
  timeout 200 python3 -m vllm_hisparse.bench.decode_step --context 32768 --rows 1,32,64 --layers 4 \
    --steps 20 $g --out "/tmp/v/decode_step$g" 2>&1 | grep "^{'context'"
done
export HISPARSE_EXTRA='{"decode_graphs": true, "dense_pool_gib": 4}'
timeout 240 python3 scripts/gpu_exactness.py run resident /tmp/v/exact
timeout 240 python3 scripts/gpu_exactness.py run hisparse /tmp/v/exact
python3 scripts/gpu_exactness.py compare /tmp/v/exact
rm -f /tmp/v/exact/prompts.json
tar czf "$out/validate.tgz" -C /tmp v     # the box sends back at most 8 files
