#!/usr/bin/env bash
# Runs the test suite, the same way on a laptop and in CI: sets up .venv, then pytest.
#
#   ./scripts/test.sh            everything: unit tests, then the end-to-end runs (root, local S3)
#   ./scripts/test.sh --quick    the unit tests alone: no root, no S3 server, under a minute
#
# Extra arguments go to pytest (./scripts/test.sh -k resume -x).
set -o errexit -o nounset -o pipefail

main() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  # shellcheck source=scripts/lib/venv.sh
  source "${root}/scripts/lib/venv.sh"
  ensure_venv "${root}"
  export PATH="${root}/.venv/bin:${PATH}"
  cd "${root}"
  if [[ "${1:-}" == --quick ]]; then
    shift
    echo "test.sh: the unit tests only (tests/unit): no root, no S3 server" >&2
    exec python -m pytest tests/unit "$@"
  fi
  exec python -m pytest "$@"
}

main "$@"
