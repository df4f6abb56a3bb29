#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/demo.sh: make .venv from requirements.txt, once per change
# of requirements. torch is pinned to 2.13.0, the CPU wheel pip finds on this kind of machine.

ensure_venv() {
  local root="$1"
  local venv="${root}/.venv"
  local stamp="${venv}/.requirements.sha256"
  local want
  want=$(cat "${root}/requirements.txt" "${root}/code/requirements.txt" "${root}/job/requirements.txt" | sha256sum | cut -d' ' -f1)
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    return 0
  fi
  echo "setting up ${venv} (first run, or requirements changed)" >&2
  if [[ ! -x "${venv}/bin/python" ]]; then
    python3 -m venv "${venv}"
  fi
  "${venv}/bin/python" -m pip install --quiet --upgrade pip >&2
  "${venv}/bin/python" -m pip install --quiet -r "${root}/requirements.txt" >&2
  echo "${want}" >"${stamp}"
}
