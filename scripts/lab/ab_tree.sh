#!/usr/bin/env bash
# A second tree for an A/B on the GPU box in one device call: git ref REF exported (docs left out)
# into build/ab/NAME (git-ignored), with its extension built here for the box's Python 3.12
# (scripts/build_for_box.sh with BOX_REF), and AB_REF naming the commit. Carry build/ab/NAME
# (~8 MB of tree + ~10 MB of extension) and run a part of the session in it, e.g.
#   bash scripts/lab/ab_tree.sh missflag miss-flag          # here, ~3 min
#   (cd build/ab/missflag && NO_VLLM=1 KBENCH=... bash scripts/gpu_session.sh $OUT/missflag kernels)
set -euo pipefail
name=$1; ref=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
dst=$root/build/ab/$name
sha=$(git -C "$root" rev-parse --verify "$ref^{commit}")
rm -rf "$dst"; mkdir -p "$dst"
git -C "$root" archive "$sha" -- . ':(exclude)docs' | tar -x -C "$dst"
echo "$sha $ref" > "$dst/AB_REF"
BOX_REF=$sha BOX_OUT=$dst/vllm_hisparse bash "$root/scripts/build_for_box.sh"
echo "tree $dst: $(cat "$dst/AB_REF"), $(du -sh "$dst" | cut -f1)"
