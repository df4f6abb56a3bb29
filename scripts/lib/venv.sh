#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/demo.sh: make .venv from requirements.txt, once per change
# of requirements. torch is pinned to 2.13.0, the CPU wheel pip finds on this kind of machine.
#
# The local pod runs as uid 1000, as on a cluster, and uses .venv as its image's Python: the
# interpreter behind it must be one that user can run. A system Python is preferred for that
# (a pyenv under /root is not readable by others); PYTHON=... picks another.

base_python() {
  local candidate
  for candidate in "${PYTHON:-}" /usr/bin/python3 /usr/local/bin/python3 "$(command -v python3)"; do
    [[ -n "${candidate}" && -x "${candidate}" ]] || continue
    "${candidate}" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || continue
    echo "${candidate}"
    return 0
  done
  echo "no Python 3.10+ with venv found; install python3 and python3-venv, or set PYTHON=/path/to/python3" >&2
  return 1
}

readable_by_others() {
  local path
  path=$(readlink -f "$1")
  while [[ "${path}" != / ]]; do
    path=$(dirname "${path}")
    [[ $(($(stat -c '%a' "${path}") % 10 & 1)) -eq 1 ]] || return 1
  done
}

ensure_venv() {
  local root="$1"
  local venv="${root}/.venv"
  local stamp="${venv}/.requirements.sha256"
  local python want
  python=$(base_python) || return 1
  want=$( (echo "${python}"; cat "${root}/requirements.txt" "${root}/code/requirements.txt" "${root}/job/requirements.txt") | sha256sum | cut -d' ' -f1)
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    return 0
  fi
  readable_by_others "${python}" ||
    echo "warning: ${python} is not reachable by other users; the local pod (uid 1000) cannot run it. Set PYTHON=/usr/bin/python3" >&2
  echo "setting up ${venv} from ${python} (first run, or requirements changed)" >&2
  rm -rf "${venv}"
  "${python}" -m venv "${venv}"
  "${venv}/bin/python" -m pip install --quiet --upgrade pip >&2
  "${venv}/bin/python" -m pip install --quiet -r "${root}/requirements.txt" >&2
  echo "${want}" >"${stamp}"
}
