#!/usr/bin/env bash
# The GPU box runs exactly a commit, whatever the working tree holds uncommitted (helpers editing
# in parallel): a device call copies the working tree, so pin here and unpin there.
#   bash scripts/pin_tree.sh pin     # here: HEAD's vllm_hisparse, scripts, csrc, setup.py into
#                                    # .lab/head.tar (+ .lab/head.txt); carry ".lab" in the call
#   bash .lab/unpin.sh               # there, first thing in the command (pin writes it: this
#                                    # script itself is replaced by the unpinning)
# unpin deletes every file under vllm_hisparse, scripts and csrc but built *.so files, then
# extracts the tar: uncommitted edits and new files are gone, the extension build is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  pin)
    mkdir -p .lab
    git archive -o .lab/head.tar HEAD -- vllm_hisparse scripts csrc setup.py
    git rev-parse --short HEAD > .lab/head.txt
    cat > .lab/unpin.sh <<'UNPIN'
find vllm_hisparse scripts csrc -type f ! -name "*.so" -delete
tar xf .lab/head.tar
echo "tree: $(cat .lab/head.txt) exactly (uncommitted edits removed)"
UNPIN
    echo "pinned $(cat .lab/head.txt) ($(du -h .lab/head.tar | cut -f1)); carry .lab, run bash .lab/unpin.sh first" ;;
  *) echo "usage: bash scripts/pin_tree.sh pin" >&2; exit 2 ;;
esac
