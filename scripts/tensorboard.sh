#!/usr/bin/env bash
# TensorBoard on a run's event files in S3, live, while the run trains:
#
#   scripts/tensorboard.sh s3://bucket/gpt/runs/my-run/ [tensorboard args...]   # one run
#   scripts/tensorboard.sh s3://bucket/gpt/runs/ [--port 6007] [--reload_interval 10]   # every run
#
# One run (the URI holds tensorboard/, status.json or checkpoints/) shows as NAME/tensorboard; a
# prefix of runs shows them side by side, each as RUN/tensorboard, and runs that start later appear
# by themselves. The pod uploads event files every SYNC_INTERVAL_SECONDS and TensorBoard re-reads
# them every --reload_interval (5 s by default), so new points show up without a restart.
#
# Names read from S3 are shown with control characters as "?" (never sent to the terminal as they are).
# Serves on 127.0.0.1 unless --host or --bind_all is given; reads S3 with --load_fast=false (the
# Rust data server reads only local and gs:// paths). Other arguments go to tensorboard as they are.
#
# S3 through boto3's usual credentials. An S3-compatible store: AWS_ENDPOINT_URL, or S3_ENDPOINT,
# which TensorBoard itself reads and which wins; it must start with http:// or https://. Without
# its scheme TensorBoard's loader thread dies at the first read and serves empty pages forever, so
# this script refuses it.
#
# Exit codes: 64 bad input (URI, endpoint, missing bucket, nothing there, no tensorboard), 75 S3
# unreachable; else tensorboard's own.
set -o errexit -o nounset -o pipefail

readonly EXIT_BAD_INPUT=64
readonly EXIT_UNAVAILABLE=75
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/.." && pwd)  # run through a link too
readonly ROOT
# shellcheck source=job/s3_uri.sh
source "${ROOT}/job/s3_uri.sh"

# Every line is printable (run names come from S3) and hides credentials in URLs (job/redact.sed).
say() { echo "tensorboard.sh: $(printable "$*" | redact)" >&2; }
redact() { LC_ALL=C sed -E -f "${ROOT}/job/redact.sed"; }

# Text for the terminal: control characters (C0, DEL, C1) and bidirectional overrides as "?", so a
# run's name cannot move the cursor, retitle the window or reorder the line.
printable() {
  printf '%s' "$1" | tr '\n' '?' |
    LC_ALL=C sed -E 's/[\x01-\x1f\x7f]/?/g; s/\xc2[\x80-\x9f]/?/g; s/\xe2\x80[\xaa-\xae]/?/g; s/\xe2\x81[\xa6-\xa9]/?/g'
}
die() {
  local code=$1; shift
  say "error: $*"
  exit "${code}"
}

check_uri() {
  local fault
  fault=$(s3_uri_fault "$1") || die "${EXIT_BAD_INPUT}" "$1 ${fault}; give a run's folder or the folder of its runs"
  [[ "$1" == */ ]] && echo "$1" || echo "$1/"
}

# An endpoint with its user:password@ hidden, with or without a scheme, whatever the password holds.
hide_userinfo() {
  local scheme="" rest=$1
  if [[ "$1" == *://* ]]; then scheme="${1%%://*}://"; rest=${1#*://}; fi
  [[ "${rest}" != *@* ]] || rest="***@${rest##*@}"
  echo "${scheme}${rest}"
}

# Prints the endpoint TensorBoard will use (S3_ENDPOINT wins, as in its S3 reader), or nothing.
check_endpoint() {
  local name value
  for name in S3_ENDPOINT AWS_ENDPOINT_URL; do
    value=${!name:-}
    [[ -n "${value}" ]] || continue
    [[ "${value}" =~ ^https?://[^/]+ ]] ||
      die "${EXIT_BAD_INPUT}" "${name}=$(hide_userinfo "${value}") has no http:// or https:// scheme" \
        "(TensorBoard's loader would die on it and serve empty pages); give it as http://$(hide_userinfo "${value#*://}")"
    echo "${value}"
    return 0
  done
  return 0
}

# The venv's tools when they are not on PATH (./scripts/test.sh makes .venv).
find_tool() {
  if command -v "$1" >/dev/null 2>&1; then
    command -v "$1"
  elif [[ -x "${ROOT}/.venv/bin/$1" ]]; then
    echo "${ROOT}/.venv/bin/$1"
  else
    die "${EXIT_BAD_INPUT}" "$1 not found; run ./scripts/test.sh once (it makes .venv)" \
      "or pip install tensorboard boto3 awscli"
  fi
}

# Where (`cut -c` counts bytes) the text after $1 starts, whatever letters $1 has.
position_after() { local LC_ALL=C; echo "$((${#1} + 1))"; }

# Every key under the URI (relative to it), one a line; dies with one line on S3 errors.
list_keys() {
  local uri=$1 endpoint=$2 prefix aws output code=0
  prefix=${uri#s3://*/}
  aws=$(find_tool aws)
  local -a args=(s3 ls --recursive "${uri}")
  [[ -z "${endpoint}" ]] || args=(--endpoint-url "${endpoint}" "${args[@]}")
  # Few retries: an unreachable store should say so within seconds.
  output=$(AWS_RETRY_MODE=standard AWS_MAX_ATTEMPTS=2 "${aws}" "${args[@]}" 2>&1) || code=$?
  if ((code != 0)); then
    # The pod's one table of S3 errors no retry fixes (job/s3_errors.py), with a local user's fixes.
    local reason
    reason=$(python3 "${ROOT}/job/s3_errors.py" explain-cli "${uri}" --for local <<<"${output}" 2>/dev/null || true)
    [[ -z "${reason}" ]] || die "${EXIT_BAD_INPUT}" "${reason}"
  fi
  case "${code}:${output}" in
    0:*) sed -E 's/^[0-9-]+ [0-9:]+ +[0-9]+ //' <<<"${output}" | cut -c "$(position_after "${prefix}")-" ;;
    1:) ;;  # nothing under the prefix
    *"Could not connect"* | *"Connect timeout"* | *"Read timeout"* | *"(5"[0-9][0-9]")"*)
      die "${EXIT_UNAVAILABLE}" "S3 unreachable at ${endpoint:-AWS S3}: $(tail -n 1 <<<"${output}")" ;;
    *) die "${EXIT_BAD_INPUT}" "cannot list ${uri}: $(tail -n 1 <<<"${output}")" ;;
  esac
}


# What --logdir or --logdir_spec TensorBoard gets for the URI, as arguments, one a line.
logdir_args() {
  local uri=$1 keys=$2 name runs
  if grep -qE '^(tensorboard|checkpoints)/|^status\.json$' <<<"${keys}"; then
    run_spec "$(basename "${uri%/}")" "${uri}" "${uri}tensorboard/"
    grep -qE '^tensorboard/[^/]*tfevents' <<<"${keys}" ||
      say "no event files in ${uri}tensorboard/ yet: TensorBoard shows them once the trainer writes them"
  elif grep -qE '^[^/]*tfevents' <<<"${keys}"; then  # a run's tensorboard/ folder itself
    run_spec "$(basename "$(dirname "${uri%/}")")" "${uri}" "${uri}"
  else
    runs=$(sed -nE 's#^(.+)/tensorboard/[^/]*tfevents[^/]*$#\1#p' <<<"${keys}" | sort -u | paste -sd ',' - | sed 's/,/, /g')
    say "runs under ${uri}: ${runs:-none with event files yet} (runs that start later show up too)"
    printf '%s\n' "--logdir=${uri}"
  fi
}

# One run, named: TensorBoard shows the run's folder as NAME/tensorboard, as it shows each run of a
# prefix (plain --logdir on tensorboard/ would call it ".").
run_spec() {
  local name=$1 folder=$2 events=$3
  [[ "${name}" != *[:,]* ]] || name=run  # the separators of a spec
  say "run ${name}: ${events}"
  printf '%s\n' "--logdir_spec=${name}:${folder}"
}

has_option() {
  local wanted=$1 arg; shift
  for arg in "$@"; do
    [[ "${arg}" != "${wanted}" && "${arg}" != "${wanted}="* ]] || return 0
  done
  return 1
}

readonly USAGE="usage: scripts/tensorboard.sh S3_URI [tensorboard args...]"

# The usage, then the header comment above.
help() {
  printf '%s\n\n' "${USAGE}"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

main() {
  if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    help
    return 0
  fi
  [[ $# -ge 1 && "$1" != -* ]] || die "${EXIT_BAD_INPUT}" "${USAGE} (--help says more)"
  local uri endpoint keys tensorboard
  uri=$(check_uri "$1")
  shift
  endpoint=$(check_endpoint)
  tensorboard=$(find_tool tensorboard)
  keys=$(list_keys "${uri}" "${endpoint}")
  [[ -n "${keys}" ]] || die "${EXIT_BAD_INPUT}" "nothing under ${uri}; check the URI (a run's folder, or the folder of its runs)"

  local -a args
  mapfile -t args < <(logdir_args "${uri}" "${keys}")
  has_option --host "$@" || has_option --bind_all "$@" || args+=(--host 127.0.0.1)
  has_option --load_fast "$@" || args+=(--load_fast=false)
  if [[ -n "${endpoint}" ]]; then
    export S3_ENDPOINT=${endpoint}
    say "S3 endpoint ${endpoint}"
  fi
  exec "${tensorboard}" "${args[@]}" "$@"
}

main "$@"
