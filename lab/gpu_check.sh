#!/usr/bin/env bash
# Every GPU figure of issue 27 in one command on a lent GPU machine: lab/benchmark.py gpu, its JSON
# and logs under $OUT, within 8 minutes, on the machine's own python3 and torch (nothing installed
# from the network there; the machine reaches none).
#
# Usage:
#   lab/gpu_check.sh --wheels        here, once (PyPI only): the wheels the GPU image lacks (datasets,
#                                    dill, multiprocess, the versions of .venv) into .whl/ (git-ignored)
#   lab/gpu_check.sh [ARGS...]       on the GPU machine; ARGS go to `lab/benchmark.py gpu`
#                                    (--only PART..., --candidate NAME..., --budget S; default budget 420 s)
#   lab/gpu_check.sh --cpu           the dry path: the CPU mode's tiny model (any machine, ~3 minutes)
#
# Through the device tool, one call: command "lab/gpu_check.sh --budget 480", carry [".whl"], timeout_s 590.
# It writes, under $OUT (a temporary folder when unset): gpu.json (rewritten after each part, so a
# run cut short keeps what it measured), gpu.log (the benchmark's output), runs.log (every trainer's
# output), machine.txt (nvidia-smi, python, torch and the libraries found).
# Without the wheels the fine-tune part's keys are null and say why; the other parts still run.
set -o errexit -o nounset -o pipefail

readonly DEFAULT_BUDGET_S=420  # parts not started by then are skipped (their keys say so)
readonly AFTER_BUDGET_S=50     # the last part's end and the JSON: the benchmark's limit is the budget and this
readonly SITE=/tmp/gpu-check-site
readonly WHEELS=(datasets dill multiprocess)

help() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

pick_python() {
  local root="$1"
  if [[ -n "${PYTHON:-}" ]]; then
    echo "${PYTHON}"
  elif [[ -x "${root}/.venv/bin/python" ]] && "${root}/.venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "${root}/.venv/bin/python"
  else
    echo python3
  fi
}

download_wheels() {
  local root="$1" python pins=() name version
  python=$(pick_python "${root}")
  for name in "${WHEELS[@]}"; do
    version=$("${python}" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "${name}")
    pins+=("${name}==${version}")
  done
  # The GPU image's python is 3.12 (device KINDS.md); all three are pure Python or py312 wheels.
  "${python}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "${root}/.whl" "${pins[@]}"
  echo "gpu_check.sh: ${pins[*]} in ${root}/.whl (carry it: carry [\".whl\"])"
}

install_carried_wheels() {
  local root="$1" python="$2"
  if "${python}" -c 'import datasets' 2>/dev/null || ! compgen -G "${root}/.whl/*.whl" >/dev/null; then
    return 0
  fi
  # A wheel that does not install costs the fine-tune part alone (its keys say why), not the run.
  if ! "${python}" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "${SITE}" "${root}"/.whl/*.whl; then
    echo "gpu_check.sh: the wheels in .whl did not install; the fine-tune part will fail" >&2
    return 0
  fi
  export PYTHONPATH="${SITE}${PYTHONPATH:+:${PYTHONPATH}}"
}

describe_machine() {
  local python="$1"
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 || true; else echo "no nvidia-smi"; fi
  "${python}" - <<'EOF' 2>&1 || true
import importlib.metadata, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "numpy", "pyyaml", "tensorboard", "transformers", "accelerate", "peft", "datasets", "tokenizers"):
    try:
        print(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:  # a missing library is a fact to record here
        print(name, "missing")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
}

# The --budget in ARGS (--budget S or --budget=S, whole seconds), else the default.
budget_of() {
  local budget="${DEFAULT_BUDGET_S}"
  while (($# > 0)); do
    case "$1" in
      --budget) budget="${2:-}"; shift ;;
      --budget=*) budget="${1#--budget=}" ;;
    esac
    shift
  done
  if [[ ! "${budget}" =~ ^[0-9]+$ ]]; then
    echo "gpu_check.sh: --budget takes whole seconds, not '${budget}'" >&2
    exit 64
  fi
  echo "${budget}"
}

run_benchmark() {
  local root="$1" python="$2" out="$3"
  shift 3
  local args=("$@") work="${out}/.work" status=0 budget
  budget=$(budget_of "$@")
  args+=(--budget "${budget}")  # the same value again where ARGS had one: the last one counts
  mkdir -p "${work}"
  BENCH_DIR="${work}" PYTHONUNBUFFERED=1 timeout --signal=TERM --kill-after=15 "$((budget + AFTER_BUDGET_S))" \
    "${python}" "${root}/lab/benchmark.py" gpu --json "${out}/gpu.json" --keep "${args[@]}" \
    2>&1 | tee "${out}/gpu.log" || status=$?
  # Keep the trainers' output (bounded: the tool returns files up to 16 MiB), drop the checkpoints.
  cat "${work}"/bench-gpu-*/runs.log 2>/dev/null | tail -c 15000000 >"${out}/runs.log" || true
  rm -rf "${work}"
  return "${status}"
}

main() {
  if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    help
    return 0
  fi
  local root python out
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [[ "${1:-}" == --wheels ]]; then
    download_wheels "${root}"
    return 0
  fi
  out="${OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}"
  mkdir -p "${out}"
  python=$(pick_python "${root}")
  install_carried_wheels "${root}" "${python}"
  describe_machine "${python}" >"${out}/machine.txt"
  run_benchmark "${root}" "${python}" "${out}" "$@"
  echo "gpu_check.sh: ${out}/gpu.json"
}

main "$@"
