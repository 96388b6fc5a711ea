#!/usr/bin/env bash
# Bisect a GPU exactness MISMATCH (issue 43: fixed-buffer hisparse vs resident on scaled_dummy weights,
# H100 2026-12-06): the A config as resident, hisparse, hisparse with HISPARSE_FETCH_IN_ATTENTION=0,
# hisparse again and resident again (run-to-run determinism), then the DSA resident engine twice.
# Once the vLLM bundle is staged (four calls):  bash scripts/lab/gpu_bisect_exact.sh OUT   (~6 min)
set -uo pipefail
top=$1
exec > >(tee -a "$top/bisect.txt") 2>&1
source scripts/gpu_setup.sh /tmp/o1 > /tmp/o1.log 2>&1 || { tail -20 /tmp/o1.log; exit 1; }
set +e
O=/tmp/bx; rm -rf $O; mkdir -p $O/a $O/b $O/c $O/e $O/d1 $O/d2
A='{"dense_pool_gib": 1, "top_k": 2048, "device_buffer_size": 4096, "min_context": 0}'
eng() { d=$1; m=$2; kv=$3; shift 3; env EXACT_UTIL=0.12 HISPARSE_EXTRA="$A" EXACT_PROMPTS=6000,20000,12000,9000 EXACT_KV_GIB=$kv "$@" timeout 200 python3 scripts/gpu_exactness.py run $m $O/$d > $O/$d/$m.out 2>&1; echo "== $d $m rc=$?"; }
eng a resident 7 & p1=$!; sleep 3; eng a hisparse 5 & p2=$!; wait $p1 $p2
eng b hisparse 5 HISPARSE_FETCH_IN_ATTENTION=0 & p1=$!; sleep 3; eng c hisparse 5 & p2=$!; wait $p1 $p2
eng e resident 7 & p1=$!; wait $p1
python3 scripts/exact_verdict.py $O/a/resident.json $O/e/resident.json | grep -E "request|EXACT|MISMATCH|VOID" | sed "s/^/resident-twice /"
for d in b c; do cp $O/a/resident.json $O/$d/; done
for d in a b c; do echo "-- $d"; python3 scripts/gpu_exactness.py compare $O/$d hisparse | grep -E "request|VOID|EXACT|MISMATCH"; done
python3 - <<'PY'
import json
for d in "abc":
    r=json.load(open(f"/tmp/bx/a/resident.json")); h=json.load(open(f"/tmp/bx/{d}/hisparse.json"))
    for i,(x,y) in enumerate(zip(r["batches"][0],h["batches"][0])):
        s=[j for j,(p,q) in enumerate(zip(x["logprobs"],y["logprobs"])) if p!=q]
        print(d,i,"steps differing",s[:10])
PY
m=/tmp/dsa-model; python3 -m vllm_hisparse.bench.model_shapes deepseek-v3.2-l4 $m > /dev/null 2>&1
for d in d1 d2; do timeout 120 python3 scripts/gpu_dsa.py run resident $m $O/$d > $O/$d/log 2>&1; echo "== dsa $d rc=$?"; done
cp $O/d1/resident.json $O/d1/r1.json; cp $O/d2/resident.json $O/d1/r2.json
python3 scripts/exact_verdict.py $O/d1/r1.json $O/d1/r2.json | grep -E "request|EXACT|MISMATCH|VOID"
tar czf $top/bx.tgz --exclude='*prompts*' --exclude='*shuffled*' -C /tmp bx
