#!/usr/bin/env bash
# The whole story on one machine, no cluster and no AWS account needed.
#
# Usage:
#   ./scripts/demo.sh              one pod
#   ./scripts/demo.sh --nodes 2    a group of 2 pods (an Indexed Job), 1 process each
#   ./scripts/demo.sh --keep       then leave the local S3 up, for status.py and TensorBoard on the run
#
# Sets up .venv, starts a local S3, makes a small dataset, stages code and data, runs job.yaml's
# pod through the local pod runner, loses the node (SIGKILL to the pod's PID 1) once step 100 is
# in S3, runs the Job's next pod, which resumes from the newest checkpoint committed in S3 and
# finishes, then shows what S3 holds and says what happened. With --nodes N: the Indexed Job
# scripts/submit.py renders, its N pods side by side (lab/local_job.py); node 1 is lost, the others
# exit 138, the whole group resumes from S3. Needs root: the local pod runner uses PID and mount
# namespaces.
#
# A pod that fails ends the demo at once with the pod's last error line (exit 1); a bad flag exits 64. The pods' output
# is shown as `kubectl logs` shows it; each pod's whole log, with the EVENT lines the demo waits
# on, is in DIR/pod-N.log.
#
# Options:
#   --keep               leave the local S3 running at the end (its PID and the commands to use it
#                        are printed); stop it with kill PID
#   --dir DIR            where the demo works (default: demo/ in the repository; emptied first)
#   --train-args ARGS    TRAIN_ARGS for the pods, e.g. "--set train.max_steps=40" (with --kill-at)
#   --kill-at STEP       the node is lost once this step is in S3 (default 100: config/smoke.yaml
#                        commits every 50 steps)
set -o errexit -o nounset -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly ROOT
DEMO=${ROOT}/demo
RUN_URI=s3://demo/runs/smoke/
S3_PID=""
NODES=1
KEEP=0
TRAIN_ARGS_FOR_PODS=""
KILL_AT=100

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { echo "demo.sh: error: $*" >&2; exit 1; }
bad_input() { echo "demo.sh: error: $*" >&2; exit 64; }  # a flag, or no root: no retry passes

# The header comment above is the help.
help() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

cleanup() {
  [[ -n "${S3_PID}" ]] || return 0
  if ((KEEP)); then
    tour
  else
    kill "${S3_PID}" 2>/dev/null || true
  fi
}

start_local_s3() {
  python "${ROOT}/lab/local_s3.py" --bucket demo --port-file "${DEMO}/s3.port" >"${DEMO}/s3.log" 2>&1 &
  S3_PID=$!
  echo "${S3_PID}" >"${DEMO}/s3.pid"
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

# --keep: what to type for a tour of the run while the local S3 stays up.
tour() {
  say "the local S3 stays up (pid ${S3_PID}) for a tour of the run; in your shell:"
  cat <<EOF
  export PATH="${ROOT}/.venv/bin:\${PATH}" AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL} AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo AWS_DEFAULT_REGION=us-east-1
  ${ROOT}/scripts/status.py s3://demo/runs/
  ${ROOT}/scripts/status.py ${RUN_URI}
  ${ROOT}/scripts/status.py --logs ${RUN_URI}
  ${ROOT}/scripts/tensorboard.sh ${RUN_URI}      # then open http://127.0.0.1:6006
  kill ${S3_PID}      # when done: the local S3 and everything in it go
EOF
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

# EVENTS=stdout: the demo waits on the pods' events, so they are in its copy of their output.
pod_env() {
  local setting
  for setting in S3_CODE_URI=s3://demo/code/ S3_DATA_URI=s3://demo/data/ S3_OUTPUT_URI="${RUN_URI}" \
    AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL}" AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo \
    AWS_DEFAULT_REGION=us-east-1 TRAIN_CONFIG=config/smoke.yaml NPROC_PER_NODE=1 \
    SYNC_INTERVAL_SECONDS=5 LEASE_TTL_SECONDS=10 OMP_NUM_THREADS=1 EVENTS=stdout \
    TRAIN_ARGS="${TRAIN_ARGS_FOR_PODS}"; do
    printf '%s\n' --env "${setting}"
  done
}

# The pod's whole output in DIR/pod-N.log; on the screen, what `kubectl logs` would show.
pod() {
  local number=$1 env
  mapfile -t env < <(pod_env)
  python "${ROOT}/lab/local_pod.py" --pidfile "${DEMO}/pod-${number}.pid" "${env[@]}" \
    "${ROOT}/job.yaml" 2>&1 | tee "${DEMO}/pod-${number}.log" | sed -u '/^EVENT /d'
}

# The line that says why a pod failed: its last error, else its last line.
last_error_line() {
  local lines
  lines=$(grep -v '^EVENT ' "$1" || true)
  grep -i 'error' <<<"${lines}" | tail -n 1 | grep . || tail -n 1 <<<"${lines}"
}

pod_failed() {
  local number=$1 code=$2
  die "pod ${number} failed (exit ${code}): $(last_error_line "${DEMO}/pod-${number}.log")
  (its whole log: ${DEMO}/pod-${number}.log)"
}

parse_args() {
  while (($#)); do
    case "$1" in
      -h | --help) help; exit 0 ;;
      --nodes)
        [[ "${2:-}" =~ ^[1-9]$ ]] || bad_input "--nodes takes a number of pods from 1 to 9, e.g. --nodes 2"
        NODES=$2
        shift 2
        ;;
      --keep) KEEP=1; shift ;;
      --dir)
        [[ -n "${2:-}" ]] || bad_input "--dir takes a folder, e.g. --dir /tmp/demo"
        DEMO=$(realpath -m "$2")
        shift 2
        ;;
      --train-args) (($# >= 2)) || bad_input "--train-args takes the pods' TRAIN_ARGS"; TRAIN_ARGS_FOR_PODS=$2; shift 2 ;;
      --kill-at)
        [[ "${2:-}" =~ ^[1-9][0-9]{0,6}$ ]] || bad_input "--kill-at takes a step, e.g. --kill-at 100"
        KILL_AT=$2
        shift 2
        ;;
      *) bad_input "unknown argument $1; usage: demo.sh [--nodes N] [--keep] [--dir DIR] [--train-args ARGS] [--kill-at STEP] (--help says more)" ;;
    esac
  done
}

# Waits for one of pod 1's events (job/contract.py) while the pod runs: a pod that ended without
# it (it failed) ends the demo at once, with its last error line.
wait_for_pod_event() {
  local pid=$1 kind=$2; shift 2
  python "${ROOT}/job/contract.py" wait --pid "${pid}" "${DEMO}/pod-1.log" 3600 "${kind}" "$@" &>/dev/null && return 0
  local code=0
  wait "${pid}" || code=$?
  pod_failed 1 "${code}"
}

one_pod() {
  say "pod 1: trains, and its node is lost once step ${KILL_AT} is committed in S3"
  pod 1 &
  local first=$!
  wait_for_pod_event "${first}" uploaded step="${KILL_AT}"
  sleep 2
  kill -KILL "$(cat "${DEMO}/pod-1.pid")" 2>/dev/null ||
    die "pod 1 finished before its node could be lost; give it more steps past --kill-at ${KILL_AT} (--train-args)"
  wait "${first}" || true
  say "node lost (SIGKILL to the pod's PID 1). S3 holds these committed checkpoints:"
  aws s3 ls --recursive "${RUN_URI}checkpoints/" | grep manifest.json

  say "pod 2: the Job's next pod (it waits out the dead pod's lease, then resumes)"
  local code=0
  pod 2 || code=$?
  ((code == 0)) || pod_failed 2 "${code}"
}

# The Indexed Job a user would apply; its pods run side by side, each on its own 127.0.0.x address.
group_of_pods() {
  local env
  say "a group of ${NODES} pods: the Indexed Job that scripts/submit.py renders"
  python "${ROOT}/scripts/submit.py" demo --image local --code s3://demo/code/ --data s3://demo/data/ \
    --output "${RUN_URI}" --engine indexed --nodes "${NODES}" --gpus-per-node 1 >"${DEMO}/group.yaml"
  echo "manifests in ${DEMO}/group.yaml; node 0 takes the lease and uploads, every node trains"
  mapfile -t env < <(pod_env)
  python "${ROOT}/lab/demo_group.py" "${DEMO}/group.yaml" "${DEMO}" "${env[@]}" --kill-at "${KILL_AT}" --kill-index 1 ||
    die "the group did not finish; see ${DEMO}/pod-*.log"
}

# A few plain sentences from what S3 holds (COMPLETE) and the pods' events.
what_happened() {
  python - "${DEMO}" "${ROOT}/job" "${NODES}" "${KILL_AT}" <<'EOF'
import json, pathlib, sys
demo, job, nodes, kill_at = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, job)
import contract

def events(log, kind):
    return [e for e in map(contract.parse_event, log.read_text(errors="replace").splitlines()) if e and e["event"] == kind]

complete = json.loads((demo / "outputs" / "COMPLETE").read_text())
uploaded = sorted({e["step"] for log in demo.glob("pod-*.log") for e in events(log, "uploaded")
                   if isinstance(e.get("step"), int)})
if nodes == 1:
    restored = [e["name"] for e in events(demo / "pod-2.log", "restore")]
    print("Pod 1 trained from step 0, and each checkpoint it committed went to S3 within seconds.")
    print(f"Once step {kill_at} was in S3, its node was lost: SIGKILL, nothing saved on the way out, as when "
          "a machine dies.")
    print(f"The Job's next pod waited out the lost pod's lease, restored {restored[-1] if restored else 'nothing'} "
          f"(the newest checkpoint committed in S3) and trained on to step {complete['steps']}, with the same "
          "command as the first.")
else:
    later = sorted(demo.glob("pod-*-*.log"))
    again = [log for log in later if not log.stem.endswith("-1")]
    restored = {e["name"] for log in again for e in events(log, "restore") if e.get("name")}
    print(f"A group of {nodes} pods trained from step 0; node 0 put each committed checkpoint in S3.")
    print(f"Once step {kill_at} was in S3, the node of pod 1 was lost (SIGKILL). The Job ran {len(later)} pods in "
          f"all ({len(again)} replacement{'s' if len(again) != 1 else ''})"
          + (f"; the group resumed from {', '.join(sorted(restored))}." if restored else
             "; none had to resume from S3 (training had reached its last step)."))
best = complete.get("best_val_loss")
attempts = complete["attempts"]
print(f"S3 got the checkpoints of steps {', '.join(map(str, uploaded))}; COMPLETE says {complete['steps']} steps "
      f"in {attempts} attempt{'s' if attempts != 1 else ''}{' of node 0' if nodes > 1 else ''}, "
      f"{complete['wall_seconds']:.0f} s of pod time"
      + (f", best validation loss {best:.4f} at step {complete['best_step']}." if best is not None else "."))
EOF
}

main() {
  parse_args "$@"
  [[ "$(id -u)" -eq 0 ]] || bad_input "the local pod runner needs root (PID and mount namespaces); run: sudo ./scripts/demo.sh"
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
  echo "(a copy in ${DEMO}/outputs/; TensorBoard on it: ${ROOT}/.venv/bin/tensorboard --logdir ${DEMO}/outputs/tensorboard)"

  say "what happened"
  what_happened
  ((KEEP)) || echo "The local S3 stops with this script (--keep leaves it up for status.py and TensorBoard)."
}

main "$@"
