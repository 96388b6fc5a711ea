#!/usr/bin/env bash
# Wheels bigger than one device call carries (64 MiB with the tree: ray's is 79 MB) travel in
# pieces, like the vLLM bundle, and are put back together on the GPU box.
#   bash scripts/wheel_pieces.sh split [DIR]   here: every wheel in DIR (default .whl) over 40 MiB
#                                              becomes DIR/NAME.partN pieces + DIR/PIECES.sha256
#                                              (the whole wheel moves to DIR.big/); small wheels stay
#   bash scripts/wheel_pieces.sh stage [DIR]   on the box, once per call that carries pieces (carry
#                                              the pieces of that call + DIR/PIECES.sha256): copies
#                                              them to /tmp/wheel-stage
#   bash scripts/wheel_pieces.sh join [DIR]    on the box, once every piece is staged: checks each
#                                              wheel against PIECES.sha256 and writes it back into DIR
#                                              (scripts/gpu_setup.sh then installs DIR/*.whl)
#   bash scripts/wheel_pieces.sh file FILE DIR any file (a GGUF: scripts/make_qwen.py pieces), FILE
#                                              left in place: DIR/NAME.partNN (two digits) +
#                                              DIR/PIECES.sha256 (FILE alone); stage DIR, join as above
# The small wheels (ray's own requirements the box lacks) travel whole in DIR with any call.
set -euo pipefail
cmd=${1:-}; dir=${2:-.whl}
stage=${WHEEL_STAGE:-/tmp/wheel-stage}
piece=${WHEEL_PIECE_BYTES:-41943040}
# FILE's sha256 appended to DIR/PIECES.sha256 and FILE cut into DIR/NAME.part0.. (DIGITS wide, so
# that the shell's sorted glob in join puts them back in order)
pieces_of() {
  local name; name=$(basename "$1")
  echo "$(sha256sum < "$1" | cut -d' ' -f1)  $name" >> "$2/PIECES.sha256"
  split -b "$piece" -d -a "$3" "$1" "$2/$name.part"
  echo "$name: $(ls "$2/$name".part* | wc -l) pieces"
}
case "$cmd" in
  split)
    mkdir -p "$dir.big"
    : > "$dir/PIECES.sha256"
    for w in "$dir"/*.whl; do
      [ -f "$w" ] || continue
      [ "$(stat -c %s "$w")" -gt "$piece" ] || continue
      pieces_of "$w" "$dir" 1
      mv "$w" "$dir.big/"
    done ;;
  file)
    src=${2:-}; out=${3:-}
    [ -f "$src" ] && [ -n "$out" ] || { echo "usage: wheel_pieces.sh file FILE DIR" >&2; exit 2; }
    mkdir -p "$out"
    rm -f "$out/$(basename "$src")".part*
    : > "$out/PIECES.sha256"
    pieces_of "$src" "$out" 2 ;;
  stage)
    mkdir -p "$stage"
    for f in "$dir"/*.part* "$dir/PIECES.sha256"; do [ -f "$f" ] && cp "$f" "$stage"/; done
    ls "$stage" ;;
  join)
    [ -f "$stage/PIECES.sha256" ] || { echo "no staged PIECES.sha256 in $stage: stage first"; exit 1; }
    mkdir -p "$dir"
    while read -r sum name; do
      ls "$stage/$name".part* > /dev/null 2>&1 || { echo "no pieces of $name staged"; exit 1; }
      cat "$stage/$name".part* > "$dir/$name"
      echo "$sum  $dir/$name" | sha256sum -c --quiet - || { echo "$name: pieces missing or damaged"; rm -f "$dir/$name"; exit 1; }
      echo "$name joined"
    done < "$stage/PIECES.sha256" ;;
  *) echo "usage: wheel_pieces.sh split|stage|join [DIR] | file FILE DIR" >&2; exit 2 ;;
esac
