#!/usr/bin/env bash
# One GPU session's measurements of issues 14-16, in calls that each fit the 10-minute limit (the
# bundle staged first: four calls of `bash .gpu-bundle/install-vllm-bundle.sh stage`, back to back;
# `kernels` needs no vLLM and can run beside part 0). The box returns at most 8 files: each part
# appends its result lines to OUT/summary.txt as they come (a call stopped at its limit still
# returns what finished) and tars its logs and CSVs into OUT/PART.tgz at the end.
#   NO_VLLM=1 bash scripts/gpu_session.sh OUT kernels  # build; the decode path's GPU tests; the
#                                                      # decode-step bench at 32K, hisparse and
#                                                      # resident (RESOLVE's share) (~5 min)
#   bash scripts/gpu_session.sh OUT exact    # exactness engines side by side on one GPU: the
#       serving config (top_k 2048, B 4096, min_context 0, 4 prompts of 6K-20K) as resident /
#       hisparse / elastic / crf / the negative control (a KV cache smaller than the prompts:
#       spills mid-run), on weights whose attention matters (EXACT_WEIGHTS, EXACT_MODEL), and
#       (EXACT_PAIRS="A B") short prompts turning sparse mid-decode (issue 16); EXACT_PAIRS=Q: the
#       real Qwen2.5-Coder-1.5B (QWEN=folder, QWEN_PROMPTS=token ids of 20-32K real text) with
#       fixed / elastic x lru / crf. Each pair runs its reference twice (resident2: a verdict is
#       VOID unless both agree) and records its batches (differences under other batches are
#       unattributable: VOID); EXACT_LIMIT=S
#       stops each engine (default 420; give the call S + 90)
#   bash scripts/gpu_session.sh OUT qwen     # Qwen2.5-Coder-1.5B from its staged pieces (make_qwen.py)
#   bash scripts/gpu_session.sh OUT quality  # Quest quality at 16K / 32K on it: teacher-forced and
#       needle, top_k 1024-8192 (QWEN_IDS, QWEN_NEEDLE: token ids built where the texts are, .lab/)
#   bash scripts/gpu_session.sh OUT cap      # 32K in / 2K out at 1 request and at each backend's
#       capacity: stock, elastic (BACKENDS=... for others; ~2.5 min stock, ~5 min per hisparse backend)
#   bash scripts/gpu_session.sh OUT paper    # the paper's workload, 32K in / 8K out, at each backend's
#       capacity: stock, elastic (BACKENDS=...; LIMIT covers every backend of the call: H100 util
#       0.52, dummy weights ~9 min for the two; with SERVING_FLAGS="--load-format scaled_dummy"
#       (weights whose attention matters, in paper and 32k1) stock ~4 min and elastic ~7 min with
#       their starts: run them one backend a call, each with its own LIMIT)
#   bash scripts/gpu_session.sh OUT reasoning  # 1K in / 12K out at each backend's capacity (issue 16;
#                                            # OUTPUT_LEN=..., ~8 min)
#   bash scripts/gpu_session.sh OUT 4k       # 4K / 512 at 1 and 64 requests, stock vs hisparse (~5 min)
#   bash scripts/gpu_session.sh OUT 32k1     # 32K / 256 at 1 request (ROUNDS=1), stock vs elastic vs hisparse (~7 min;
#                                            # BACKENDS=stock,elastic for two; SPROFILE=N: N decode
#                                            # steps of each server under vLLM's profiler)
#   bash scripts/gpu_session.sh OUT profile  # 32K / 1 row (ROWS=, INPUT_LEN=): a decode step's kernels,
#       GPU busy time and host time per backend (BACKENDS=resident,elastic), each diffed against the
#       first (bench.step_profile; ~2.5 min a backend; MLP=N: the MLP's width N, a shorter step;
#       PFLAGS=--log-stats: vLLM's per-step stats on, as in a server)
#   bash scripts/gpu_session.sh OUT chat     # multi-turn chat at capacity with prefix caching, aborts, leak check (~8-11 min)
#   bash scripts/gpu_session.sh OUT prefill  # a 32K prompt's time to first token: its kernels, GPU
#       busy time and host time per backend (BACKENDS=stock,resident,elastic), each diffed against
#       the first (bench.prefill_profile; ~1.5 min a backend)
#   bash scripts/gpu_session.sh OUT ngram    # issue 47 item 3, NOT YET RUN ON A GPU: ngram
#       speculation with hisparse. (a) exactness on the 8B shape (scaled_dummy weights, or
#       EXACT_MODEL=DIR EXACT_PROMPTS_FILE=F): EXACT_SPEC=${SPEC_K:-3} drafts, modes resident /
#       hisparse / resident2 / control, prompts a 256-token block repeated (random weights copy
#       nothing: the prompt holds the ngram matches); the verdict also needs equal acceptance
#       counters and an accepted draft (~8 min; NGRAM_EXACT=0 skips it; VOID for "no draft was
#       accepted": random weights seldom continue the block, so rerun with EXACT_SPEC_MIN=1
#       EXACT_MAX_TOKENS=256 or a real model). (b) with SPEC_MODEL=DIR (a real model:
#       scripts/make_qwen.py, make_smollm2.py) and SPEC_TEXT=FILE (its token ids of real text):
#       bench.serving at 1 request, SPEC_IN in (32768; SmolLM2's 8K: SPEC_IN=7900) / 256 out, each
#       prompt a SPEC_BLOCK-token (256) window of the text repeated, BACKENDS (stock,hisparse)
#       each without and with ngram: "speedup B: TPOT x / y = s", "hisparse speedup / stock
#       speedup = r (issue 47: >= 0.9)". Two calls (each fits 10 min):
#         bash scripts/gpu_session.sh OUT ngram
#         NGRAM_EXACT=0 SPEC_MODEL=/tmp/models/qwen2.5-coder-1.5b \
#           SPEC_TEXT=.lab/qwen-quality-ids.json bash scripts/gpu_session.sh OUT ngram
set -uo pipefail
top=$1; part=$2
out=/tmp/gs/$part                                      # logs, CSVs: tarred into top at the end
rm -rf "$out"; mkdir -p "$top" "$out"                 # (a warm box keeps /tmp/gs: no stale logs)
exec > >(tee -a "$top/summary.txt") 2>&1              # every line below also in summary.txt
mon=
trap '[ -n "$mon" ] && kill $mon; tar czf "$top/$part.tgz" -C /tmp/gs "$part"' EXIT   # setup.log too
# (a bare `wait` would also wait for the tee above: wait on the pids started here)
source scripts/gpu_setup.sh "$out" > "$out/setup.log" 2>&1
source scripts/gpu_lib.sh
set +e
python3 -c "from vllm_hisparse.ops import kernels as k; assert k.available(), k.import_error()" \
  || { tail -20 "$out/setup.log"; exit 1; }
t0=$(date +%s)
since() { echo "$1 at $(( $(date +%s) - t0 )) s"; }
# engine PAIR MODE VAR=VALUE...: one exactness engine (scripts/gpu_exactness.py) of pair PAIR in
# $ex/PAIR with those settings, stopped at EXACT_LIMIT s; its exit code in the summary
engine() {
  local pair=$1 mode=$2; shift 2
  env EXACT_UTIL=0.12 "$@" timeout -k 30 ${EXACT_LIMIT:-420} python3 scripts/gpu_exactness.py run \
    $mode $ex/$pair > $ex/$pair/$mode.out 2>&1
  echo "== $pair $mode exit $? (124: stopped at EXACT_LIMIT)"
}
# the exactness engines' serving config (parts exact and ngram; EXACT_A='{...}' replaces it)
A='{"dense_pool_gib": 1, "top_k": 2048, "device_buffer_size": 4096, "min_context": 0}'
# monitor: each minute the exactness engines' last log lines ($ex/*/*.log) to the summary
monitor() {
  ( while sleep 60 > /dev/null 2>&1; do for f in $ex/*/*.log; do
      echo "-- $(date +%T) $f: $(tail -c 160 $f | tr '\n\r' '  ')"; done; done ) &
  mon=$!
}
# each 8B engine takes ~17-23 GB (16 of weights): five at once fit an H200's 141 GB, two an
# H100's 80 (the eleventh session's OOM with six): EXACT_PAR engines at a time, queued in order
engines_at_once() {
  par=${EXACT_PAR:-$([ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | \
        head -1)" -gt 120000 ] && echo 5 || echo 2)}
  pids=()
}
queue() {   # queue RUNNER MODE KV_GIB: start it once fewer than $par engines run
  while :; do
    live=0; for p in "${pids[@]}"; do kill -0 $p 2> /dev/null && live=$((live + 1)); done
    [ $live -lt $par ] && break; sleep 2
  done
  $1 $2 $3 & pids+=($!); sleep 4
}
# the 32K / 1 runs' hisparse config (HISPARSE='{...}' replaces it in 32k1 and profile)
cfg32k='{"host_pool_gib": 8, "quest_rows": 2, "dense_pool_gib": 1}'
case "$part" in
  kernels)
    # KTESTS / KBENCH: other test files / bench cases (a shorter call)
    cuda_tests "$out" 200 ${KTESTS:-tests/test_write_score.py tests/test_decode_attention.py \
      tests/test_decode_ops.py tests/test_decode_body_gpu.py tests/test_dense_decode.py}
    # 32K at 0% misses (the goal's 30 us), RESOLVE's share (the select with hot slots vs without:
    # the resident run), ~6% misses; 4K dense rows (the split-KV decode's combine in the launch)
    # the misses copied in select_resolve's own launch (HISPARSE_FETCH_IN_ATTENTION=0: "-io")
    # against the default, read by the attention's split launch
    cases=${KBENCH:-"32768 0 1,8,32,64;32768 0 1,8,32,64 --resident;32768 0.3 1,8,32;4096 0 1,32;32768 0 1,8,32 -io;32768 0.3 1,8,32 -io"}
    IFS=';' read -ra cases <<< "$cases"
    # a case may start with VAR=value words: its environment (A/B knobs), named in its folder
    for a in "${cases[@]}"; do
      [ -z "${a// }" ] && continue                         # KBENCH=" ": the tests only
      set -- $a
      envs=(); tag=
      while [[ "${1:-}" == *=* ]]; do n=${1%%=*}; n=${n##*_}; envs+=("$1"); tag+="-${n,,}${1#*=}"; shift; done
      # words after the rows: the bench's options (-io: the misses copied in select_resolve's own
      # launch); each one names the case's folder too
      fa=1; opt=(); name=
      for w in "${@:4}"; do name+=$w; if [ "$w" = -io ]; then fa=0; else opt+=("$w"); fi; done
      echo "-- $a"
      env "${envs[@]}" timeout 150 python3 -m vllm_hisparse.bench.decode_step --fetch-in-attention $fa \
        --context $1 --rows $3 --layers ${KLAYERS:-2} --steps ${KSTEPS:-10} --q-noise $2 "${opt[@]}" \
        --out "$out/ds-$1-q$2$name$tag" 2>&1 | grep -E "^\{|Error" | cut -c1-300
      since "case done"
    done
    since "kernels done" ;;
  exact)
    # A: the serving config as resident / hisparse / elastic / crf and the negative control (a KV
    # cache smaller than the prompts: spills mid-run); B (EXACT_PAIRS="A B"): short prompts
    # turning sparse mid-decode (issue 16). Weights: EXACT_WEIGHTS=scaled (attention matters, the
    # default) or dummy; EXACT_MODEL=DIR EXACT_PROMPTS_FILE=F: a real model and its prompts. The
    # resident engine also runs each prompt with its context shuffled (the proof that attention
    # matters); the verdict is scripts/exact_verdict.py's EXACT, MISMATCH or VOID. Every engine
    # stops at EXACT_LIMIT s; each minute the engines' last log lines go to the summary.
    ex=$out/exact; mkdir -p $ex/A $ex/B $ex/Q
    # no quest_rows: gpu_exactness.py gives one row per prompt, so admission never waits on rows
    # and schedules stay the reference's (quest_rows 0 = 32 rows of 32K: 7.7 GiB, which the
    # startup check refused on an H100 beside a second engine, 2026-12-07)
    runA() { engine A $1 HISPARSE_EXTRA="${EXACT_A:-$A}" EXACT_PROMPTS=${EXACT_PROMPTS:-6000,20000,12000,9000} \
               EXACT_KV_GIB=$2; }
    runB() { engine B $1 HISPARSE_EXTRA='{"dense_pool_gib": 1}' EXACT_PROMPTS=1200,5000 \
               EXACT_MAX_TOKENS=1500 EXACT_KV_GIB=2 EXACT_MAX_LEN=8192; }
    # Q (EXACT_PAIRS=Q): a real model at 20-32K, QWEN=model folder, QWEN_PROMPTS=token-id prompts
    # (scripts/long_prompts.py), 256 outputs: exactness and the miss rates of fixed / elastic x
    # lru / crf in one run (KV: QWEN_KV_RES GiB resident, QWEN_KV others, less than the prompts)
    runQ() { engine Q $1 EXACT_MODEL=${QWEN:-/tmp/models/qwen2.5-coder-1.5b} \
               EXACT_PROMPTS_FILE=${QWEN_PROMPTS:-$PWD/.lab/qwen-prompts.json} EXACT_MAX_TOKENS=${QWEN_OUT:-256} \
               HISPARSE_EXTRA="${EXACT_A:-$QA}" EXACT_UTIL=${QWEN_UTIL:-0.15} EXACT_KV_GIB=$2; }
    # (four engines at once: 8 GiB of pinned host pool each, 4.3 GiB of prompts)
    QA='{"dense_pool_gib": 1, "top_k": 2048, "device_buffer_size": 4096, "min_context": 0, "host_pool_gib": 8}'
    monitor; engines_at_once
    for pair in ${EXACT_PAIRS:-A}; do
      if [ $pair = A ]; then
        # EXACT_MODES="mode:KV_GIB ...": another set (e.g. fp8 with less KV: spills at fp8 width)
        for m in ${EXACT_MODES:-resident:${EXACT_KV_RES:-7} hisparse:5 resident2:${EXACT_KV_RES:-7} control:5 elastic:5 crf:5}; do
          queue runA ${m%:*} ${m#*:}; done
      elif [ $pair = Q ]; then
        # Qwen2.5-1.5B: ~3 GB of weights, ~10 GB an engine: QWEN_PAR at a time
        par=${QWEN_PAR:-4}
        for m in resident:${QWEN_KV_RES:-5} hisparse:${QWEN_KV:-2.5} resident2:${QWEN_KV_RES:-5} control:${QWEN_KV:-2.5} \
                 elastic:${QWEN_KV:-2.5} crf:${QWEN_KV:-2.5} elastic_crf:${QWEN_KV:-2.5}; do
          queue runQ ${m%:*} ${m#*:}; done
      else
        for m in resident resident2 hisparse control; do queue runB $m; done
      fi
    done
    wait "${pids[@]}"; since "engines done"
    for pair in ${EXACT_PAIRS:-A}; do
      grep -h "== \|rc=\|cudagraph_mode" $ex/$pair/*.out | cut -c1-200; grep -h "Error" $ex/$pair/*.log | tail -3
      if [ $pair = A ]; then python3 scripts/gpu_exactness.py compare $ex/A \
          $(for m in ${EXACT_MODES:-hisparse elastic crf}; do m=${m%:*}; case $m in resident*|control) ;; *) echo $m;; esac; done)
      elif [ $pair = Q ]; then EXACT_MODEL=${QWEN:-/tmp/models/qwen2.5-coder-1.5b} \
        python3 scripts/gpu_exactness.py compare $ex/Q hisparse crf elastic elastic_crf
      else EXACT_PROMPTS=1200,5000 EXACT_MAX_LEN=8192 python3 scripts/gpu_exactness.py compare $ex/B hisparse; fi
      echo "== verdict $pair rc=$? (0 EXACT, 1 MISMATCH, 3 VOID)"
    done
    rm -f $ex/*/prompts.json $ex/*/shuffled.json
    since "exact done" ;;
  qwen)
    # the real Qwen2.5-Coder-1.5B folder at $QWEN from its staged pieces (scripts/make_qwen.py:
    # every piece staged by earlier calls; this call carries gguf's wheel)
    m=${QWEN:-/tmp/models/qwen2.5-coder-1.5b}
    pip install -q --no-index --no-deps --target /tmp/site .qwen/gguf-*.whl
    { python3 scripts/make_qwen.py join 1.5b --dir /tmp/qwen && \
      python3 scripts/make_qwen.py convert /tmp/qwen/qwen2.5-coder-1.5b.gguf $m; } > $out/qwen.log 2>&1
    echo "== qwen model rc=$?: $(ls $m 2>&1 | tr '\n' ' ')"; tail -3 $out/qwen.log
    since "qwen done" ;;
  quality)
    # Quest quality on the real 32K model (issue 43 item 5), fp32 on the GPU: teacher-forced
    # perplexity, KL, top-1 agreement and attention recall at 16K / 32K (QWEN_IDS: the texts as
    # token ids, `bench.quality forced --save-ids`), then the needle at 16K / 32K (QWEN_NEEDLE:
    # `bench.quality needle --save-prompts`; the transformers simulation of the served decode)
    m=${QWEN:-/tmp/models/qwen2.5-coder-1.5b}; ks=${QTOPK:-1024,2048,4096,8192}
    timeout ${QLIMIT:-300} python3 -m vllm_hisparse.bench.quality forced --model $m \
      --ids ${QWEN_IDS:-.lab/qwen-quality-ids.json} --contexts 16384,32000 --steps 256 --top-k $ks \
      --device cuda --out $out/forced > $out/forced.log 2>&1
    echo "== forced rc=$?"; grep -E "^\||Smallest|^wrote|Error" $out/forced.log | head -30
    since "forced done"
    timeout ${NLIMIT:-200} python3 -m vllm_hisparse.bench.quality needle --model $m \
      --prompts-file ${QWEN_NEEDLE:-.lab/qwen-needle.json} --no-engines --simulate-top-k $ks \
      --device cuda --out $out/needle > $out/needle.log 2>&1
    echo "== needle rc=$?"; grep -E "^\||^wrote|Error" $out/needle.log | head -20
    since "quality done" ;;
  cap)
    SERVING_LIMIT=${LIMIT:-560} bash scripts/gpu_serving.sh "$out/cap" --input-len 32768 --output-len 2048 \
      --rounds 1 --gpu-memory-utilization 0.3 --backends ${BACKENDS:-stock,elastic} --concurrency 1,cap \
      --max-num-seqs 24 ;;
  paper)
    # LIMIT 545 needs a warm box whose extension is built (run it right after `kernels`): on a cold
    # box the build (~65 s) and setup come first, so give LIMIT=470 there. HISPARSE='{...}': the
    # hisparse config (bench.serving's --hisparse); default: the measured one of 2026-12-04 (third
    # session): B 5632, a floor that keeps the KV manager's reserve free while the 17th prompt
    # prefills (16 floors of S + 1 blocks + 2,049 + 536 <= 8,451: B <= 5840); 18 Quest rows, one
    # per admitted request + 1
    paper_cfg='{"top_k": 2048, "device_buffer_size": 5632, "dense_pool_gib": 6, "host_pool_gib": 84, "quest_rows": 18}'
    SERVING_LIMIT=${LIMIT:-545} bash scripts/gpu_serving.sh "$out/paper" --input-len 32768 \
      --output-len 8192 --rounds 1 --gpu-memory-utilization 0.3 --backends ${BACKENDS:-stock,elastic} \
      --concurrency cap --max-num-seqs 24 --hisparse "${HISPARSE:-$paper_cfg}" ${SERVING_FLAGS:-} ;;
  reasoning)
    # issue 16: short prompts that turn sparse during decode, 1K in / 12K out (16K out does not
    # fit one call with both backends), each backend at its capacity (calc: stock 17, elastic 32
    # at --max-num-seqs 32; ~8 min). min_context 4096 = B: a request turns sparse when it reaches
    # its floor (256 + 1 blocks), so requests growing in lockstep never hold more than the floor
    # (at 8192 all 32 would pass 512 blocks each at once: 16K blocks of 10.9K, preemption)
    SERVING_LIMIT=${LIMIT:-560} bash scripts/gpu_serving.sh "$out/reasoning" --input-len 1024 \
      --output-len ${OUTPUT_LEN:-12288} --rounds 1 --gpu-memory-utilization 0.3 \
      --backends ${BACKENDS:-stock,elastic} --concurrency cap --max-num-seqs 32 --hisparse \
      '{"top_k": 2048, "device_buffer_size": 4096, "min_context": 4096, "dense_pool_gib": 6, "host_pool_gib": 84, "quest_rows": 32}' ;;
  4k)
    SERVING_LIMIT=${LIMIT:-480} bash scripts/gpu_serving.sh "$out/4k" --input-len 4096 --output-len 512 \
      --rounds 1 --gpu-memory-utilization 0.3 --backends stock,hisparse --concurrency 1,64 ;;
  32k1)
    # SPROFILE=N: after each server's point, one more (not recorded) with N decode steps under
    # vLLM's torch profiler (bench/served_profile.py); the summaries diffed against the first
    SERVING_LIMIT=${LIMIT:-540} bash scripts/gpu_serving.sh "$out/32k" --input-len 32768 --output-len 256 \
      --rounds ${ROUNDS:-1} --gpu-memory-utilization 0.3 --backends ${BACKENDS:-stock,elastic,hisparse} --concurrency 1 \
      --hisparse "${HISPARSE:-$cfg32k}" ${SPROFILE:+--profile-decode $SPROFILE --profile-delay 24} \
      ${SERVING_FLAGS:-}
    # each backend's servers pooled: mean TPOT, its range, against the first backend's
    python3 -m vllm_hisparse.bench.server_spread "$out/32k/serving.csv"
    p0=/tmp/serving/profile-$(echo ${BACKENDS:-stock} | cut -d, -f1).json
    # (no profile without SPROFILE: the step ends 0, not the failed test's 1)
    if [ -f "$p0" ]; then for f in /tmp/serving/profile-*.json; do if [ "$f" != "$p0" ]; then
      python3 -m vllm_hisparse.bench.served_profile diff "$p0" "$f" --top 12; fi; done; fi ;;
  profile)
    # where a decode step's time goes, backend by backend, in one process each (bench.step_profile):
    # wall ms a step over STEPS steps, then PSTEPS steps under the torch profiler (kernels a step,
    # GPU busy time, the runtime's host time); each hisparse backend diffed against the first one
    python3 -m vllm_hisparse.bench.model_shapes llama3-8b models/llama3-8b-bench > /dev/null
    # MLP=N: the MLP's intermediate size set to N (a shorter GPU step: does the host's per-step
    # work, hidden behind a whole Llama-3-8B step, show once the GPU runs out of work sooner?)
    [ -n "${MLP:-}" ] && python3 -c "import json, sys; p = 'models/llama3-8b-bench/config.json'; \
c = json.load(open(p)); c['intermediate_size'] = int(sys.argv[1]); json.dump(c, open(p, 'w'))" "$MLP"
    first=
    for b in $(echo ${BACKENDS:-resident,elastic} | tr , ' '); do
      timeout -k 20 ${PLIMIT:-240} python3 -m vllm_hisparse.bench.step_profile run \
        --model models/llama3-8b-bench --backend $b --input-len ${INPUT_LEN:-32768} \
        --rows ${ROWS:-1} --steps ${STEPS:-200} --profile-steps ${PSTEPS:-30} \
        --hisparse "${HISPARSE:-$cfg32k}" ${PFLAGS:-} --out "$out" > "$out/run-$b.log" 2>&1
      echo "== $b rc=$?: $(grep -E '^[a-z]+: ' "$out/run-$b.log" | tail -1)"
      if [ -z "$first" ]; then first=$b; continue; fi
      python3 -m vllm_hisparse.bench.step_profile diff "$out/$first.json" "$out/$b.json" \
        --csv "$out/diff-$first-$b.csv" --top 15      # (not `| head`: the pipe's close killed it)
    done ;;
  prefill)
    # where a 32K prompt's time to first token goes, backend by backend (bench.prefill_profile):
    # a warm-up prefill, REPEATS timed, one profiled; each backend diffed against the first
    python3 -m vllm_hisparse.bench.model_shapes llama3-8b models/llama3-8b-bench > /dev/null
    first=
    for b in $(echo ${BACKENDS:-stock,resident,elastic} | tr , ' '); do
      timeout -k 20 ${PLIMIT:-240} python3 -m vllm_hisparse.bench.prefill_profile run \
        --model models/llama3-8b-bench --backend $b --input-len ${INPUT_LEN:-32768} \
        --repeats ${REPEATS:-3} --no-prefix-caching --capture-sizes 1,2 \
        --hisparse "${HISPARSE:-$cfg32k}" --out "$out" > "$out/prefill-$b.log" 2>&1
      echo "== $b rc=$?: $(grep -E '^[a-z]+: ' "$out/prefill-$b.log" | tail -1)"
      if [ -z "$first" ]; then first=$b; continue; fi
      python3 -m vllm_hisparse.bench.prefill_profile diff "$out/$first-prefill.json" \
        "$out/$b-prefill.json" --top 15
    done ;;
  chat)
    # issue 47: multi-turn chat through vllm serve with prefix caching on in both (vLLM's default):
    # CONV conversations (default auto: AUTO_FACTOR x what stock's KV holds at full length, so
    # both run at capacity) x TURNS turns on a shared 2K system prompt, each turn re-sending its
    # history plus a 6K message (to ~28K tokens); every ABORT_EVERY-th request is aborted mid-turn;
    # after each backend the leak check (host page-table pages in use/cached back to 0). Stock
    # against elastic: TTFT per turn, prefix hit rate, output tok/s (bench.chat; ~8-11 min)
    python3 -m vllm_hisparse.bench.model_shapes llama3-8b models/llama3-8b-bench > /dev/null
    timeout -s INT -k 30 ${LIMIT:-700} python3 -m vllm_hisparse.bench.chat \
      --model models/llama3-8b-bench --backends ${BACKENDS:-stock,elastic} \
      --conversations ${CONV:-auto} --auto-factor ${AUTO_FACTOR:-2} --turns ${TURNS:-4} \
      --system-len 2048 --user-len 6144 --output-len 256 --abort-every ${ABORT_EVERY:-5} \
      --gpu-memory-utilization ${UTIL:-0.9} --load-format scaled_dummy \
      ${HISPARSE:+--hisparse "$HISPARSE"} --out "$out" > "$out/chat.log" 2>&1
    echo "== chat rc=$?"; grep -E '^\{|^chat|leak' "$out/chat.log" | tail -20 ;;
  ngram)
    # issue 47 item 3 (the header says how to call it). (a) exactness under ngram speculation: the
    # exact part's pair A (EXACT_A, EXACT_PROMPTS, EXACT_MODEL / EXACT_PROMPTS_FILE apply), every
    # engine with EXACT_SPEC drafts a step (scripts/gpu_exactness.py); the verdict's check 5:
    # acceptance counters equal the reference's, some draft accepted
    ex=$out/exact; mkdir -p $ex/N
    spec='{"method": "ngram", "num_speculative_tokens": '${SPEC_K:-3}', "prompt_lookup_max": 4, '
    spec+='"prompt_lookup_min": 2}'
    if [ "${NGRAM_EXACT:-1}" != 0 ]; then
      runN() { engine N $1 EXACT_SPEC=${SPEC_K:-3} HISPARSE_EXTRA="${EXACT_A:-$A}" \
                 EXACT_PROMPTS=${EXACT_PROMPTS:-6000,20000,12000,9000} EXACT_KV_GIB=$2; }
      monitor; engines_at_once
      for m in resident:${EXACT_KV_RES:-7} hisparse:5 resident2:${EXACT_KV_RES:-7} control:5; do
        queue runN ${m%:*} ${m#*:}; done
      wait "${pids[@]}"; since "engines done"
      grep -h "== \|rc=\|cudagraph_mode" $ex/N/*.out | cut -c1-200; grep -h "Error" $ex/N/*.log | tail -3
      EXACT_SPEC=${SPEC_K:-3} python3 scripts/gpu_exactness.py compare $ex/N hisparse
      echo "== verdict ngram rc=$? (0 EXACT, 1 MISMATCH, 3 VOID)"
      rm -f $ex/*/prompts.json $ex/*/shuffled.json
      kill $mon; mon=
    fi
    # (b) the speedup at 1 request: only on a real model (random weights copy no text, so their
    # drafts are rejected and a speedup means nothing)
    if [ -n "${SPEC_MODEL:-}" ] && [ -n "${SPEC_TEXT:-}" ]; then
      SERVING_LIMIT=${LIMIT:-540} bash scripts/gpu_serving.sh "$out/spec" --model "$SPEC_MODEL" \
        --load-format auto --text-ids "$SPEC_TEXT" --repeat-block ${SPEC_BLOCK:-256} \
        --input-len ${SPEC_IN:-32768} --output-len 256 --rounds ${ROUNDS:-2} --concurrency 1 \
        --gpu-memory-utilization 0.3 --backends ${BACKENDS:-stock,hisparse} --speculative "$spec" \
        --hisparse "${HISPARSE:-$cfg32k}" ${SERVING_FLAGS:-}
      echo "== ngram speedup rc=$?"
    else
      echo "ngram speedup: skipped (SPEC_MODEL=DIR and SPEC_TEXT=FILE: a real model and its text)"
    fi
    since "ngram done" ;;
  *) echo "part: kernels, exact, qwen, quality, cap, paper, reasoning, 4k, 32k1, profile," \
       "prefill, chat or ngram" >&2
     exit 2 ;;
esac
