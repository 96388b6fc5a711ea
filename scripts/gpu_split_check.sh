#!/usr/bin/env bash
# The GPU checks behind split_dense_decode (on by default since 2026-11-30), in two calls.
#   NO_VLLM=1 bash scripts/gpu_split_check.sh OUT kernel   # with bundle.part0 staging: GPU tests of
#                                                         # the kernel + its per-call time (~2 min)
#   bash scripts/gpu_split_check.sh OUT step               # once the bundle is staged: the FULL step
#                                                         # with and without it, the dense-only
#                                                         # FULL body, and exactness through
#                                                         # vLLM with FULL graphs (~6 min)
# then: bash scripts/gpu_sweep.sh OUT 4k-nosplit / 32k-nosplit (the A/B against the default).
# Logs in OUT (tar: <= 8 files come back).
set -uo pipefail
out=$1; part=$2
mkdir -p "$out"
source scripts/gpu_setup.sh "$out" > "$out/setup.log" 2>&1 || { tail -20 "$out/setup.log"; exit 1; }
set +e
case "$part" in
  kernel)
    python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_dense_decode.py tests/test_staging.py \
      tests/test_kernels_attention.py tests/test_full_decode_gpu.py 2>&1 | tail -3 | tee "$out/pytest.log"
    python3 scripts/probes/dense_decode_time.py 2>&1 | tee "$out/dense_decode_time.txt" ;;
  step)
    for flag in off on; do
      python3 -m vllm_hisparse.bench.full_step --context 4096,32768 --rows 1,8 --layers 4 \
        --out "/tmp/fs-$flag" --split-dense-decode $flag 2>&1 | grep -E '^\{|Error'
    done
    python3 -m vllm_hisparse.bench.full_step --context 4096 --rows 1,8,32 --layers 4 --dense-only \
      --out /tmp/fs-dense-only 2>&1 | grep -E '^\{|Error'
    export HISPARSE_EXTRA='{"full_decode_graphs": true, "dense_pool_gib": 4}'
    mkdir -p /tmp/ex
    for m in resident hisparse; do timeout 230 python3 scripts/gpu_exactness.py run $m /tmp/ex 2>&1 | tail -3; done
    python3 scripts/gpu_exactness.py compare /tmp/ex 2>&1 | tail -8
    tar czf "$out/split-step.tgz" -C /tmp fs-off fs-on fs-dense-only ex ;;
  *) echo "part: kernel or step" >&2; exit 2 ;;
esac
