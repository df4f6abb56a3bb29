#!/usr/bin/env bash
# Uploads training code to S3 in the layout the pod expects (and, if asked, data and a model).
#
# Usage:
#   scripts/stage.sh S3_CODE_URI [--code DIR] [--exclude GLOB]... [--delete] [--dry-run]
#                    [--data DIR S3_DATA_URI] [--model DIR S3_MODEL_URI]
#
# --code DIR   your code folder, recursively (packages, config files, requirements.txt), with the
#              runtime's checkpoint.py and contract.py beside it unless DIR has its own. Without
#              --code: this repository's code/, and config/*.yaml as config/. Links are followed.
# --exclude    a name or relative path (glob) to leave out; __pycache__, *.pyc, .git, .venv are left out anyway.
# --delete     also remove the files an earlier stage.sh put in the prefix that the folder no longer
#              has (its record: .stage-record.json). Files put there any other way are never deleted.
# --dry-run    print what would be uploaded and deleted; change nothing.
# --data       train.bin, val.bin and meta.json from DIR (made by scripts/prepare_data.py).
# --model      a model snapshot folder (save_pretrained: config.json, weights, tokenizer).
#
# Everything is checked before anything is uploaded: the URIs, the folders, every name (one S3
# and the pod's file system can hold), every link (it must resolve), no secret-looking file (.env,
# *.pem, *.key, id_rsa, credentials, ...: the pod gets secrets from its Secret), none of the pod's
# own folders (data/, out/, model/, .pod/, .tmp/) at the top of the code. Only new and changed
# files are uploaded. Exit codes: 0 staged (or a dry run), 64 bad input or an S3 error no retry
# fixes, 75 S3 unreachable or failing (run it again). Uses the AWS CLI and python3;
# AWS_ENDPOINT_URL points them at an S3-compatible store.
set -o errexit -o nounset -o pipefail

ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/.." && pwd)  # run through a link too
readonly ROOT
readonly EXIT_BAD_INPUT=64
readonly EXIT_UNAVAILABLE=75
readonly RECORD_KEY=.stage-record.json
WORK=""

log() { echo "stage.sh: $*"; }
warn() { echo "stage.sh: warning: $*" >&2; }
die() {
  local code=$1
  shift
  echo "stage.sh: error: $*" >&2
  exit "${code}"
}
need_cmd() { command -v "$1" >/dev/null 2>&1 || die "${EXIT_BAD_INPUT}" "$1 not found; $2"; }

readonly USAGE="scripts/stage.sh S3_CODE_URI [--code DIR] [--exclude GLOB]... [--delete] [--dry-run] [--data DIR S3_DATA_URI] [--model DIR S3_MODEL_URI]"

# --help: the comment at the top of this file.
help() {
  sed -n '2,/^set -o/p' "${BASH_SOURCE[0]}" | sed '$d' | sed -E 's/^# ?//'
}

# What fails unexpectedly gets a line; a check that failed (64, 75) has said why already.
on_error() {
  (($1 == EXIT_BAD_INPUT || $1 == EXIT_UNAVAILABLE)) || echo "stage.sh: error: ${BASH_SOURCE[1]}:$2: '$3' failed" >&2
}

redact() { LC_ALL=C sed -E -f "${ROOT}/job/redact.sed"; }

# shellcheck source=job/s3_uri.sh
source "${ROOT}/job/s3_uri.sh"

check_uri() {
  local fault
  fault=$(s3_uri_fault "$1") || die "${EXIT_BAD_INPUT}" "$(printf '%s' "$1" | LC_ALL=C tr '\001-\037\177' '?' | redact) ${fault}"
  [[ "$1" == */ ]] && echo "$1" || echo "$1/"
}

bucket_of() { local rest=${1#s3://}; echo "${rest%%/*}"; }
prefix_of() { local rest=${1#s3://}; rest=${rest#*/}; [[ "${1#s3://}" == */* ]] && echo "${rest}" || echo ""; }

# Data or a model inside the code prefix would come down with the code into every pod.
check_apart() {
  local code_uri=$1 uri=$2 what=$3
  [[ -n "${uri}" ]] || return 0
  if [[ "${uri}" == "${code_uri}"* || "${code_uri}" == "${uri}"* ]]; then
    die "${EXIT_BAD_INPUT}" "${what} ${uri} and the code ${code_uri} overlap; give each its own prefix"
  fi
}

# Runs the AWS CLI, its output in WORK/aws.out. On failure: one line naming the cause and the fix,
# and exit 64 when no retry fixes it (job/s3_errors.py's table), else 75.   aws_run URI args...
aws_run() {
  local uri=$1 code=0 reason last
  shift
  aws "$@" >"${WORK}/aws.out" 2>"${WORK}/aws.err" || code=$?
  if ((code == 0)) && ! grep -q '"Errors"' "${WORK}/aws.out"; then  # delete-objects says per key
    return 0
  fi
  reason=$(cat "${WORK}/aws.err" "${WORK}/aws.out" | python3 "${ROOT}/job/s3_errors.py" explain-cli "${uri}" --for local)
  [[ -z "${reason}" ]] || die "${EXIT_BAD_INPUT}" "${reason}"
  last=$(cat "${WORK}/aws.err" "${WORK}/aws.out" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-300 | redact)
  die "${EXIT_UNAVAILABLE}" "S3 failed for ${uri} (aws exit ${code}: ${last}); staging stopped there; check the network and AWS_ENDPOINT_URL, then run stage.sh again (it uploads what is missing)"
}

# The code as it will be in S3, checked and copied to WORK/layout (scripts/lib/stage_code.py).
lay_out_code() {
  local uri=$1 code_dir=$2
  shift 2
  local args=(layout "${code_dir:-${ROOT}/code}" "${WORK}" --runtime "${ROOT}/job" --prefix "$(prefix_of "${uri}")")
  [[ -n "${code_dir}" ]] || args+=(--config-dir "${ROOT}/config")
  local glob
  for glob in "$@"; do args+=(--exclude "${glob}"); done
  python3 "${ROOT}/scripts/lib/stage_code.py" "${args[@]}"
}

stage_code() {
  local uri=$1 delete=$2 dry_run=$3 bucket prefix record=()
  bucket=$(bucket_of "${uri}")
  prefix=$(prefix_of "${uri}")
  aws_run "${uri}" s3api list-objects-v2 --bucket "${bucket}" --prefix "${prefix}" --output json
  mv "${WORK}/aws.out" "${WORK}/listing.json"
  if python3 "${ROOT}/scripts/lib/stage_code.py" listed "${WORK}/listing.json" "${prefix}${RECORD_KEY}"; then
    aws_run "${uri}" s3 cp --only-show-errors "${uri}${RECORD_KEY}" "${WORK}/old-record.json"
    record=("${WORK}/old-record.json")
  fi
  local flags=()
  ((!delete)) || flags+=(--delete)
  ((!dry_run)) || log "dry run, nothing is uploaded or deleted; in ${uri}:"
  python3 "${ROOT}/scripts/lib/stage_code.py" plan "${WORK}" "${bucket}" "${prefix}" "${WORK}/listing.json" \
    ${record[@]+"${record[@]}"} ${flags[@]+"${flags[@]}"}
  local staged uploaded deleted kept
  read -r staged uploaded deleted kept <"${WORK}/counts"
  if ((dry_run)); then
    log "dry run: code: ${staged} files, ${uploaded} to upload, ${deleted} to delete, ${kept} kept, in ${uri}"
    return 0
  fi
  # New and changed files (and a record that still names the files to delete) first, stale ones
  # deleted after, the final record last: stopped anywhere, the prefix holds the new code whole and
  # its record names every file stage.sh put there, so a rerun deletes what is left.
  if [[ -n "$(ls -A "${WORK}/upload")" ]]; then
    aws_run "${uri}" s3 cp --recursive --only-show-errors "${WORK}/upload/" "${uri}"
  fi
  local request
  for request in "${WORK}"/delete-*.json; do
    [[ -f "${request}" ]] || continue  # no match: the glob itself
    aws_run "${uri}" s3api delete-objects --bucket "${bucket}" --delete "file://${request}"
  done
  if [[ -f "${WORK}/final-record.json" ]]; then
    aws_run "${uri}" s3 cp --only-show-errors "${WORK}/final-record.json" "${uri}${RECORD_KEY}"
  fi
  log "staged code: ${staged} files in ${uri} (${uploaded} uploaded, ${deleted} deleted, ${kept} kept)"
}

check_data() {
  local dir=$1 name
  for name in train.bin val.bin; do
    [[ -s "${dir}/${name}" ]] || die "${EXIT_BAD_INPUT}" "${dir}/${name} not found; make it with scripts/prepare_data.py --out ${dir}"
  done
}

# The snapshot as it is: only config.json is required (a Hugging Face model has it).
check_model() {
  [[ -f "$1/config.json" ]] ||
    die "${EXIT_BAD_INPUT}" "$1 holds no config.json; save the model there with save_pretrained (or hf download --local-dir $1)"
}

# Data and models are added to, never deleted from: a prefix may hold what other runs use.
stage_folder() {
  local what=$1 dir=$2 uri=$3 dry_run=$4
  shift 4
  if ((dry_run)); then
    aws_run "${uri}" s3 sync --dryrun "$@" "${dir}/" "${uri}"
    sed 's/^/  /' "${WORK}/aws.out"
    log "dry run: ${what}: $(grep -c . "${WORK}/aws.out" || true) file(s) to upload from ${dir} to ${uri}"
    return 0
  fi
  aws_run "${uri}" s3 sync --only-show-errors "$@" "${dir}/" "${uri}"
  log "staged ${what}: $(du -sh "${dir}" | cut -f1) from ${dir} in ${uri}"
}

main() {
  trap 'on_error $? ${LINENO} "${BASH_COMMAND}"' ERR
  local code_uri="" code_dir="" data_dir="" data_uri="" model_dir="" model_uri="" delete=0 dry_run=0
  local excludes=()
  while (($# > 0)); do
    case "$1" in
      -h | --help) help; exit 0 ;;
      --code) (($# >= 2)) || die "${EXIT_BAD_INPUT}" "--code needs a folder (see --help)"
        code_dir=${2%/}; shift 2 ;;
      --exclude) (($# >= 2)) || die "${EXIT_BAD_INPUT}" "--exclude needs a glob"
        excludes+=("$2"); shift 2 ;;
      --delete) delete=1; shift ;;
      --dry-run) dry_run=1; shift ;;
      --data | --model)
        (($# >= 3)) || die "${EXIT_BAD_INPUT}" "$1 needs a folder and an s3:// URI (see --help)"
        if [[ "$1" == --data ]]; then data_dir=${2%/}; data_uri=$(check_uri "$3")
        else model_dir=${2%/}; model_uri=$(check_uri "$3"); fi
        shift 3 ;;
      -*) die "${EXIT_BAD_INPUT}" "unknown option $1 (see --help)" ;;
      *) [[ -z "${code_uri}" ]] || die "${EXIT_BAD_INPUT}" "one S3_CODE_URI only, got $1 too (see --help)"
        code_uri=$(check_uri "$1"); shift ;;
    esac
  done
  [[ -n "${code_uri}" ]] || die "${EXIT_BAD_INPUT}" "no S3_CODE_URI; usage: ${USAGE}"
  need_cmd python3 "install Python 3"
  need_cmd aws "run ./scripts/test.sh once (it makes .venv) or install awscli"
  check_apart "${code_uri}" "${data_uri}" "the data"
  check_apart "${code_uri}" "${model_uri}" "the model"
  [[ -z "${data_dir}" ]] || check_data "${data_dir}"
  [[ -z "${model_dir}" ]] || check_model "${model_dir}"
  WORK=$(mktemp -d)
  trap 'rm -rf "${WORK}"' EXIT
  lay_out_code "${code_uri}" "${code_dir}" ${excludes[@]+"${excludes[@]}"}
  # Everything is checked: from here on, S3.
  stage_code "${code_uri}" "${delete}" "${dry_run}"
  [[ -z "${data_uri}" ]] ||
    stage_folder data "${data_dir}" "${data_uri}" "${dry_run}" --exclude '*' --include '*.bin' --include meta.json
  [[ -z "${model_uri}" ]] || stage_folder model "${model_dir}" "${model_uri}" "${dry_run}"
}

main "$@"
