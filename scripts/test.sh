#!/usr/bin/env bash
# Runs the whole test suite, the same way on a laptop and in CI: sets up .venv, then pytest.
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
  exec python -m pytest "$@"
}

main "$@"
