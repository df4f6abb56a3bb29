#!/usr/bin/env bash
# The training pod's entrypoint (PID 1), shipped in the ConfigMap made from job/.
#
# Brings code, data and the newest committed checkpoint from S3, trains with torchrun on the
# pod's GPUs, puts each committed checkpoint in S3 within seconds, and on any exit uploads what is
# left. The command is the same for every pod of the Job: what is in S3 decides where it resumes.
#
# Settings (environment), each checked before anything else (exit 64, one line; empty = default):
#   S3_CODE_URI, S3_DATA_URI, S3_OUTPUT_URI   required, s3://bucket/prefix/ (must not overlap)
#   WORK_DIR               /home/eai_role/code      absolute; code here, data in WORK_DIR/data, outputs in WORK_DIR/out
#   NPROC_PER_NODE         the visible GPUs, else 1 positive, at most the GPUs the pod sees
#   TRAIN_SCRIPT           train.py                 the script torchrun runs, relative to the code (e.g. finetune.py)
#   TRAIN_CONFIG           config/conf.yaml         relative to the code (config/finetune.yaml for finetune.py)
#   S3_MODEL_URI           unset                    s3://bucket/prefix/ of a model snapshot (config.json, weights,
#                                                   tokenizer): synced to WORK_DIR/model, passed as --model_dir
#   TRAIN_ARGS             extra train.py arguments, e.g. "--set train.max_steps=2000"; split as a
#                          shell splits words (quotes group, newlines separate), nothing evaluated
#   SYNC_INTERVAL_SECONDS  60                       TensorBoard, log and status uploads (>= 1)
#   UPLOAD_RETRY_SECONDS   30                       one round of the uploader's retries (>= 1)
#   READY_FILE             /tmp/ready               absolute; touched once restored (startup probe)
#   HEALTH_FILE            /tmp/healthy             absolute; heartbeat (liveness probe)
#   HEALTH_MAX_AGE_SECONDS 600                      liveness fails past this heartbeat age (>= 10; the trainer must beat more often)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT 180              after SIGTERM, how long torchrun lets the trainer save before its
#                                                   SIGKILL (>= 1; on every torch: job/torchrun.py); keep it under the
#                                                   pod's grace period, which also holds the final upload
#   AWS_ENDPOINT_URL       an S3-compatible store (http:// or https://); every S3 call honours it
#   AWS_MAX_ATTEMPTS       5                        the AWS CLI's and s5cmd's attempts per request (>= 1; boto3 has its own)
#   AWS_RETRY_MODE         standard                 the AWS CLI's: standard, adaptive or legacy
#   S3_RETRY_SECONDS       600                      how long S3 errors are retried before giving up (>= 1)
#   S3_LEASE               on                       on or off: off runs without the lease (one pod per prefix is then yours to ensure)
#   LEASE_TTL_SECONDS      30                       a dead pod's lease expires after this (>= 3: renewed every third)
#   LEASE_WAIT_SECONDS     3000                     how long a second pod waits for a live pod's lease (>= 0)
#   S3_SYNC_TOOL           auto                     access check and sync: s5cmd when present, else aws
#   CHECKPOINT_HMAC_KEY    unset                    signs and checks manifests; when set, 16 bytes or more (never printed)
#   EVENTS                 log                      log or stdout: the EVENT lines tools read are in the pod's log file and
#                                                   its copy in S3; stdout puts them in `kubectl logs` too
#   NNODES                 1                        pods in the group (scripts/submit.py sets it with the three below)
#   RDZV_ENDPOINT          MASTER_ADDR:MASTER_PORT  host:port of node 0's c10d rendezvous (NNODES > 1); node 0 also
#                                                   tells the others on port+1 which checkpoint they all resume from
#   RDZV_TIMEOUT_SECONDS   900                      how long a node waits for the others to be there (>= 10)
#   GROUP_SECRET           unset                    NNODES > 1: signs every question to node 0 and its answer, the
#                                                   same in every pod (16 bytes or more, never printed; submit.py
#                                                   makes it a Secret); unset: derived from CHECKPOINT_HMAC_KEY,
#                                                   and with neither a group is refused (64)
# The node rank (NNODES > 1): JOB_COMPLETION_INDEX (Indexed Job, JobSet), else PET_NODE_RANK, else
# RANK (PyTorchJob). Node 0 alone takes the lease, uploads and writes COMPLETE; every node restores
# the step node 0 chose. A node that loses a peer mid-run exits 138 so the whole group restarts; so
# does one stopped by a peer's SIGTERM (after the group committed its step; that peer exits 143).
# No value may hold a control character (TRAIN_ARGS: newlines and tabs separate words); a name in the
# env that is no setting but close to one (TRAIN_ARG) gets a warning with "did you mean" (job/contract.py).
# The shipped trainers (train.py, finetune.py) check TRAIN_CONFIG and TRAIN_ARGS (`--check`, without
# torch) right after the code and the Python are there, before the data, the lease and the GPUs.
# Read as they are: AWS credentials and AWS_DEFAULT_REGION (the Secret or an IAM role), HOSTNAME
# (the pod's name in logs and the lease), PIP_* (pip), PYTHONPATH (the runtime's folder is added).
# Set here for the helpers: CODE_DIR, STATE_DIR, LOG_FILE, TORCHELASTIC_ERROR_FILE, PYTHONUNBUFFERED,
# TMPDIR (WORK_DIR/.tmp: torch's compile files and other temp files on the workspace, not the small /tmp).
# RESTORE_VERIFIED_FILE (STATE_DIR/restore-verified-<pod>.json: the checkpoint restore.py just hashed).
# The pod's last error line goes to STATE_DIR/last-error.txt, for the uploader's status.json.
# Everything printed, and the log uploaded to S3, has URL credentials hidden (redact.sed).
#
# Exit codes: 0 done (COMPLETE written), 64 bad input (the Job must not retry), 75 S3 or the
# package index unreachable, or the group never met (a retry may pass), 138 a peer of the group
# was lost or stopped (the Job restarts the group, uncounted), 143 after SIGTERM (130 SIGINT), else
# the trainer's.
# job/contract.py is the contract: these codes and who decides each, the files a trainer shares with
# the runtime, and the EVENT lines (event below) that tools read instead of the prose.
# shellcheck disable=SC2329 # most functions run indirectly: through phase, traps and run_child
set -o errexit -o nounset -o pipefail -o errtrace

# The contract's exit codes (job/contract.py says who decides each; tests/unit/test_contract.py
# keeps these equal to it).
readonly EXIT_DONE=0
readonly EXIT_BAD_INPUT=64
readonly EXIT_UNAVAILABLE=75
readonly EXIT_COMPLETE_FOUND=3
readonly EXIT_PEER_LOST=138
readonly EXIT_SIGINT=130
readonly EXIT_SIGTERM=143
readonly EXIT_USAGE=2
# Every setting's name (contract.SETTINGS; tests/unit/test_contract.py keeps them equal), and those
# a controller sets (contract.CONTROLLER_SETTINGS): all are checked for control characters.
readonly SETTINGS=(S3_CODE_URI S3_DATA_URI S3_OUTPUT_URI S3_MODEL_URI WORK_DIR NPROC_PER_NODE
  TRAIN_SCRIPT TRAIN_CONFIG TRAIN_ARGS SYNC_INTERVAL_SECONDS UPLOAD_RETRY_SECONDS
  READY_FILE HEALTH_FILE HEALTH_MAX_AGE_SECONDS TORCH_ELASTIC_SHUTDOWN_TIMEOUT AWS_ENDPOINT_URL
  AWS_MAX_ATTEMPTS AWS_RETRY_MODE S3_RETRY_SECONDS S3_LEASE LEASE_TTL_SECONDS LEASE_WAIT_SECONDS
  S3_SYNC_TOOL CHECKPOINT_HMAC_KEY EVENTS NNODES RDZV_ENDPOINT RDZV_TIMEOUT_SECONDS GROUP_SECRET)
readonly CONTROLLER_SETTINGS=(JOB_COMPLETION_INDEX PET_NODE_RANK RANK MASTER_ADDR MASTER_PORT)
readonly POD_ERROR=last-error.txt  # contract.POD_ERROR
# lease.py acquire writes this file in STATE_DIR once it holds the lease (contract.LEASE_STATE):
# its presence is how this script knows, even when lease.py was stopped before it could say so.
readonly LEASE_STATE=lease.json
JOB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly JOB_DIR

STOP_SIGNAL=""
SIGNALS_SEEN=0
CHILD_PID=""
TRAINER_PID=""
TRAINER_RELEASED=0  # past the gate: the trainer runs, a signal makes it commit its step
UPLOADER_PID=""
UPLOADER_RESTARTED=0
UPLOADER_GAVE_UP=0  # the exit code the pod ends with once the uploader died twice
HEARTBEAT_PID=""
TEE_PID=""
GROUP_SERVER_PID=""
RESTORE_STEP=""
NODE0_GONE_SECONDS=30  # node 0 silent this long after training: it died in its final upload
LEASE_HELD=0
COMPLETE_FOUND=0
PYTHON=python3
STARTED_MS=$(date +%s%3N)
POD_TOKEN=${RANDOM}${RANDOM}-${STARTED_MS}  # this pod, to node 0: a replacement of a node has another

# log, warn, die: one line each whatever they quote (lib.sh); die also leaves its line for status.json.
LOG_NAME=script
DIE_HOOK=remember_error
# shellcheck source=job/lib.sh
source "${JOB_DIR}/lib.sh"
# The pod's last error line, for status.json (uploader.py final): one line, credentials hidden.
remember_error() {
  [[ -n "${STATE_DIR:-}" && -d "${STATE_DIR}" ]] || return 0
  shown "$*" >"${STATE_DIR}/${POD_ERROR}" 2>/dev/null || true
}
need_cmd() { command -v "$1" >/dev/null 2>&1 || die "${EXIT_BAD_INPUT}" "$1 not found in the image; $2"; }
elapsed_since() { local ms=$(($(date +%s%3N) - $1)); printf '%d.%01ds' $((ms / 1000)) $((ms % 1000 / 100)); }
seconds_since() { local ms=$(($(date +%s%3N) - $1)); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }

# One event line, the format job/contract.py defines (EVENT_PREFIX, then a JSON object): what tools
# wait on and parse, never the prose lines around it.   event KIND [key=value...]
# A value that is a plain number stays a number, anything else becomes a JSON string.
event() {
  local kind=$1 json pair key value
  shift
  json="{\"event\": \"${kind}\", \"source\": \"script\", \"time\": $(date +%s.%3N)"
  for pair in "$@"; do
    key=${pair%%=*}
    value=${pair#*=}
    if [[ "${value}" =~ ^(0|-?[1-9][0-9]*)(\.[0-9]+)?$ ]]; then
      json+=", \"${key}\": ${value}"
    else
      value=${value//\\/\\\\}
      value=${value//\"/\\\"}
      json+=", \"${key}\": \"${value//[[:cntrl:]]/ }\""
    fi
  done
  printf 'EVENT %s}\n' "${json}"
}

# Runs a step and logs how long it took, so the cost of every restart is visible.
phase() {
  local name=$1; shift
  local started
  stop_if_asked
  started=$(date +%s%3N)
  log "${name}..."
  event phase name="${name}" state=start
  "$@"
  log "${name}: done in $(elapsed_since "${started}")"
  event phase name="${name}" state=done seconds="$(seconds_since "${started}")"
}

# A failed child has said why already; only what fails unexpectedly gets a line here.
on_error() {
  [[ "$2" == return* ]] || log "error: ${BASH_SOURCE[1]}:$1: '$2' failed" >&2
}

# -- signals and children ---------------------------------------------------------------------

# bash as PID 1 passes no signal on by itself: forward it so the trainer can save its step.
on_signal() {
  local sig=$1
  SIGNALS_SEEN=$((SIGNALS_SEEN + 1))
  [[ -z "${STOP_SIGNAL}" ]] || return 0
  STOP_SIGNAL=${sig}
  if [[ -n "${TRAINER_PID}" ]] && ((TRAINER_RELEASED)); then
    log "got SIG${sig}: the trainer finishes its step and commits it"
    kill -s "${sig}" "${TRAINER_PID}" 2>/dev/null || true
    return 0
  fi
  log "got SIG${sig} while setting up: stopping"
  [[ -z "${CHILD_PID}" ]] || kill -s TERM "${CHILD_PID}" 2>/dev/null || true
  # Still at the gate (job/preload.py): nothing to commit yet.
  [[ -z "${TRAINER_PID}" ]] || kill -s TERM "${TRAINER_PID}" 2>/dev/null || true
}

signal_exit_code() { [[ "${STOP_SIGNAL}" == INT ]] && echo "${EXIT_SIGINT}" || echo "${EXIT_SIGTERM}"; }

# A signal that came while no child ran to receive it still stops the pod.
stop_if_asked() {
  [[ -z "${STOP_SIGNAL}" ]] || exit "$(signal_exit_code)"
}

# `wait` returns early when a trapped signal arrives; the child may still be running then.
wait_for() {
  local pid=$1 code seen
  while true; do
    seen=${SIGNALS_SEEN}
    code=0
    wait "${pid}" || code=$?
    ((SIGNALS_SEEN != seen)) || return "${code}"
    if ! kill -0 "${pid}" 2>/dev/null; then
      local again=0
      wait "${pid}" 2>/dev/null || again=$?
      ((again == 127)) && return "${code}"
      return "${again}"
    fi
  done
}

# Runs a setup command as a child so SIGTERM is handled at once, not after it finishes.
#   run_child [--output FILE] command...   (FILE takes its stdout and stderr)
# The redirection is the child's own: an exit from a function under a redirection would run the
# EXIT trap with that redirection still in place.
run_child() {
  local output=/dev/stdout
  if [[ "$1" == --output ]]; then
    output=$2
    shift 2
  fi
  if [[ "${output}" == /dev/stdout ]]; then
    "$@" &
  else
    "$@" >"${output}" 2>&1 &
  fi
  CHILD_PID=$!
  [[ -z "${STOP_SIGNAL}" ]] || kill -s TERM "${CHILD_PID}" 2>/dev/null || true  # came before $!
  local code=0
  wait_for "${CHILD_PID}" || code=$?
  CHILD_PID=""
  stop_if_asked
  return "${code}"
}

start_heartbeat() {
  [[ -z "${HEARTBEAT_PID}" ]] || return 0
  # The sleep not on the log's pipe: killed, the loop leaves it behind, and it would hold the pipe
  # open, and the pod's last wait for tee (finish) with it, for up to 5 s after every exit.
  (while true; do touch "${HEALTH_FILE}"; sleep 5 >/dev/null 2>&1; done) &
  HEARTBEAT_PID=$!
}

stop_heartbeat() {
  [[ -n "${HEARTBEAT_PID}" ]] || return 0
  kill -KILL "${HEARTBEAT_PID}" 2>/dev/null || true  # it may have inherited an ignored TERM
  wait "${HEARTBEAT_PID}" 2>/dev/null || true
  HEARTBEAT_PID=""
}

# -- settings ---------------------------------------------------------------------------------

# A value as one line with any URL's credentials hidden: it goes into a line that is printed.
shown() { printf '%s' "$1" | tr '\n' ' ' | LC_ALL=C sed -E -f "${JOB_DIR}/redact.sed"; }

node0() { ((NODE_RANK == 0)); }

# The settings' checks (validate_settings): settings.sh, beside this file.
# shellcheck source=job/settings.sh
source "${JOB_DIR}/settings.sh"

# -- S3 through the AWS CLI (s5cmd when the image has it) --------------------------------------

bucket_of() { local rest=${1#s3://}; echo "${rest%%/*}"; }

# One line for errors no retry fixes, from the one table (job/s3_errors.py); nothing for the rest.
# The image's python3, as the pod's Python is not chosen yet; a python3 that cannot run it leaves
# every error to the retries (then exit 75 with the CLI's own last line).
permanent_s3_error() {
  python3 "${JOB_DIR}/s3_errors.py" explain-cli "$2" <<<"$1" 2>/dev/null || true
}

# Retries transient S3 errors with exponential backoff and jitter for up to S3_RETRY_SECONDS.
#   s3_retry [--output FILE] URI command...   (FILE keeps the last try's output for the caller)
s3_retry() {
  local output="${STATE_DIR}/s3-command.out"
  if [[ "$1" == --output ]]; then
    output=$2
    shift 2
  fi
  local uri=$1; shift
  local started=${SECONDS} delay=2 attempt=1
  local deadline=$((SECONDS + S3_RETRY_SECONDS))
  while true; do
    if run_child --output "${output}" "$@"; then
      return 0
    fi
    local text reason
    text=$(tail -c 2000 "${output}")
    reason=$(permanent_s3_error "${text}" "${uri}")
    [[ -z "${reason}" ]] || die "${EXIT_BAD_INPUT}" "${reason}"
    if ((SECONDS >= deadline)); then
      die "${EXIT_UNAVAILABLE}" "S3 still failing after $((SECONDS - started))s of retries (S3_RETRY_SECONDS=${S3_RETRY_SECONDS}) for ${uri}: $(tail -n 1 <<<"${text}")"
    fi
    delay=$((delay > deadline - SECONDS ? deadline - SECONDS : delay))
    warn "S3 failed for ${uri} (try ${attempt}: $(tail -n 1 <<<"${text}")); again in ${delay}s"
    run_child sleep "${delay}"  # a child, so a SIGTERM during the wait stops the pod at once
    attempt=$((attempt + 1))
    delay=$((delay * 2 > 60 ? 60 : delay * 2 + RANDOM % 3))
  done
}

# s5cmd with as many attempts per request as the AWS CLI gets (AWS_MAX_ATTEMPTS): its own default
# (10 retries) backs off for minutes in an outage, past S3_RETRY_SECONDS, which s3_retry checks
# between calls. It reads its endpoint from S3_ENDPOINT_URL, not AWS_ENDPOINT_URL.
s5cmd_bounded() {
  S3_ENDPOINT_URL=${AWS_ENDPOINT_URL:-} s5cmd --retry-count "$((AWS_MAX_ATTEMPTS - 1))" "$@"
}

s3_sync_down() {
  local uri=$1 dest=$2
  if [[ "${S3_SYNC_TOOL}" == s5cmd ]]; then
    s3_retry "${uri}" s5cmd_bounded --log error sync "${uri}*" "${dest}/"
  else
    s3_retry "${uri}" aws s3 sync --only-show-errors "${uri}" "${dest}"
  fi
}

# Files and bytes under a folder; the code folder (WORK_DIR) holds the pod's own folders too.
folder_size() {
  local dir=${1%/}
  find "${dir}" \( -path "${dir}/data" -o -path "${dir}/out" -o -path "${dir}/model" -o -path "${dir}/.pod" \
    -o -path "${dir}/.tmp" -o -path "${dir}/.venv-*" \) \
    -prune -o -type f -printf '%s\n' | awk '{n++; b+=$1} END {printf "%d %d\n", n, b}'
}

sync_down() {
  local what=$1 uri=$2 dest=$3 started before after files bytes ms
  started=$(date +%s%3N)
  before=$(folder_size "${dest}")
  s3_sync_down "${uri}" "${dest}"
  after=$(folder_size "${dest}")
  files=${after% *}
  bytes=$((${after#* } - ${before#* }))
  ms=$(($(date +%s%3N) - started + 1))
  log "${what}: ${files} files in ${dest}, $(awk -v b="${bytes}" -v ms="${ms}" 'BEGIN {printf "%.1f MB fetched at %.1f MB/s", b/1e6, b/1e3/ms}')"
}

# Each bucket once, with one listing: S3's answer also tells a missing bucket from refused
# credentials. The output bucket's listing is of the run's COMPLETE, so it answers both questions;
# another bucket's, of a COMPLETE under its URI (none is expected there). With s5cmd this costs
# ~0.1 s of every restart, the AWS CLI's start ~0.6 s.
check_access() {
  local uri bucket checked=" " output_bucket listed listing="${STATE_DIR}/complete-check.out"
  output_bucket=$(bucket_of "${S3_OUTPUT_URI}")
  # shellcheck disable=SC2153 # set by the Job, checked by check_s3_uri
  local uris=("${S3_CODE_URI}" "${S3_DATA_URI}")
  [[ -z "${S3_MODEL_URI:-}" ]] || uris+=("${S3_MODEL_URI}")
  for uri in "${uris[@]}" "${S3_OUTPUT_URI}"; do
    bucket=$(bucket_of "${uri}")
    [[ "${checked}" != *" ${bucket} "* ]] || continue
    listed=${uri}
    [[ "${bucket}" != "${output_bucket}" ]] || listed=${S3_OUTPUT_URI}
    s3_retry --output "${listing}" "${uri}" list_complete "${listed}COMPLETE"
    if [[ "${listed}" == "${S3_OUTPUT_URI}" ]] && grep -qxF -- "${listed}COMPLETE" "${listing}"; then
      COMPLETE_FOUND=1
    fi
    checked+="${bucket} "
  done
}

# Lists the keys under the prefix s3://BUCKET/KEY as full URIs, one a line: KEY among them when it
# exists (the AWS CLI lists only the first, which is KEY then: keys sort by bytes). Exits non-zero
# on an S3 error, with the tool's text for s3_retry.
list_complete() {
  local bucket=${1#s3://}
  bucket=${bucket%%/*}
  if [[ "${S3_SYNC_TOOL}" == aws ]]; then
    local first
    first=$(aws s3api list-objects-v2 --bucket "${bucket}" --prefix "${1#s3://"${bucket}"/}" --max-keys 1 \
      --query 'Contents[0].Key' --output text) || return
    printf 's3://%s/%s\n' "${bucket}" "${first}"
    return
  fi
  # s5cmd exits 1 for a prefix with nothing under it too, with this one line (the URI quoted by Go).
  local out
  out=$(s5cmd_bounded ls --show-fullpath "$1" 2>&1) && { printf '%s\n' "${out}"; return; }
  printf '%s\n' "${out}"
  [[ "${out}" != *$'\n'* && "${out}" == 'ERROR "ls --show-fullpath=true '*'": no object found' ]]
}

# With CHECKPOINT_HMAC_KEY set, only a COMPLETE signed for this run ends it: lease.py judges that
# with the pod's Python (node 0 then tells the others), so here it is only a hint.
already_complete() {
  ((COMPLETE_FOUND)) || return 1
  [[ -n "${CHECKPOINT_HMAC_KEY:-}" ]] || return 0
  log "${S3_OUTPUT_URI}COMPLETE exists; CHECKPOINT_HMAC_KEY is set, so its signature decides (checked with the lease)"
  return 1
}

# -- the phases ---------------------------------------------------------------------------------

sync_code() {
  sync_down "code" "${S3_CODE_URI}" "${CODE_DIR}"
  [[ -f "${CODE_DIR}/${TRAIN_SCRIPT}" ]] ||
    die "${EXIT_BAD_INPUT}" "${S3_CODE_URI} holds no ${TRAIN_SCRIPT}; upload the code with scripts/stage.sh ${S3_CODE_URI} or fix TRAIN_SCRIPT"
  [[ -f "${CODE_DIR}/${TRAIN_CONFIG}" ]] ||
    die "${EXIT_BAD_INPUT}" "TRAIN_CONFIG=${TRAIN_CONFIG} is not in ${S3_CODE_URI}; upload it or fix TRAIN_CONFIG"
  warn_runtime_modules_shadowed
}

# stage.sh puts copies of the runtime's modules beside a trainer (code/ links them; --code adds
# checkpoint.py and contract.py), and the code comes first on the trainer's PYTHONPATH: copies from
# an older runtime are what the trainer, and the runtime's modules it loads (hf_resume, safe_dcp,
# trainer_kit), import. Compared in bash: an image need not have cmp.
warn_runtime_modules_shadowed() {
  local module name others=()
  for module in "${JOB_DIR}"/*.py; do
    name=${module##*/}
    [[ -f "${CODE_DIR}/${name}" && "$(<"${CODE_DIR}/${name}")" != "$(<"${module}")" ]] && others+=("${name}")
  done
  ((${#others[@]} == 0)) ||
    warn "${S3_CODE_URI} holds ${others[*]} unlike this runtime's: the trainer imports the code's copies, and so do the runtime's modules it loads; stage the code again (scripts/stage.sh) unless they are your own"
}

sync_data() {
  sync_down "data" "${S3_DATA_URI}" "${DATA_DIR}"
  [[ "${TRAIN_SCRIPT}" == train.py ]] || return 0  # other trainers say themselves what their data lacks
  local split
  for split in train val; do
    [[ -s "${DATA_DIR}/${split}.bin" ]] ||
      die "${EXIT_BAD_INPUT}" "${S3_DATA_URI} holds no ${split}.bin; make it with scripts/prepare_data.py and upload it there"
  done
}

sync_model() {
  mkdir -p "${MODEL_DIR}"
  sync_down "model" "${S3_MODEL_URI}" "${MODEL_DIR}"
  [[ -n "$(ls -A "${MODEL_DIR}")" ]] ||
    die "${EXIT_BAD_INPUT}" "S3_MODEL_URI=${S3_MODEL_URI} is empty; upload a model snapshot there (scripts/stage.sh ${S3_CODE_URI} --model DIR ${S3_MODEL_URI})"
}

setup_python() {
  local requirements=("${JOB_DIR}/requirements.txt")
  [[ ! -f "${CODE_DIR}/requirements.txt" ]] || requirements+=("${CODE_DIR}/requirements.txt")
  # Any trainer but train.py may use Hugging Face's libraries: the image's must be in the range
  # hf_resume.py is tested with (constraints.txt), or the venv gets one that is.
  [[ "${TRAIN_SCRIPT}" == train.py ]] || requirements=(--constraints "${JOB_DIR}/constraints.txt" "${requirements[@]}")
  run_child bash "${JOB_DIR}/python_env.sh" "${WORK_DIR}" "${STATE_DIR}/python" "${requirements[@]}"
  PYTHON=$(cat "${STATE_DIR}/python")
  # Installed metadata, not `import torch`: a second of every restart otherwise. A torch before 2.6
  # is refused whatever the trainer: its torch.load runs code from a crafted checkpoint (CVE-2025-32434).
  local runtime code=0
  runtime=$("${PYTHON}" "${JOB_DIR}/requirements_met.py" --runtime) || code=$?
  ((code == 0)) || die "${EXIT_BAD_INPUT}" "${runtime:-the Python ${PYTHON} cannot report its torch version (see above)}"
  log "python: ${PYTHON} (${runtime})"
}

take_lease() {
  local code=0
  run_child "${PYTHON}" "${JOB_DIR}/lease.py" acquire "${S3_OUTPUT_URI}" "${STATE_DIR}/${LEASE_STATE}" || code=$?
  case "${code}" in
    "${EXIT_DONE}") LEASE_HELD=1 ;;
    "${EXIT_COMPLETE_FOUND}")
      log "another pod finished this run meanwhile: ${S3_OUTPUT_URI}COMPLETE"
      announce_complete
      exit "${EXIT_DONE}"
      ;;
    *) exit "${code}" ;;
  esac
}

# The uploader starts before the restore because it renews the lease.
start_uploader() {
  "${PYTHON}" "${JOB_DIR}/uploader.py" watch "${S3_OUTPUT_URI}" "${OUTPUT_DIR}" &
  UPLOADER_PID=$!
}

# Checkpoints reach S3 only through the uploader. One that died is restarted once; one that dies
# again stops the trainer as SIGTERM does (it commits its step, the final upload puts it in S3)
# and the pod exits 75 for the Job's next pod to carry on (64 when the uploader said bad input).
supervise_uploader() {
  [[ -n "${UPLOADER_PID}" && -z "${STOP_SIGNAL}" ]] || return 0  # stopping anyway: `finish` uploads
  ! kill -0 "${UPLOADER_PID}" 2>/dev/null || return 0
  local code=0
  wait "${UPLOADER_PID}" 2>/dev/null || code=$?
  UPLOADER_PID=""
  if ((!UPLOADER_RESTARTED)); then
    UPLOADER_RESTARTED=1
    warn "the uploader died (exit ${code}); restarting it"
    rm -f "${STATE_DIR}/${POD_ERROR}"  # its error line, if it left one, is not why this pod will end
    start_uploader
    return 0
  fi
  UPLOADER_GAVE_UP=$((code == EXIT_BAD_INPUT ? EXIT_BAD_INPUT : EXIT_UNAVAILABLE))
  log "error: the uploader died again (exit ${code}) after its restart: stopping the trainer (it commits its step), then exit ${UPLOADER_GAVE_UP} for the Job's next pod" >&2
  kill -s TERM "${TRAINER_PID}" 2>/dev/null || true
}

# A replacement of another node asked node 0 for the checkpoint (job/group.py): that node's pod
# died, so this group is gone. Stopped now, the trainer would otherwise wait out the rendezvous
# (RDZV_TIMEOUT_SECONDS) for a pod that will never come; it exits 138 like any peer's stop.
GROUP_BROKEN_SEEN=0
stop_a_broken_group() {
  ((NNODES > 1 && !GROUP_BROKEN_SEEN)) && node0 && [[ -f "$(group_state).broken" ]] || return 0
  GROUP_BROKEN_SEEN=1
  log "a new pod of node $(cat "$(group_state).broken") asked for the checkpoint: its predecessor is gone, so is this group; stopping the trainer"
  kill -s TERM "${TRAINER_PID}" 2>/dev/null || true
}

# A fifth of a second at a time, checking on the uploader between: a plain `wait` would block
# until training ends while checkpoints no longer reach S3. A trapped signal ends the sleep's wait
# at once (on_signal forwards it), so SIGTERM is handled as promptly as before. The trainer's exit
# is seen within the tick: a whole second cost every pod 0.5 s on average between the trainer's
# end (a SIGTERM's save included) and the final upload. (`wait -n PID PID` would see it at once,
# but needs bash 5.1; images on Ubuntu 20.04 have 5.0.)
wait_for_trainer() {
  local sleeper
  while kill -0 "${TRAINER_PID}" 2>/dev/null; do
    supervise_uploader
    stop_a_broken_group
    sleep 0.2 &
    sleeper=$!
    wait "${sleeper}" 2>/dev/null || kill "${sleeper}" 2>/dev/null || true
  done
  wait_for "${TRAINER_PID}"
}

stop_uploader() {
  [[ -n "${UPLOADER_PID}" ]] || return 0
  kill -TERM "${UPLOADER_PID}" 2>/dev/null || true
  wait_for "${UPLOADER_PID}" || true
  UPLOADER_PID=""
}

# In a group each node restores, of a sharded checkpoint (train.parallelism: fsdp) saved by as
# many processes, only the files its own ranks read: NODE_RANK's block of NPROC_PER_NODE ranks.
# torch orders the nodes by name, so a node may get another block; its trainer then takes what it
# lacks from a peer (code/sharded.py).
restore_ranks() {
  ((NNODES > 1)) || return 0
  printf '%s\n' --ranks "$((NODE_RANK * NPROC_PER_NODE)):${NPROC_PER_NODE}:$((NNODES * NPROC_PER_NODE))"
}

restore_checkpoint() {
  local ranks
  mapfile -t ranks < <(restore_ranks)
  run_child "${PYTHON}" "${JOB_DIR}/restore.py" "${S3_OUTPUT_URI}" "${OUTPUT_DIR}" "${ranks[@]}"
}

# -- the group (NNODES > 1): node 0 chooses the checkpoint, the others take it -------------------

group_state() { echo "${STATE_DIR}/group.json"; }

# Node 0 answers from the start ("waiting" for the lease), so the others know it is alive.
start_group_server() {
  ((NNODES > 1)) || return 0
  python3 "${JOB_DIR}/group.py" say "$(group_state)" "${S3_OUTPUT_URI}" waiting >/dev/null
  python3 "${JOB_DIR}/group.py" serve "${GROUP_PORT}" "$(group_state)" "${S3_OUTPUT_URI}" "${NNODES}" &
  GROUP_SERVER_PID=$!
}

stop_group_server() {
  [[ -n "${GROUP_SERVER_PID}" ]] || return 0
  kill -KILL "${GROUP_SERVER_PID}" 2>/dev/null || true
  wait "${GROUP_SERVER_PID}" 2>/dev/null || true
  GROUP_SERVER_PID=""
}

# The step every node resumes from: the newest committed here once node 0 restored.
announce_restored() {
  ((NNODES > 1)) || return 0
  RESTORE_STEP=$(python3 "${JOB_DIR}/group.py" say "$(group_state)" "${S3_OUTPUT_URI}" restored "${OUTPUT_DIR}")
  log "the group resumes from ${RESTORE_STEP:-step 0}"
}

# Another group finished the run while this one waited for the lease: tell the others first.
announce_complete() {
  ((NNODES > 1)) || return 0
  python3 "${JOB_DIR}/group.py" say "$(group_state)" "${S3_OUTPUT_URI}" complete >/dev/null
  sleep 3  # the others ask every second
}

wait_for_node0() {
  local answer="${STATE_DIR}/group-step" code=0
  run_child --output "${answer}" python3 "${JOB_DIR}/group.py" wait "${RDZV_HOST}:${GROUP_PORT}" \
    "${S3_OUTPUT_URI}" "${RDZV_TIMEOUT_SECONDS}" "${NODE_RANK}" "${POD_TOKEN}" || code=$?
  case "${code}" in
    0) RESTORE_STEP=$(head -n 1 "${answer}") ;;
    "${EXIT_COMPLETE_FOUND}") log "node 0 found ${S3_OUTPUT_URI}COMPLETE: nothing to do"; exit "${EXIT_DONE}" ;;
    *) die "${code}" "$(tail -n 1 "${answer}")" ;;
  esac
  log "node 0 chose ${RESTORE_STEP:-step 0}"
}

# A node k that trained well stays until node 0 has written COMPLETE: should node 0 die in its
# final upload, this pod must fail too (138) for the whole group to come back.
wait_for_node0_finish() {
  local answer="${STATE_DIR}/group-finish" code=0
  # A child, so a SIGTERM meanwhile (a preemption) ends the wait at once: exit 143.
  run_child --output "${answer}" python3 "${JOB_DIR}/group.py" finish "${RDZV_HOST}:${GROUP_PORT}" \
    "${S3_OUTPUT_URI}" "${NODE0_GONE_SECONDS}" "${NODE_RANK}" "${POD_TOKEN}" || code=$?
  ((code == 0)) || log "$(tail -n 1 "${answer}")"
  return "${code}"
}

restore_chosen_step() {
  local ranks
  mapfile -t ranks < <(restore_ranks)
  run_child "${PYTHON}" "${JOB_DIR}/restore.py" "${S3_OUTPUT_URI}" "${OUTPUT_DIR}" --step "${RESTORE_STEP}" "${ranks[@]}"
}

# One id per run: pods of another run on the same endpoint never join this rendezvous.
rdzv_id() { printf '%s' "${S3_OUTPUT_URI}" | md5sum | cut -c1-16; }

# --standalone for one pod; c10d for a group. torch ranks the nodes by their names (FQDN), which
# puts node 0 (<run>-0, <run>-node-0-0, <run>-master-0) first: global rank 0, the writer, is
# node 0's, on the disk node 0's uploader watches. The trainer checks it.
launch_args() {
  if ((NNODES == 1)); then
    echo --standalone
    return 0
  fi
  printf '%s\n' --nnodes="${NNODES}" --node-rank="${NODE_RANK}" --rdzv-backend=c10d \
    --rdzv-endpoint="${RDZV_ENDPOINT}" --rdzv-id="$(rdzv_id)" --max-restarts=0 \
    --rdzv-conf="join_timeout=${RDZV_TIMEOUT_SECONDS},is_host=$((NODE_RANK == 0 ? 1 : 0))"
}

# The shipped trainers check their config and arguments with --check: no torch, no data, a second.
# Known by its argument, not its name: a user's own script is often called train.py too, and
# running it for a check would train (and commit steps) before the pod has restored anything.
trainer_has_check() { grep -qsF 'add_argument("--check"' "${CODE_DIR}/${TRAIN_SCRIPT}"; }

# A typo in TRAIN_CONFIG's file or in TRAIN_ARGS fails the pod here, in one line, before the data,
# the lease and the GPUs: the trainer's 64 (a setting) or argparse's 2 (an argument). Anything else
# (the check itself broke) is left to the trainer's own start. WORLD_SIZE: the processes of the
# whole group, as torchrun will start them; PYTHONPATH as torchrun's workers get it.
check_trainer_settings() {
  local output="${STATE_DIR}/trainer-check.out" code=0 model_args=() line
  [[ -z "${MODEL_DIR}" ]] || model_args=(--model_dir "${MODEL_DIR}")
  run_child --output "${output}" env WORLD_SIZE=$((NPROC_PER_NODE * NNODES)) \
    PYTHONPATH="${PYTHONPATH:+${PYTHONPATH}:}${JOB_DIR}" "${PYTHON}" \
    "${CODE_DIR}/${TRAIN_SCRIPT}" --check --config "${CODE_DIR}/${TRAIN_CONFIG}" "${model_args[@]}" \
    --data_dir "${DATA_DIR}" --output_dir "${OUTPUT_DIR}" "${TRAIN_ARGV[@]}" || code=$?
  ((code != 0)) || return 0
  line=$(grep -v '^[[:space:]]*$' "${output}" | tail -n 1)
  if ((code == 2)) && [[ "${line}" == *"unrecognized arguments: --check"* ]]; then
    warn "this ${TRAIN_SCRIPT} has no --check (staged before it had one): its settings are checked when it starts; stage the code again (scripts/stage.sh)"
  elif ((code == EXIT_BAD_INPUT || code == 2)); then
    die "${EXIT_BAD_INPUT}" "${TRAIN_SCRIPT} refuses its settings (TRAIN_CONFIG=${TRAIN_CONFIG}, TRAIN_ARGS): ${line#error: }"
  else
    warn "${TRAIN_SCRIPT} --check failed (exit ${code}: $(shown "${line}")); its settings are checked when it starts"
  fi
}

mark_ready() {
  touch "${READY_FILE}" "${HEALTH_FILE}"
  log "ready: $(elapsed_since "${STARTED_MS}") from start to training"
  event ready seconds="$(seconds_since "${STARTED_MS}")"
}

trainer_gate() { echo "${STATE_DIR}/trainer-gate-${POD_TOKEN}"; }  # this pod's: a WORK_DIR may be shared

# torchrun starts before the data, the model, the lease and the restore (one pod): its workers
# import torch meanwhile and wait at job/preload.py's gate, which opens once the checkpoint is on
# disk. A group starts it after the restore, as node 0's answer and the rendezvous expect.
start_trainer() {
  [[ -z "${TRAINER_PID}" ]] || return 0
  stop_if_asked
  rm -f "${STATE_DIR}/trainer-error.json" "$(trainer_gate)"
  local model_args=() launch
  [[ -z "${MODEL_DIR}" ]] || model_args=(--model_dir "${MODEL_DIR}")
  mapfile -t launch < <(launch_args)
  log "torchrun ${launch[*]} --nproc_per_node=${NPROC_PER_NODE} ${TRAIN_SCRIPT} --config ${TRAIN_CONFIG}${MODEL_DIR:+ --model_dir ${MODEL_DIR}} --data_dir ${DATA_DIR} --output_dir ${OUTPUT_DIR}${TRAIN_ARGV[*]:+$(printf ' %q' "${TRAIN_ARGV[@]}")}"
  # PYTHONPATH: a trainer that brings no checkpoint.py of its own uses the runtime's.
  TORCHELASTIC_ERROR_FILE=${STATE_DIR}/trainer-error.json PYTHONPATH=${PYTHONPATH:+${PYTHONPATH}:}${JOB_DIR} \
    "${PYTHON}" "${JOB_DIR}/torchrun.py" "${launch[@]}" \
    --nproc_per_node="${NPROC_PER_NODE}" "${JOB_DIR}/preload.py" "$(trainer_gate)" \
    "${CODE_DIR}/${TRAIN_SCRIPT}" --config "${CODE_DIR}/${TRAIN_CONFIG}" \
    "${model_args[@]}" --data_dir "${DATA_DIR}" --output_dir "${OUTPUT_DIR}" "${TRAIN_ARGV[@]}" &
  TRAINER_PID=$!
  [[ -z "${STOP_SIGNAL}" ]] || kill -s TERM "${TRAINER_PID}" 2>/dev/null || true  # came before $!
}

release_trainer() {
  stop_if_asked
  echo go >"$(trainer_gate).new"
  mv "$(trainer_gate).new" "$(trainer_gate)"  # whole or absent: the workers poll it
  TRAINER_RELEASED=1
}

run_trainer() {
  local error_file="${STATE_DIR}/trainer-error.json"
  start_trainer
  release_trainer
  local code=0
  wait_for_trainer || code=$?
  TRAINER_PID=""
  if [[ -n "${STOP_SIGNAL}" ]] && ((code != 0)); then
    return "$(signal_exit_code)"  # a trainer that had finished keeps its 0
  fi
  if ((UPLOADER_GAVE_UP && code != 0)); then
    remember_error "the uploader died twice: the trainer was stopped (exit ${UPLOADER_GAVE_UP})"
    return "${UPLOADER_GAVE_UP}"  # said when it was decided
  fi
  if ((GROUP_BROKEN_SEEN && code != 0)); then
    return "${EXIT_PEER_LOST}"  # said when it was seen; torchrun stopped mid-rendezvous says 1
  fi
  ((code != 0)) || return 0
  # torchrun exits 1 whatever its workers' codes; their root cause carries the real one.
  local report worker message
  report=$("${PYTHON}" "${JOB_DIR}/trainer_error.py" "${error_file}" 2>/dev/null) || report=$'\nsee its traceback above'
  worker=${report%%$'\n'*}
  message=${report#*$'\n'}
  [[ -z "${worker}" ]] || code=${worker}
  if ((code == EXIT_SIGTERM || code == EXIT_SIGINT)); then
    # Not this pod's signal but a peer's (a preemption of its node): 138, which the Job does not
    # count, where 143 would use up one of its retries for every preemption of another pod.
    log "another node of the group got SIG$( ((code == EXIT_SIGINT)) && echo INT || echo TERM): the group committed its step and stops (exit ${EXIT_PEER_LOST})"
    code=${EXIT_PEER_LOST}
  elif ((code == EXIT_PEER_LOST)); then
    log "a node of the group was lost (exit ${EXIT_PEER_LOST}): every pod stops and the group resumes from the newest checkpoint in S3"
  elif ((code == EXIT_UNAVAILABLE)); then
    log "error: the group did not form or could not agree (exit ${EXIT_UNAVAILABLE}): ${message}" >&2
    remember_error "the group did not form or could not agree: ${message}"
  elif ((code == EXIT_BAD_INPUT)); then
    # Said once by the trainer; said again here, below torchrun's report, for `kubectl logs --tail`.
    log "the trainer stopped on bad input (exit ${EXIT_BAD_INPUT}): ${message}"
    remember_error "the trainer stopped on bad input: ${message}"
  elif ((code == EXIT_USAGE)); then
    # Its own line (argparse's "error: ...") said why; this one says what the pod makes of it.
    log "the trainer refused its command line (exit ${EXIT_USAGE}, a usage error): fix TRAIN_ARGS or TRAIN_CONFIG; no retry can pass (exit ${EXIT_BAD_INPUT})"
    remember_error "the trainer refused its command line (exit ${EXIT_USAGE}); fix TRAIN_ARGS or TRAIN_CONFIG"
    code=${EXIT_BAD_INPUT}
  elif ((code != 0)); then
    log "error: the trainer failed with exit ${code}: ${message}" >&2
    remember_error "the trainer failed with exit ${code}: ${message}"
  fi
  return "${code}"
}

# -- the end, whatever it is --------------------------------------------------------------------

# A trainer still at the gate goes at once: waited for (10 s at most), so torchrun's report of the
# stop comes before the pod's last lines and no worker holds the log's pipe.
stop_trainer() {
  [[ -n "${TRAINER_PID}" ]] || return 0
  kill -s TERM "${TRAINER_PID}" 2>/dev/null || true
  ((!TRAINER_RELEASED)) || return 0
  local tries=0
  while kill -0 "${TRAINER_PID}" 2>/dev/null && ((tries++ < 100)); do sleep 0.1; done
}

finish() {
  local code=$?
  trap '' TERM INT  # the grace period is for this final upload: no second interruption
  # lease.py may have taken the lease and been stopped before it could say so.
  [[ ! -f "${STATE_DIR:-/nonexistent}/${LEASE_STATE}" ]] || LEASE_HELD=1
  stop_heartbeat
  stop_trainer
  # This pod's own files go with it: a WORK_DIR may outlive pods.
  [[ -z "${STATE_DIR:-}" ]] || rm -f "$(trainer_gate)" "${RESTORE_VERIFIED_FILE:-}"
  if ((LEASE_HELD)); then
    start_heartbeat
    stop_uploader
    local upload=0 started
    started=$(date +%s%3N)
    log "final upload (trainer exit ${code})..."
    event phase name="final upload" state=start trainer_exit="${code}"
    "${PYTHON}" "${JOB_DIR}/uploader.py" final "${S3_OUTPUT_URI}" "${OUTPUT_DIR}" "${code}" || upload=$?
    log "final upload: done in $(elapsed_since "${started}") (exit ${upload})"
    event phase name="final upload" state=done seconds="$(seconds_since "${started}")" exit="${upload}"
    if ((upload != 0)) && ((code == EXIT_DONE || code == EXIT_SIGINT || code == EXIT_SIGTERM || code == EXIT_PEER_LOST)); then
      code=${upload}
    fi
    ((code != EXIT_DONE)) || announce_complete  # the other nodes wait for this before they end
    stop_heartbeat
  fi
  stop_group_server
  log "exit ${code} after $(elapsed_since "${STARTED_MS}")"
  event exit code="${code}" seconds="$(seconds_since "${STARTED_MS}")"
  # When PID 1 exits every other process in the container dies: let tee write its last lines first.
  exec >&- 2>&-
  local tries=0
  while [[ -n "${TEE_PID}" ]] && kill -0 "${TEE_PID}" 2>/dev/null && ((tries++ < 50)); do sleep 0.1; done
  exit "${code}"
}

main() {
  trap 'on_error ${LINENO} "${BASH_COMMAND}"' ERR
  trap 'on_signal TERM' TERM
  trap 'on_signal INT' INT
  validate_settings
  # Everything the pod prints, and the log the uploader puts in S3, with URL credentials hidden
  # (a token in a requirements index URL that pip quotes). sed -u: line by line, no buffering.
  # A new file each pod: on a WORK_DIR that outlives pods, this attempt's log in S3 is its own.
  # The log file keeps the EVENT lines for the tools; stdout (kubectl logs) is for people.
  if [[ "${EVENTS}" == stdout ]]; then
    exec > >(LC_ALL=C sed -u -E -f "${JOB_DIR}/redact.sed" | tee "${LOG_FILE}") 2>&1
  else
    exec > >(LC_ALL=C sed -u -E -f "${JOB_DIR}/redact.sed" | tee "${LOG_FILE}" | LC_ALL=C sed -u '/^EVENT /d') 2>&1
  fi
  TEE_PID=$!
  trap finish EXIT
  log "pod ${HOSTNAME:-?}$( ((NNODES > 1)) && echo " (node ${NODE_RANK} of ${NNODES})") starting: code ${S3_CODE_URI}, data ${S3_DATA_URI}, output ${S3_OUTPUT_URI}, ${NPROC_PER_NODE} process(es), sync with ${S3_SYNC_TOOL}"
  need_cmd "${S3_SYNC_TOOL}" "install awscli or s5cmd in the image (S3_SYNC_TOOL=auto takes either)"

  phase "check S3 access" check_access
  if already_complete; then
    log "${S3_OUTPUT_URI}COMPLETE exists: this run is finished, nothing to do. To train it further, raise" \
      "train.max_steps and remove COMPLETE (aws s3 rm ${S3_OUTPUT_URI}COMPLETE): the next pod resumes from its" \
      "newest checkpoint. For a new run, give S3_OUTPUT_URI a prefix of its own"
    exit 0
  fi
  phase "sync code" sync_code
  phase "python environment" setup_python
  ! trainer_has_check || phase "check the trainer's settings" check_trainer_settings
  ((NNODES > 1)) || start_trainer  # its workers import torch while the data and the model come down
  phase "sync data" sync_data
  [[ -z "${MODEL_DIR}" ]] || phase "sync model" sync_model
  if node0; then
    start_group_server
    phase "take the run's lease" take_lease
    start_uploader
    phase "restore checkpoint" restore_checkpoint
    announce_restored
  else
    phase "wait for node 0" wait_for_node0
    phase "restore checkpoint" restore_chosen_step
  fi
  mark_ready

  local code=0
  run_trainer || code=$?
  if ((code == EXIT_DONE)) && ! node0; then
    log "trained; waiting for node 0 to put the last step in S3 and write COMPLETE"
    wait_for_node0_finish || code=$?
  fi
  exit "${code}"
}

main "$@"
