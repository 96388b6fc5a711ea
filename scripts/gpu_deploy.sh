#!/usr/bin/env bash
# Issue 18's GPU checks in one call (~7 min with vLLM installed by an earlier call of the session):
# the Docker build replayed and serving (scripts/gpu_docker_replay.sh, port 8765) and, once that
# replay's install step is done (it replaces /tmp/site's vllm_hisparse), the soak
# (scripts/gpu_soak.sh, port 8766) beside it on the same GPU (0.3 + 0.5 of its memory).
#   bash scripts/gpu_deploy.sh OUT [SOAK_SECONDS]     # default 150
# OUT: summary.txt (both scripts' result lines), docker.tgz, soak.tgz (at most 8 files come back).
set -uo pipefail
top=$1; dur=${2:-150}
mkdir -p "$top" /tmp/gd/docker /tmp/gd/soak
exec > >(tee -a "$top/summary.txt") 2>&1
trap 'tar czf "$top/docker.tgz" -C /tmp/gd docker; tar czf "$top/soak.tgz" -C /tmp/gd soak' EXIT
t0=$(date +%s)
bash scripts/gpu_docker_replay.sh /tmp/gd/docker > /dev/null 2>&1 &   # its log: replay.log
d=$!
for _ in $(seq 600); do     # the build step's check line (PASS or FAIL) or the replay's end
  grep -q "Dockerfile replayed\|bundle installed" /tmp/gd/docker/summary.txt 2> /dev/null && break
  kill -0 $d 2> /dev/null || break
  sleep 1
done
echo "docker build step done at $(( $(date +%s) - t0 )) s: $(tail -1 /tmp/gd/docker/summary.txt)"
bash scripts/gpu_soak.sh /tmp/gd/soak "$dur" > /tmp/gd/soak/stdout.txt 2>&1
echo "== soak rc=$? at $(( $(date +%s) - t0 )) s"
python3 -c "import json; s=json.load(open('/tmp/gd/soak/soak.json')); print(json.dumps(s)[:3000])" \
  2> /dev/null || tail -30 /tmp/gd/soak/stdout.txt
wait $d
echo "== docker replay rc=$? at $(( $(date +%s) - t0 )) s"
cat /tmp/gd/docker/summary.txt
