#!/usr/bin/env bash
# On the GPU box (after scripts/gpu_setup.sh's install): start a hisparse server with no hisparse
# config once per KV cache dtype, read its startup lines (vLLM's KV size and concurrency, hisparse's
# "room for N requests" line), stop it. Capacity without a workload (issue 45: fp8 against bf16).
#   bash scripts/gpu_startup_lines.sh OUT [DTYPES] [vllm serve flags...]
#   DTYPES: comma-separated --kv-cache-dtype values (default auto,fp8); the model: the Llama-3-8B
#   shape (bench.model_shapes) with dummy weights; flags after it replace nothing, they are added
#   (default: --gpu-memory-utilization 0.9 --max-model-len 32768 --max-num-seqs 64)
set -uo pipefail
o=$1; dtypes=${2:-auto,fp8}; shift; [ $# -gt 0 ] && shift
flags=("$@"); [ ${#flags[@]} -eq 0 ] && flags=(--gpu-memory-utilization 0.9 --max-model-len 32768 --max-num-seqs 64)
source scripts/gpu_setup.sh "$o" > /dev/null 2>&1
python3 -m vllm_hisparse.bench.model_shapes llama3-8b models/llama3-8b-bench > /dev/null 2>&1
for d in ${dtypes//,/ }; do
  timeout -k 10 300 python3 -m vllm.entrypoints.cli.main serve models/llama3-8b-bench --load-format dummy \
    --attention-backend hisparse --kv-cache-dtype $d --enforce-eager --port 18123 "${flags[@]}" \
    > "$o/serve-$d.log" 2>&1 &
  pid=$!
  for i in $(seq 140); do          # the room line comes once the host pool is pinned
    grep -q "Maximum concurrency" "$o/serve-$d.log" && grep -q "room for" "$o/serve-$d.log" && break
    kill -0 $pid 2> /dev/null || break; sleep 2
  done
  kill $pid 2> /dev/null; wait $pid 2> /dev/null
  echo "== kv-cache-dtype $d"
  grep -E "room for|Maximum concurrency|Available KV|GPU KV cache size|Error" "$o/serve-$d.log" | cut -c1-600
  sleep 10                         # the pinned pool and the GPU memory go back before the next one
done | tee -a "$o/summary.txt"
