#!/usr/bin/env bash
# On the GPU box: the decode path's GPU checks, in two parts (logs in OUT; the box sends back at
# most 8 files, so the rest comes as OUT/validate-PART.tgz).
#   NO_VLLM=1 bash scripts/gpu_validate.sh OUT kernels   # no vLLM needed (while bundle pieces are
#       staged): build the extension (copied to OUT for later calls), the GPU test files of the
#       decode path, the decode-step bench (graph replays per layer, 4K dense and 32K sparse rows,
#       0% and ~5% misses) with per-kernel profiles (~6 min)
#   NO_VLLM=1 bash scripts/gpu_validate.sh OUT tune     # build, the select/top-k GPU tests, then
#       the 32K decode-step bench over select knobs (radix bits x warps) (~5 min)
#   bash scripts/gpu_validate.sh OUT vllm                # the bundle installed: Llama-3-8B-shape
#       exactness through vLLM with FULL decode graphs (resident vs hisparse), the stock baseline
#       of the bench (~5 min)
set -uo pipefail
out=$1; part=$2
mkdir -p "$out"
source scripts/gpu_lib.sh
box_setup "$out"
cp vllm_hisparse/_C*.so "$out/" 2>/dev/null
set +e
case "$part" in
  kernels)
    cuda_tests /tmp 120 -x tests/test_decode_ops.py tests/test_decode_body_gpu.py \
      tests/test_topk_index.py tests/test_kernels_attention.py tests/test_dense_decode.py \
      tests/test_quest_rows.py tests/test_decode_attention.py tests/test_resolve_given.py \
      tests/test_dsa_resolve.py tests/test_dsa_reference.py | tee -a "$out/pytest.log"
    timeout 150 python3 -m vllm_hisparse.bench.decode_step --context 32768 --rows 1,8 --layers 4 \
      --steps 20 --q-noise 0 --out /tmp/validate/ds-0 2>&1 | grep -E "^\{|Error|error" \
      | tee -a "$out/bench.txt"
    timeout 200 python3 -m vllm_hisparse.bench.decode_step --context 4096,32768 --rows 1,32 \
      --layers 4 --steps 20 --q-noise 0.3 --out /tmp/validate/ds-3 2>&1 \
      | grep -E "^\{|Error|error" | tee -a "$out/bench.txt"
    tar czf "$out/validate-kernels.tgz" -C /tmp validate $(cd /tmp && ls pytest-*.log) ;;
  tune)
    cuda_tests /tmp 150 -x tests/test_decode_ops.py tests/test_topk_index.py \
      tests/test_decode_body_gpu.py | tee -a "$out/pytest.log"
    for b in 8 11; do for w in 4 8 16; do
      timeout 60 python3 -m vllm_hisparse.bench.decode_step --context 32768 --rows 1,8 --layers 4 \
        --steps 20 --q-noise 0 --radix-bits $b --select-warps $w --out /tmp/validate/tune-$b-$w \
        2>&1 | grep -E "^\{|Error|error" | tee -a "$out/bench.txt"
    done; done
    timeout 60 python3 -m vllm_hisparse.bench.decode_step --context 32768 --rows 1,8 --layers 4 \
      --steps 20 --q-noise 0.3 --radix-bits 11 --out /tmp/validate/tune-q3 2>&1 \
      | grep -E "^\{|Error|error" | tee -a "$out/bench.txt"
    tar czf "$out/validate-tune.tgz" -C /tmp validate $(cd /tmp && ls pytest-*.log) ;;
  vllm)
    timeout 200 python3 -m vllm_hisparse.bench.decode_step --context 4096,32768 --rows 1,8,32 \
      --layers 2 --steps 10 --q-noise 0 --out /tmp/validate/ds-stock 2>&1 | grep -E "^\{|Error"
    export HISPARSE_EXTRA='{"dense_pool_gib": 4}'
    for m in resident hisparse; do
      timeout 300 python3 scripts/gpu_exactness.py run $m /tmp/validate/exact 2>&1 | tail -3
    done
    python3 scripts/gpu_exactness.py compare /tmp/validate/exact 2>&1 | tail -8 | tee "$out/exact.txt"
    rm -f /tmp/validate/exact/prompts.json
    tar czf "$out/validate-vllm.tgz" -C /tmp validate ;;
  *) echo "part: kernels, tune or vllm" >&2; exit 2 ;;
esac
