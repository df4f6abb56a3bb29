# shellcheck shell=bash
# log, warn and die for the pod's shell files, sourced from beside them (the ConfigMap mounts job/
# flat):
#
#   LOG_NAME=script; source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#   log "restoring..."; warn "no GPU"; die 64 "S3_CODE_URI is not set; set it in job.yaml"
#
# One line whatever a message quotes (the AWS CLI's last line, a setting): a control character
# from S3 or the network becomes '?', so none starts a line of its own (a forged EVENT) or redraws
# a terminal. LOG_REDACT=1 hides URL credentials on each line (redact.sed), for a file run where no
# redacting pipe takes its output (script.sh redacts all it prints at once: no sed per line).
# DIE_HOOK names a function die calls with the message before it exits.

LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

log() {
  local line="$*"
  line="$(date -u +%Y-%m-%dT%H:%M:%SZ) ${LOG_NAME:-job}: ${line//[[:cntrl:]]/?}"
  if [[ -n "${LOG_REDACT:-}" ]]; then
    printf '%s\n' "${line}" | LC_ALL=C sed -E -f "${LIB_DIR}/redact.sed"
  else
    printf '%s\n' "${line}"
  fi
}
warn() { log "warning: $*" >&2; }
die() {
  local code=$1; shift
  log "error: $*" >&2
  if [[ -n "${DIE_HOOK:-}" ]]; then "${DIE_HOOK}" "$*"; fi
  exit "${code}"
}
