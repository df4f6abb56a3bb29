#!/usr/bin/env bash
# Chooses the Python the pod runs and writes its path to PYTHON_FILE.
#
#   python_env.sh WORK_DIR PYTHON_FILE [--constraints FILE] REQUIREMENTS_FILE...
#
# The image's python3 when it already satisfies every requirement: a check of installed metadata
# that takes milliseconds, so a pod whose image has everything installs nothing. Otherwise a venv
# under WORK_DIR named by the requirements' hash, which sees the image's packages (torch is never
# reinstalled) and adds only what is missing; a later start with the same requirements and the
# same WORK_DIR reuses it as it is. Never conda, never a fresh environment per start.
# --constraints (job/constraints.txt: pip's -c) asks for nothing, but a package the image has
# outside its range gets a version inside it in the venv.
#
# Exit 64: requirements that no retry will install (a bad line, no such package or version, a
# version outside a constraint's range and none inside it to be had).
# Exit 75: pip could not reach its index.
set -o errexit -o nounset -o pipefail

# URL credentials hidden on each line (LOG_REDACT): requirements may name an index as
# https://user:TOKEN@host/simple, and both requirements_met.py's list and pip's errors quote it.
LOG_NAME=python_env
LOG_REDACT=1
# shellcheck source=job/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

main() {
  exec >&2  # all it prints is log lines; what it chose goes to PYTHON_FILE
  local work_dir=$1 python_file=$2; shift 2
  local -a constraints=()
  if [[ "${1:-}" == --constraints ]]; then
    constraints=(--constraints "$2")
    shift 2
  fi
  local here base
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  base=$(command -v python3) || die 64 "the image has no python3; use an image with Python 3.9+ and torch"

  local missing code=0
  missing=$("${base}" "${here}/requirements_met.py" "${constraints[@]}" "$@") || code=$?
  case "${code}" in
    0) log "the image's Python has every requirement: nothing to install"
       echo "${base}" >"${python_file}"; return 0 ;;
    1) log "${missing}" ;;
    *) die 64 "requirements cannot be used (see above); fix requirements.txt in S3_CODE_URI" ;;
  esac

  local key venv
  key=$(cat "${constraints[@]:1}" "$@" | sha256sum | cut -c1-12)
  venv="${work_dir}/.venv-${key}"
  if [[ -f "${venv}/.ready" ]]; then
    log "reusing ${venv} (made by an earlier start with the same requirements)"
  else
    make_venv "${base}" "${venv}" "${constraints[@]}" "$@"
  fi
  echo "${venv}/bin/python" >"${python_file}"
}

make_venv() {
  local base=$1 venv=$2; shift 2
  local -a args=()
  local found="" range have
  if [[ "${1:-}" == --constraints ]]; then
    args+=(-c "$2")
    # A constrained package the image has outside its range is asked for, within it.
    while read -r range have; do
      args+=("${range}")
      found+="${found:+, }${range%%[<>=!~]*} ${have} (supported: ${range#"${range%%[<>=!~]*}"})"
    done < <("${base}" "$(dirname "${BASH_SOURCE[0]}")/requirements_met.py" --outside "$2")
    shift 2
  fi
  rm -rf "${venv}"
  # No pip or setuptools of its own: the image's, seen through the .pth file, stay in charge
  # (a venv's bundled setuptools would shadow a newer one that torch requires).
  "${base}" -m venv --without-pip "${venv}"
  inherit_image_packages "${base}" "${venv}"
  local output code=0 file
  for file in "$@"; do args+=(-r "${file}"); done
  output=$("${venv}/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    "${args[@]}" 2>&1) || code=$?
  if ((code != 0)); then
    rm -rf "${venv}"
    explain_pip_failure "${output}" "${found}"
  fi
  touch "${venv}/.ready"
  log "installed what was missing into ${venv}${found:+ (for ${found} in the image)}"
}

# The venv's own packages come first; the image's (torch above all) follow through a .pth file:
# every folder on the image Python's path but its standard library, so folders that the image's
# own .pth files add come too (a .pth names folders; it is not read again inside them).
# --system-site-packages would miss them when the image's python3 is itself a venv.
inherit_image_packages() {
  local base=$1 venv=$2 site
  site=$("${venv}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "${base}" -c 'import site, sys, sysconfig
std = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
paths = [p for p in sys.path[1:] if p and p not in std and not p.endswith((".zip", "lib-dynload"))]
print("\n".join(dict.fromkeys(paths + [site.getusersitepackages()])))' >"${site}/_image_packages.pth"
}

explain_pip_failure() {
  local output=$1 found=$2 last
  last=$(grep -E '^ERROR' <<<"${output}" | tail -n 1)
  if grep -qiE 'connection|timed out|temporary failure in name resolution|max retries exceeded' <<<"${output}"; then
    die 75 "pip could not reach its index (${last:-no detail}); the next pod will try again"
  fi
  if [[ -n "${found}" ]]; then
    die 64 "the image has ${found} and pip could not install a supported one (${last:-$(tail -n 1 <<<"${output}")}); use an image with a supported version, or let pip reach its index"
  fi
  die 64 "the code's requirements cannot be installed (${last:-$(tail -n 1 <<<"${output}")}); fix requirements.txt in S3_CODE_URI or add the packages to the image"
}

main "$@"
