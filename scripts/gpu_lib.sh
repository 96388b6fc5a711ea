# What the GPU-box scripts share; sourced from the repository root, after scripts/gpu_setup.sh:
#   source scripts/gpu_lib.sh
# (tests/test_box_scripts.py runs cuda_tests on the CPU with a stand-in python3.)

# cuda_tests DIR LIMIT [PYTEST_OPTION...] FILE...: each GPU test file in its own pytest process
# (-m cuda; a crash in one file does not hide the others), stopped after LIMIT s (0: never), its
# output in DIR/pytest-NAME.log. Prints one line a file, "== FILE rc=N: <pytest's last line>",
# then up to 40 error lines of those logs. Options before the files go to pytest (-x, -k EXPR).
cuda_tests() {
  local dir=$1 limit=$2 f log rc
  local opts=() logs=()
  shift 2
  while [[ "${1:-}" == -* ]]; do
    opts+=("$1"); shift
    [ "${opts[-1]}" = -k ] && { opts+=("$1"); shift; }
  done
  mkdir -p "$dir"
  for f in "$@"; do
    log=$dir/pytest-$(basename "$f" .py).log
    timeout "$limit" python3 -X faulthandler -m pytest -q -m cuda -p no:cacheprovider \
      ${opts[@]+"${opts[@]}"} "$f" > "$log" 2>&1
    rc=$?
    echo "== $f rc=$rc: $(tail -1 "$log")"
    logs+=("$log")
  done
  [ ${#logs[@]} -eq 0 ] || grep -hE "FAILED|Error|error|assert" "${logs[@]}" | head -40
  return 0
}

# box_setup DIR: scripts/gpu_setup.sh with its output in DIR/setup.log; on failure the log's last
# 20 lines and exit 1
box_setup() {
  mkdir -p "$1"
  source scripts/gpu_setup.sh "$1" > "$1/setup.log" 2>&1 || { tail -20 "$1/setup.log"; exit 1; }
}
