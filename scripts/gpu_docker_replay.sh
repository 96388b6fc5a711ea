#!/usr/bin/env bash
# On the GPU box (no Docker engine, no registry): replay docker/Dockerfile's build over the vLLM
# bundle, then run the image's entrypoint as `docker run --gpus all -v CONFIG:/etc/hisparse/...`
# would, serve one long request and check it. Self-checking: one PASS/FAIL line per check in
# OUT/summary.txt (and on stdout), logs in OUT/replay.log and OUT/logs.tgz; exit 0 only when every
# check passes.
#   bash scripts/gpu_docker_replay.sh OUT
# Needs what scripts/gpu_setup.sh needs: the bundle staged in .gpu-bundle/ and, for vllm serve, the
# prometheus_fastapi_instrumentator wheel in .whl/. What differs from `docker build`: the base image
# is the bundle in /tmp/site (vLLM 0.26.0 on the box's torch), the image's / is /tmp/hisparse-image,
# and build.sh installs with pip --target /tmp/site (HISPARSE_PIP_TARGET); the source tree is not
# on PYTHONPATH, so what runs is the installed copy, as in the image.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_docker_replay.sh OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
exec > >(tee "$out/replay.log") 2>&1
repo=$(pwd) img=/tmp/hisparse-image site=/tmp/site work=/tmp/hisparse-replay
rm -rf "$img" "$work" && mkdir -p "$img" "$work"
: > "$out/summary.txt"
fails=0
check() {   # check NAME COMMAND...: record PASS/FAIL of the command
  local name=$1; shift
  if "$@"; then echo "PASS $name" | tee -a "$out/summary.txt"
  else echo "FAIL $name" | tee -a "$out/summary.txt"; fails=$((fails + 1)); fi
}
finish() {
  [ -n "${server:-}" ] && kill "$server" 2> /dev/null && wait "$server" 2> /dev/null
  cp "$img/replay.json" "$work/" 2> /dev/null
  tar czf "$out/logs.tgz" -C "$work" . 2> /dev/null
  echo "DOCKER REPLAY: $([ "$fails" -eq 0 ] && echo PASS || echo "FAIL ($fails)")" | tee -a "$out/summary.txt"
  exit $((fails > 0))
}
trap finish EXIT
echo "commit $(git rev-parse --short HEAD 2> /dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null)"

# -- the base image: the vLLM bundle (as scripts/gpu_setup.sh installs it), nothing of ours
if [ ! -d "$site/vllm" ]; then
  bash .gpu-bundle/install-vllm-bundle.sh install > "$work/install.log" 2>&1 || { tail -20 "$work/install.log"; check "bundle installed" false; exit; }
fi
if ls .whl/*.whl > /dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl; fi
rm -rf "$site"/vllm_hisparse "$site"/vllm_hisparse-*.dist-info    # a gpu_setup.sh run's copy
export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset VLLM_USE_V2_MODEL_RUNNER HISPARSE_CONFIG            # the image's ENV and mount must set them
base=$(sed -n 's/^FROM vllm\/vllm-openai:v//p' docker/Dockerfile)
have=$(cd / && python3 -c "import importlib.metadata as m; print(m.version('vllm'))")
echo "base image tag v$base; bundle vLLM $have"
check "base tag v$base = the bundle's vLLM $have" [ "$base" = "$have" ]

# -- docker build: every step of docker/Dockerfile (build.sh compiles, installs and checks)
python3 scripts/dockerfile_replay.py docker/Dockerfile --root "$img" --build-arg MAX_JOBS=16 \
  --env HISPARSE_PIP_TARGET="$site" > "$work/build.log" 2>&1
rc=$?
grep -E "^replay:|^build.sh:|Error|error:" "$work/build.log" | tail -40
check "Dockerfile replayed (build.sh: extension built, entry point, vLLM 0.26)" [ "$rc" -eq 0 ]
[ "$rc" -eq 0 ] || exit
installed=$(cd / && python3 -c "import vllm_hisparse, os; print(os.path.dirname(vllm_hisparse.__file__))")
check "the installed copy is the one imported ($installed)" [ "$installed" = "$site/vllm_hisparse" ]
entry=$(python3 -c "import json; print(json.load(open('$img/replay.json'))['entrypoint'][0])")
imgenv=$(python3 -c "import json; print(' '.join(f'{k}={v}' for k, v in json.load(open('$img/replay.json'))['env'].items()))")
wdir=$(python3 -c "import json; print(json.load(open('$img/replay.json'))['workdir'])")
echo "entrypoint $entry; image env $imgenv; workdir $wdir"

# -- docker run --gpus all -v hisparse.json:/etc/hisparse/config.json vllm-hisparse MODEL ...
model=$work/llama3-8b-shape
(cd / && python3 -m vllm_hisparse.bench.model_shapes llama3-8b "$model") > "$work/model.log" 2>&1 \
  || { tail -5 "$work/model.log"; check "model shape written" false; exit; }
mkdir -p "$img/etc/hisparse"
cat > "$img/etc/hisparse/config.json" << 'EOF'
{"top_k": 256, "device_buffer_size": 512, "min_context": 1024, "host_pool_gib": 2,
 "dense_pool_gib": 0.5, "resident_first": false}
EOF
port=8765
( cd "$wdir" && exec env $imgenv HISPARSE_CONFIG_MOUNT="$img/etc/hisparse/config.json" \
    HISPARSE_STATS_FILE="$work/stats.json" "$entry" "$model" --load-format dummy \
    --max-model-len 4096 --max-num-seqs 4 --gpu-memory-utilization 0.3 --port "$port" ) \
  > "$work/server.log" 2>&1 &
server=$!
python3 - "$port" "$server" << 'EOF'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
t0 = time.time()
while time.time() - t0 < 480:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        print(f"server up after {time.time() - t0:.0f} s"); sys.exit(0)
    except Exception:
        if not os.path.exists(f"/proc/{pid}"):
            print("server exited"); sys.exit(1)
        time.sleep(2)
print("server not up after 480 s"); sys.exit(1)
EOF
up=$?
check "entrypoint serves (health within 480 s)" [ "$up" -eq 0 ]
if [ "$up" -ne 0 ]; then tail -40 "$work/server.log"; exit; fi
check "the mounted config reached vLLM" grep -q "'top_k': 256, 'device_buffer_size': 512" "$work/server.log"
check "V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0 from the image ENV)" bash -c "! grep -q 'V2 GPU model runner' '$work/server.log'"
python3 - "$port" "$model" "$work/request.json" << 'EOF'
import json, random, sys, urllib.request
port, model, path = sys.argv[1:]
random.seed(0)
prompt = [random.randrange(3, 500) for _ in range(3000)]
body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=300))
json.dump(r, open(path, "w"))
u = r["usage"]
print("request:", u)
sys.exit(0 if (u["prompt_tokens"], u["completion_tokens"]) == (3000, 32) else 1)
EOF
rc=$?
check "one 3000-token request: 32 tokens back" [ "$rc" -eq 0 ]
python3 - "$work/stats.json" << 'EOF'
import json, os, sys, time
s = {}
for _ in range(40):               # the worker writes its counters once the request is dropped
    if os.path.exists(sys.argv[1]):
        s = json.load(open(sys.argv[1]))
        if s.get("live_requests") == 0:
            break
    time.sleep(0.5)
print("stats:", s)
sys.exit(0 if s.get("resolved_units", 0) > 0 and s.get("host_pages_used") == 0
         and s.get("live_requests") == 0 else 1)
EOF
rc=$?
check "sparse decode ran (pages resolved > 0) and the host pool is empty after" [ "$rc" -eq 0 ]
check "no traceback in the server log" bash -c "! grep -q Traceback '$work/server.log'"
kill "$server" 2> /dev/null; wait "$server" 2> /dev/null; server=

# -- a bad config through the same entrypoint: one line, exit 2, before the engine starts
echo '{"top_k": 0}' > "$work/bad.json"
( cd "$wdir" && exec env $imgenv HISPARSE_CONFIG="$work/bad.json" "$entry" "$model" --port "$port" ) \
  > "$work/bad.out" 2> "$work/bad.err"
rc=$?
last=$(tail -1 "$work/bad.err" | sed -E 's/^\([A-Za-z]+ pid=[0-9]+\) //')
echo "bad config: exit $rc, last line: $last"
one_line() { [ "$rc" -eq 2 ] && [[ "$last" == "hisparse config: top_k=0 is invalid"* ]] \
  && ! grep -q Traceback "$work/bad.err"; }
check "bad config: exit 2 and one hisparse line, no traceback" one_line
