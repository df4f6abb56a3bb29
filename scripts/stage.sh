#!/usr/bin/env bash
# Uploads the training code in the layout the pod expects:
#
#   S3_CODE_URI/train.py model.py config.py checkpoint.py contract.py requirements.txt config/*.yaml
#
#   scripts/stage.sh s3://bucket/gpt/code/ [--data DIR s3://bucket/gpt/data/] [--model DIR s3://bucket/models/x/]
#
# The code prefix is made to match exactly (files gone from code/ are removed there); --data
# uploads train.bin, val.bin and meta.json from DIR (made by scripts/prepare_data.py); --model
# uploads a model snapshot folder (save_pretrained: config.json, weights, tokenizer) for
# S3_MODEL_URI. Uses the AWS CLI; AWS_ENDPOINT_URL points it at an S3-compatible store.
set -o errexit -o nounset -o pipefail

die() { echo "stage.sh: error: $*" >&2; exit 64; }

check_uri() {
  [[ "$1" =~ ^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$ ]] || die "$1 is not an s3://bucket/prefix/ URI"
  [[ "$1" == */ ]] && echo "$1" || echo "$1/"
}

stage_code() {
  local root=$1 uri=$2 layout
  layout=$(mktemp -d)
  cp "${root}"/code/*.py "${root}/code/requirements.txt" "${layout}/"
  mkdir "${layout}/config"
  cp "${root}"/config/*.yaml "${layout}/config/"
  local code=0
  aws s3 sync --delete --only-show-errors "${layout}/" "${uri}" || code=$?
  echo "staged code: $(find "${layout}" -type f | wc -l) files in ${uri}"
  rm -rf "${layout}"
  return "${code}"
}

stage_data() {
  local dir=$1 uri=$2 name
  for name in train.bin val.bin; do
    [[ -s "${dir}/${name}" ]] || die "${dir}/${name} not found; make it with scripts/prepare_data.py --out ${dir}"
  done
  aws s3 sync --only-show-errors --exclude '*' --include '*.bin' --include meta.json "${dir}/" "${uri}"
  echo "staged data: $(du -sh "${dir}" | cut -f1) from ${dir} in ${uri}"
}

# The snapshot as it is: only config.json is required (a Hugging Face model has it).
check_model() {
  [[ -f "$1/config.json" ]] ||
    die "$1 holds no config.json; save the model there with save_pretrained (or hf download --local-dir $1)"
}

stage_model() {
  local dir=$1 uri=$2
  aws s3 sync --only-show-errors "${dir}/" "${uri}"
  echo "staged model: $(du -sh "${dir}" | cut -f1) from ${dir} in ${uri}"
}

readonly USAGE="usage: scripts/stage.sh S3_CODE_URI [--data DIR S3_DATA_URI] [--model DIR S3_MODEL_URI]"
usage() { die "${USAGE} (--help says more)"; }

# The usage, then the header comment above.
help() {
  printf '%s\n\n' "${USAGE}"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

main() {
  (($# >= 1)) || usage
  if [[ "$1" == -h || "$1" == --help ]]; then
    help
    return 0
  fi
  command -v aws >/dev/null || die "aws not found; run ./scripts/test.sh once (it makes .venv) or install awscli"
  local root code_uri data_dir="" data_uri="" model_dir="" model_uri=""
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  code_uri=$(check_uri "$1")
  shift
  # Every URI checked before anything is uploaded.
  while (($# > 0)); do
    (($# >= 3)) || usage
    case "$1" in
      --data) data_dir=$2; data_uri=$(check_uri "$3") ;;
      --model) model_dir=$2; model_uri=$(check_uri "$3"); check_model "${model_dir}" ;;
      *) usage ;;
    esac
    shift 3
  done
  stage_code "${root}" "${code_uri}"
  [[ -z "${data_uri}" ]] || stage_data "${data_dir}" "${data_uri}"
  [[ -z "${model_uri}" ]] || stage_model "${model_dir}" "${model_uri}"
}

main "$@"
