#!/usr/bin/env bash
# Runs the test suite, the same way on a laptop and in CI: sets up .venv, then pytest.
#
# Usage:
#   ./scripts/test.sh            everything: unit tests, then the end-to-end runs (root, local S3)
#   ./scripts/test.sh --quick    the unit tests alone: no root, no S3 server, under a minute
#
# Extra arguments go to pytest (./scripts/test.sh -k resume -x).
#
# Tests run in TEST_WORKERS processes (pytest-xdist; default 2, 0 for one process), a file to a
# worker so that a module's shared runs are made once; each worker has its own local S3, and pods
# pick their own ports and addresses. How long each layer takes: docs/lab.md.
set -o errexit -o nounset -o pipefail

# The header comment above is the help.
help() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

main() {
  if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    help
    return 0
  fi
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  # shellcheck source=scripts/lib/venv.sh
  source "${root}/scripts/lib/venv.sh"
  ensure_venv "${root}"
  export PATH="${root}/.venv/bin:${PATH}"
  cd "${root}"
  local workers=(-n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)  # tests/conftest.py orders the files
  if [[ "${1:-}" == --quick ]]; then
    shift
    echo "test.sh: the unit tests only (tests/unit): no root, no S3 server" >&2
    exec python -m pytest "${workers[@]}" tests/unit "$@"
  fi
  exec python -m pytest "${workers[@]}" "$@"
}

main "$@"
