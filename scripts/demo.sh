#!/usr/bin/env bash
# The whole story on one machine, no cluster and no AWS account needed.
#
# Usage:
#   ./scripts/demo.sh              one pod
#   ./scripts/demo.sh --nodes 2    a group of 2 pods (an Indexed Job), 1 process each
#
# Sets up .venv, starts a local S3, makes a small dataset, stages code and data, runs job.yaml's
# pod through the local pod runner, loses the node (SIGKILL to the pod's PID 1) mid-training, runs
# the Job's next pod, which resumes from the newest checkpoint committed in S3 and finishes, then
# shows what S3 holds. With --nodes N: the Indexed Job scripts/submit.py renders, its N pods side by
# side (lab/local_job.py); node 1 is lost, the others exit 138, the whole group resumes from S3.
# Needs root: the local pod runner uses PID and mount namespaces.
set -o errexit -o nounset -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEMO=${ROOT}/demo
RUN_URI=s3://demo/runs/smoke/
S3_PID=""
NODES=1

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { echo "demo.sh: error: $*" >&2; exit 1; }

cleanup() {
  [[ -z "${S3_PID}" ]] || kill "${S3_PID}" 2>/dev/null || true
}

start_local_s3() {
  python "${ROOT}/lab/local_s3.py" --bucket demo --port-file "${DEMO}/s3.port" >"${DEMO}/s3.log" 2>&1 &
  S3_PID=$!
  local tries=0
  until [[ -s "${DEMO}/s3.port" ]]; do
    ((tries++ < 100)) || die "the local S3 did not start; see ${DEMO}/s3.log"
    sleep 0.1
  done
  AWS_ENDPOINT_URL="http://127.0.0.1:$(cat "${DEMO}/s3.port")"
  export AWS_ENDPOINT_URL
  export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo AWS_DEFAULT_REGION=us-east-1
  echo "local S3 at ${AWS_ENDPOINT_URL}"
}

# Real English without a download: the docstrings of Python's own standard library.
make_corpus() {
  python - "${DEMO}/corpus.txt" <<'EOF'
import ast, pathlib, sys, sysconfig
texts = []
for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        continue
    texts += [d for node in ast.walk(tree)
              if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
              and (d := ast.get_docstring(node)) and len(d) > 200]
pathlib.Path(sys.argv[1]).write_text("\n\n".join(texts))
EOF
}

pod_env() {
  local setting
  for setting in S3_CODE_URI=s3://demo/code/ S3_DATA_URI=s3://demo/data/ S3_OUTPUT_URI="${RUN_URI}" \
    AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL}" AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo \
    AWS_DEFAULT_REGION=us-east-1 TRAIN_CONFIG=config/smoke.yaml NPROC_PER_NODE=1 \
    SYNC_INTERVAL_SECONDS=5 LEASE_TTL_SECONDS=10 OMP_NUM_THREADS=1; do
    printf '%s\n' --env "${setting}"
  done
}

pod() {
  local number=$1 env
  mapfile -t env < <(pod_env)
  python "${ROOT}/lab/local_pod.py" --pidfile "${DEMO}/pod-${number}.pid" "${env[@]}" \
    "${ROOT}/job.yaml" 2>&1 | tee "${DEMO}/pod-${number}.log"
}

# The header comment above is the help.
help() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

parse_args() {
  while (($#)); do
    case "$1" in
      -h | --help) help; exit 0 ;;
      --nodes)
        [[ "${2:-}" =~ ^[1-9]$ ]] || die "--nodes takes a number of pods from 1 to 9, e.g. --nodes 2"
        NODES=$2
        shift 2
        ;;
      *) die "unknown argument $1; usage: demo.sh [--nodes N]" ;;
    esac
  done
}

one_pod() {
  say "pod 1: trains, and its node is lost once step 100 is committed in S3"
  pod 1 &
  local first=$!
  wait_for_event "${DEMO}/pod-1.log" 1800 uploaded step=100 >/dev/null
  sleep 2
  kill -KILL "$(cat "${DEMO}/pod-1.pid")"
  wait "${first}" || true
  say "node lost (SIGKILL to the pod's PID 1). S3 holds these committed checkpoints:"
  aws s3 ls --recursive "${RUN_URI}checkpoints/" | grep manifest.json

  say "pod 2: the Job's next pod (it waits out the dead pod's lease, then resumes)"
  pod 2
  say "pod 2 restored: $(wait_for_event "${DEMO}/pod-2.log" 0 restore)"
}

# The Indexed Job a user would apply; its pods run side by side, each on its own 127.0.0.x address.
group_of_pods() {
  local env
  say "a group of ${NODES} pods: the Indexed Job that scripts/submit.py renders"
  python "${ROOT}/scripts/submit.py" demo --image local --code s3://demo/code/ --data s3://demo/data/ \
    --output "${RUN_URI}" --engine indexed --nodes "${NODES}" --gpus-per-node 1 >"${DEMO}/group.yaml"
  echo "manifests in ${DEMO}/group.yaml; node 0 takes the lease and uploads, every node trains"
  mapfile -t env < <(pod_env)
  python "${ROOT}/lab/demo_group.py" "${DEMO}/group.yaml" "${DEMO}" "${env[@]}" --kill-at 100 --kill-index 1 ||
    die "the group did not finish; see ${DEMO}/pod-*.log"
}

# Waits for one of the pod's events (job/contract.py), printed as JSON; dies after SECONDS (a pod
# that failed never says it).   wait_for_event FILE SECONDS KIND [key=value...]
wait_for_event() {
  python "${ROOT}/job/contract.py" wait "$@" || die "gave up waiting; see $1"
}

main() {
  parse_args "$@"
  [[ "$(id -u)" -eq 0 ]] || die "the local pod runner needs root (PID and mount namespaces); run: sudo ./scripts/demo.sh"
  # shellcheck source=scripts/lib/venv.sh
  source "${ROOT}/scripts/lib/venv.sh"
  ensure_venv "${ROOT}"
  export PATH="${ROOT}/.venv/bin:${PATH}"
  rm -rf "${DEMO}"
  mkdir -p "${DEMO}"
  trap cleanup EXIT

  say "a local S3"
  start_local_s3

  say "a small dataset (byte-level tokens of Python's docstrings)"
  make_corpus
  python "${ROOT}/scripts/prepare_data.py" --input "${DEMO}/corpus.txt" --out "${DEMO}/data"

  say "staging code and data"
  "${ROOT}/scripts/stage.sh" s3://demo/code/ --data "${DEMO}/data" s3://demo/data/

  if ((NODES == 1)); then
    one_pod
  else
    group_of_pods
  fi

  say "what S3 holds"
  aws s3 ls --recursive "${RUN_URI}"
  echo
  aws s3 cp --quiet "${RUN_URI}COMPLETE" - && echo
  aws s3 sync --quiet "${RUN_URI}" "${DEMO}/outputs/"
  say "outputs copied to ${DEMO}/outputs/ (the local S3 stops with this script)"
  echo "TensorBoard: .venv/bin/tensorboard --logdir ${DEMO}/outputs/tensorboard"
  echo "From S3, while a run trains: AWS_ENDPOINT_URL=... scripts/tensorboard.sh ${RUN_URI}"
}

main "$@"
