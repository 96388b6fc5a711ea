#!/usr/bin/env bash
# The DSA path on the H200 in one call (docs/dsa.md; ~8 minutes with the bundle staged: setup and
# the extension ~1-2 min, the CUDA tests ~1-1.5 min (a pytest process a file, 120 s at most each),
# three engines ~1.5-2 min each). Every result line goes to OUT/summary.txt as it comes (a call
# stopped at its limit still returns what finished);
# logs and JSON are tarred into OUT/dsa.tgz at the end: 2-5 files in OUT.
#   bash scripts/gpu_dsa.sh OUT
#   DSA_LIMIT=150 (s per engine) DSA_PROMPTS=8000,20000,12000,16000 DSA_MAX_TOKENS=48 DSA_B=2560
#   DSA_INDEXER=dsa_sorted (hisparse/resident sort each selection by position; dsa_stable: and break
#   ties at the k-th score by position, vLLM's top-k kernels replaced; the next box:
#   DSA_INDEXER=dsa_stable DSA_COMPILE=0 DSA_TESTS=0 MODES="resident resident2 hisparse control stock" bash scripts/gpu_dsa.sh OUT)
#   DSA_SPLITS=0 (FA3 num_splits of hisparse/resident; 1 = batch-invariant) MODES="hisparse stock
#   resident resident2 control" (add crf: hisparse under policy crf, compared with resident, its misses
#   beside lru's; control: the negative control, which must mismatch)
#   MODES="shadow shadowctl": the in-engine check (core/latent_shadow.py: every decode token's rows vs a
#   resident twin's in one engine; run-to-run noise cannot reach it) and its control
#   DSA_KV=fp8_ds_mla: 656 B latent rows (hisparse: vllm/mla_fp8_backend.py; stock: FLASHMLA_SPARSE)
#   DSA_SHAPE=deepseek-v3.2-l16: the 16-layer shape (bench/model_shapes.py CHANGES), default the 4-layer one
#   DSA_SPEC=1 DSA_B=4096: ngram speculation with 1 draft (verify rows; B >= (k + 1) x 2048), prompts of
#   a repeated 256-token block, one-token lookups (drafts most steps), acceptance counts beside the verdict
#   DSA_TESTS=0 (skip the CUDA tests) bash scripts/gpu_dsa.sh OUT; DSA_COMPILE=0: no torch.compile (FULL
#   decode graphs only), DSA_DETERMINISTIC=1: Inductor's deterministic mode
#   DSA_UTIL=0.85: the engines' gpu_memory_utilization (engines side by side do not work: on an H100
#   at 0.28 each only one of three found memory for its KV blocks, 2026-12-06)
#   DSA_CAP=1 MODES= DSA_TESTS=0 bash scripts/gpu_dsa.sh OUT   # capacity only (issue 17), ~6 min:
#   stock and hisparse at one GPU KV budget (DSA_CAP_KV_GIB=2, DSA_CAP_HOST_GIB=6, DSA_CAP_OUT=256)
set -uo pipefail
top=$1
out=/tmp/gs/dsa
mkdir -p "$top" "$out"
rm -f "$out"/*.json        # a previous call's engines must not enter this call's compare
exec > >(tee -a "$top/summary.txt") 2>&1
trap 'tar czf "$top/dsa.tgz" -C /tmp/gs dsa' EXIT
t0=$(date +%s)
since() { echo "$1 at $(( $(date +%s) - t0 )) s"; }
source scripts/gpu_lib.sh
box_setup "$out"
set +e
since "setup done"
if [ "${DSA_TESTS:-1}" = 1 ]; then
  cuda_tests "$out" 120 tests/test_dsa_resolve.py tests/test_dsa_reference.py \
    tests/test_resolve_given.py tests/test_fp8_ds_mla.py
  since "tests done"
fi
model=$out/${DSA_SHAPE:-deepseek-v3.2-l4}
python3 -m vllm_hisparse.bench.model_shapes ${DSA_SHAPE:-deepseek-v3.2-l4} "$model" > "$out/model.log" 2>&1 \
  || { tail -5 "$out/model.log"; exit 1; }
# engine KIND MODE NAME LIMIT: scripts/gpu_dsa.py KIND MODE, its log and JSON as OUT/NAME.*
engine() {
  timeout -k 20 $4 python3 scripts/gpu_dsa.py $1 $2 "$model" "$out" > "$out/$3.log" 2>&1
  echo "== $3 exit $? (124: stopped at its limit, $4 s)"
  grep -E "^== " "$out/$3.log"
  python3 scripts/gpu_dsa.py log "$out/$3.log"
  [ -f "$out/$3.json" ] || tail -25 "$out/$3.log"
  since "$3 done"
}
for mode in ${MODES-hisparse stock resident resident2 control}; do engine run $mode $mode ${DSA_LIMIT:-150}; done
[ -n "${MODES-x}" ] && python3 scripts/gpu_dsa.py compare "$out"
# DSA_CAP=1: issue 17's capacity at one GPU KV budget (scripts/gpu_dsa.py cap; ~2-3 min each)
if [ "${DSA_CAP:-0}" = 1 ]; then
  for mode in stock hisparse; do engine cap $mode cap-$mode ${DSA_CAP_LIMIT:-240}; done
fi
since "all done"
