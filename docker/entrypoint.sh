#!/usr/bin/env bash
# The image's entrypoint: `vllm serve` with the hisparse backend selected and vLLM's V1 model runner
# (the one hisparse is verified with). Arguments are vllm serve's: MODEL [options].
#   config: $HISPARSE_CONFIG if set (a missing file is an error), else the file mounted at
#           $HISPARSE_CONFIG_MOUNT (default /etc/hisparse/config.json: docker run -v
#           $PWD/hisparse.json:/etc/hisparse/config.json:ro ...) when there is one, else the
#           defaults; --hisparse-config or an --additional-config naming hisparse on the command
#           line wins over both.
#   HISPARSE_ENTRYPOINT_DRY_RUN=1: print the environment setting and the command instead of
#           running it (tests/test_docker.py).
set -euo pipefail
export VLLM_USE_V2_MODEL_RUNNER="${VLLM_USE_V2_MODEL_RUNNER:-0}"
default_config=${HISPARSE_CONFIG_MOUNT:-/etc/hisparse/config.json}
args=("$@")
given() {   # given FLAG [WORD]: FLAG (or FLAG=...) is among the arguments [and its value holds WORD]
  local i
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
      "$1") [ -z "${2:-}" ] || [[ "${args[i + 1]:-}" == *"$2"* ]] && return 0 ;;
      "$1"=*) [ -z "${2:-}" ] || [[ "${args[i]}" == *"$2"* ]] && return 0 ;;
    esac
  done
  return 1
}
if ! given --hisparse-config && ! given --additional-config hisparse \
    && ! given --additional_config hisparse; then
  if [ -n "${HISPARSE_CONFIG:-}" ]; then
    args+=(--hisparse-config "$HISPARSE_CONFIG")
  elif [ -f "$default_config" ]; then
    args+=(--hisparse-config "$default_config")
  fi
fi
given --attention-backend || given --attention_backend || args+=(--attention-backend hisparse)
if command -v vllm > /dev/null; then cmd=(vllm serve); else cmd=(python3 -m vllm.entrypoints.cli.main serve); fi
if [ -n "${HISPARSE_ENTRYPOINT_DRY_RUN:-}" ]; then
  printf '%s\n' "VLLM_USE_V2_MODEL_RUNNER=$VLLM_USE_V2_MODEL_RUNNER" "${cmd[@]}" "${args[@]}"
  exit 0
fi
exec "${cmd[@]}" "${args[@]}"
