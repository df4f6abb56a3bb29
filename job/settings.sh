# shellcheck shell=bash
# The pod's settings checked, defaulted and exported, before anything else runs: sourced by
# script.sh from beside it (the ConfigMap mounts job/ flat), which calls validate_settings first.
#
# Each bad value stops the pod with exit 64 and one line that names the setting and the fix; an
# empty value means its default. script.sh's header lists the settings and their defaults, its
# SETTINGS array their names (job/contract.py's SETTINGS).
# shellcheck disable=SC2034,SC2329 # what it sets is read by script.sh; validate_settings is called there

# shellcheck source=job/s3_uri.sh
source "$(dirname "${BASH_SOURCE[0]}")/s3_uri.sh"

check_s3_uri() {
  local name=$1 value=${!1:-}
  [[ -n "${value}" ]] || die "${EXIT_BAD_INPUT}" "${name} is not set; set it to s3://bucket/prefix/ ($2)"
  local fault
  fault=$(s3_uri_fault "${value}") || die "${EXIT_BAD_INPUT}" "${name}=$(shown "${value}") ${fault}; fix it in job.yaml"
  [[ "${value}" == */ ]] || value="${value}/"
  printf -v "${name}" '%s' "${value}"
  export "${name?}"
}

check_no_overlap() {
  local a=$1 b=$2
  if [[ "${!a}" == "${!b}"* || "${!b}" == "${!a}"* ]]; then
    die "${EXIT_BAD_INPUT}" "${a} (${!a}) and ${b} (${!b}) overlap; give S3_OUTPUT_URI its own prefix"
  fi
}

# A newline in a URI or an endpoint would reach S3 calls and log lines as it is; TRAIN_ARGS alone
# may hold newlines and tabs (they separate its words). A secret's bytes are its own (never shown).
# Bytes, not letters (LC_ALL=C): C0 and DEL, and the C1 controls as UTF-8 encodes them (\xc2\x80-\x9f).
check_no_control_characters() {
  local name value shown_value LC_ALL=C c1=$'\xc2'[$'\x80'-$'\x9f']
  for name in "${SETTINGS[@]}" "${CONTROLLER_SETTINGS[@]}"; do
    [[ -v "${name}" && "${name}" != CHECKPOINT_HMAC_KEY && "${name}" != GROUP_SECRET ]] || continue
    value=${!name}
    [[ "${name}" != TRAIN_ARGS ]] || value=${value//[$'\n\t']/ }
    [[ "${value}" == *[[:cntrl:]]* || "${value}" == *${c1}* ]] || continue
    shown_value=${value//[[:cntrl:]]/?}
    shown_value=${shown_value//${c1}/?}
    die "${EXIT_BAD_INPUT}" "${name}=$(shown "${shown_value}") holds a control character (shown as ?; a newline or an escape, often pasted); fix it in job.yaml"
  done
}

# The env holds many names besides the settings: only one a typo away from a setting gets a word.
warn_near_misses() {
  command -v python3 >/dev/null 2>&1 || return 0  # said later, where python3 is needed
  local line
  while IFS= read -r line; do
    warn "${line}"
  done < <(python3 "${JOB_DIR}/contract.py" near-misses 2>/dev/null || true)
}

# At most 9 digits: bash arithmetic (deadlines) must not overflow.
check_positive_int() {
  local name=$1 value=${!1}
  [[ "${value}" =~ ^[1-9][0-9]{0,8}$ ]] || die "${EXIT_BAD_INPUT}" "${name}=$(shown "${value}") must be a positive integer; fix it in job.yaml"
}

# A whole number of seconds no lower than MIN; WHY says what a lower one would break.
check_seconds() {
  local name=$1 min=$2 why=$3 value=${!1}
  if ! [[ "${value}" =~ ^(0|[1-9][0-9]{0,8})$ ]] || ((value < min)); then
    die "${EXIT_BAD_INPUT}" "${name}=$(shown "${value}") must be a whole number of seconds, at least ${min} (${why}); fix it in job.yaml"
  fi
}

check_one_of() {
  local name=$1 value=${!1} choices=$2
  [[ "${value}" =~ ^(${choices})$ ]] ||
    die "${EXIT_BAD_INPUT}" "${name}=$(shown "${value}") must be ${3}; fix it in job.yaml"
}

# The probes read these files from the container's working folder, not the script's: absolute paths.
check_probe_file() {
  local name=$1 value=${!1}
  [[ "${value}" == /* ]] ||
    die "${EXIT_BAD_INPUT}" "${name}=$(shown "${value}") must be an absolute path (the probes run elsewhere); e.g. /tmp/${value##*/}"
  [[ -d "$(dirname "${value}")" && -w "$(dirname "${value}")" ]] ||
    die "${EXIT_BAD_INPUT}" "${name}=$(shown "${value}") is in no writable folder; point it at a writable volume, e.g. /tmp/${value##*/}"
}

check_s3_settings() {
  check_s3_uri S3_CODE_URI "where scripts/stage.sh put the code"
  check_s3_uri S3_DATA_URI "where train.bin and val.bin are"
  check_s3_uri S3_OUTPUT_URI "where checkpoints and logs go"
  check_no_overlap S3_OUTPUT_URI S3_CODE_URI
  check_no_overlap S3_OUTPUT_URI S3_DATA_URI
  if [[ -n "${S3_MODEL_URI:-}" ]]; then
    check_s3_uri S3_MODEL_URI "where scripts/stage.sh --model put the model snapshot"
    check_no_overlap S3_OUTPUT_URI S3_MODEL_URI
  fi
  if [[ -n "${AWS_ENDPOINT_URL:-}" && ! "${AWS_ENDPOINT_URL}" =~ ^https?://[^/]+ ]]; then
    die "${EXIT_BAD_INPUT}" "AWS_ENDPOINT_URL=$(shown "${AWS_ENDPOINT_URL}") has no http:// or https:// scheme; add it"
  fi
  S3_RETRY_SECONDS=${S3_RETRY_SECONDS:-600}
  check_positive_int S3_RETRY_SECONDS
  # The AWS CLI's own retries: exponential backoff with jitter on throttling, 5xx and resets.
  AWS_RETRY_MODE=${AWS_RETRY_MODE:-standard}
  AWS_MAX_ATTEMPTS=${AWS_MAX_ATTEMPTS:-5}
  check_one_of AWS_RETRY_MODE "standard|adaptive|legacy" "standard, adaptive or legacy"
  check_positive_int AWS_MAX_ATTEMPTS
  S3_SYNC_TOOL=${S3_SYNC_TOOL:-auto}
  if [[ "${S3_SYNC_TOOL}" == auto ]]; then
    command -v s5cmd >/dev/null 2>&1 && S3_SYNC_TOOL=s5cmd || S3_SYNC_TOOL=aws
  fi
  [[ "${S3_SYNC_TOOL}" =~ ^(aws|s5cmd)$ ]] || die "${EXIT_BAD_INPUT}" "S3_SYNC_TOOL=$(shown "${S3_SYNC_TOOL}") must be auto, aws or s5cmd"
  export S3_RETRY_SECONDS AWS_RETRY_MODE AWS_MAX_ATTEMPTS
}

# An empty setting means its default, as the probes in job.yaml read them (${VAR:-default}).
check_timings() {
  SYNC_INTERVAL_SECONDS=${SYNC_INTERVAL_SECONDS:-60}
  UPLOAD_RETRY_SECONDS=${UPLOAD_RETRY_SECONDS:-30}
  LEASE_TTL_SECONDS=${LEASE_TTL_SECONDS:-30}
  LEASE_WAIT_SECONDS=${LEASE_WAIT_SECONDS:-3000}
  HEALTH_MAX_AGE_SECONDS=${HEALTH_MAX_AGE_SECONDS:-600}
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-180}
  S3_LEASE=${S3_LEASE:-on}
  check_positive_int SYNC_INTERVAL_SECONDS
  check_positive_int UPLOAD_RETRY_SECONDS
  # Renewed every third of it: below 3 s that is more than one S3 write a second (0: no pause at all).
  check_seconds LEASE_TTL_SECONDS 3 "the lease is renewed every third of it"
  check_seconds LEASE_WAIT_SECONDS 0 "how long a second pod waits for a live pod's lease"
  # Heartbeats come every 2 s (train.py) or 5 s (the final upload): a limit near that fails on one late beat.
  check_seconds HEALTH_MAX_AGE_SECONDS 10 "the liveness probe's limit on the heartbeat's age, which is renewed every 5 s"
  # torchrun's own default is 30 s: too short for a full fine-tune's save (12 bytes a parameter).
  check_seconds TORCH_ELASTIC_SHUTDOWN_TIMEOUT 1 "how long a stopped trainer may take to save"
  check_one_of S3_LEASE "on|off" "on or off"
  EVENTS=${EVENTS:-log}
  check_one_of EVENTS "log|stdout" "log (in the log file and its copy in S3) or stdout (in kubectl logs too)"
  export SYNC_INTERVAL_SECONDS UPLOAD_RETRY_SECONDS LEASE_TTL_SECONDS LEASE_WAIT_SECONDS HEALTH_MAX_AGE_SECONDS S3_LEASE \
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT
}

# Never shown, not even its length: a key that is set must be long enough to sign with.
check_secrets() {
  [[ -v CHECKPOINT_HMAC_KEY ]] || return 0
  local LC_ALL=C  # ${#...} counts bytes
  ((${#CHECKPOINT_HMAC_KEY} >= 16)) ||
    die "${EXIT_BAD_INPUT}" "CHECKPOINT_HMAC_KEY is set but shorter than 16 bytes (its value is not shown); put a random key in its Secret (e.g. openssl rand -hex 32) or unset it"
}

# Words as a shell splits them, nothing evaluated ($(...), globs and $VARIABLES stay text); an
# unbalanced quote is refused rather than the text cut short.
check_train_args() {
  TRAIN_ARGV=()
  [[ -n "${TRAIN_ARGS:-}" ]] || return 0
  need_cmd python3 "use an image with Python 3.9+ and torch"
  local words="${STATE_DIR}/train-args" code=0
  TRAIN_ARGS=${TRAIN_ARGS} python3 "${JOB_DIR}/train_args.py" >"${words}" || code=$?
  ((code == 0)) || die "${EXIT_BAD_INPUT}" "$(shown "$(cat "${words}")")"
  mapfile -d '' -t TRAIN_ARGV <"${words}"
}

# nvidia-smi when the image has it; else the device nodes the device plugin gave the pod.
visible_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    find /dev -maxdepth 1 -name 'nvidia[0-9]*' 2>/dev/null | wc -l
  fi
}

check_nproc() {
  local gpus
  gpus=$(visible_gpus)
  NPROC_PER_NODE=${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}
  check_positive_int NPROC_PER_NODE
  if ((gpus > 0 && NPROC_PER_NODE > gpus)); then
    die "${EXIT_BAD_INPUT}" "NPROC_PER_NODE=${NPROC_PER_NODE} but the pod sees ${gpus} GPUs; lower it or request more nvidia.com/gpu"
  fi
}

check_work_dir() {
  WORK_DIR=${WORK_DIR:-/home/eai_role/code}
  [[ "${WORK_DIR}" == /* ]] ||
    die "${EXIT_BAD_INPUT}" "WORK_DIR=$(shown "${WORK_DIR}") must be an absolute path, e.g. /home/eai_role/code; fix it in job.yaml"
  if ! mkdir -p "${WORK_DIR}" 2>/dev/null || [[ ! -w "${WORK_DIR}" ]]; then
    die "${EXIT_BAD_INPUT}" "WORK_DIR=$(shown "${WORK_DIR}") is not writable; mount a volume there"
  fi
}

# A file of the synced code: relative, and never outside it. Whether it is there is known after the sync.
check_code_file() {
  local name=$1 value=${!1} example=$2
  [[ -n "${value}" && "${value}" != /* && ! "/${value}/" =~ /\.\./ ]] ||
    die "${EXIT_BAD_INPUT}" "${name}=$(shown "${value}") must be relative to the code, without .. (e.g. ${example})"
}

check_train_files() {
  TRAIN_SCRIPT=${TRAIN_SCRIPT:-train.py}
  # Each shipped script's own config: the GPT trainer's would only confuse finetune.py.
  local default_config=config/conf.yaml
  [[ "${TRAIN_SCRIPT}" != finetune.py ]] || default_config=config/finetune.yaml
  TRAIN_CONFIG=${TRAIN_CONFIG:-${default_config}}
  check_code_file TRAIN_SCRIPT finetune.py
  check_code_file TRAIN_CONFIG config/conf.yaml
  # finetune.py's --model_dir is required: say so here rather than as its usage error (exit 2).
  if [[ "${TRAIN_SCRIPT}" == finetune.py && -z "${S3_MODEL_URI:-}" ]]; then
    die "${EXIT_BAD_INPUT}" "S3_MODEL_URI is not set; TRAIN_SCRIPT=finetune.py needs a model snapshot in S3 (scripts/stage.sh --model DIR URI)"
  fi
}

# How the pods of a group find each other; one pod (NNODES=1) needs none of it.
check_group() {
  NNODES=${NNODES:-1}
  check_positive_int NNODES
  NODE_RANK=0
  export NNODES NODE_RANK
  ((NNODES > 1)) || return 0
  local source
  for source in JOB_COMPLETION_INDEX PET_NODE_RANK RANK ""; do
    [[ -z "${source}" || -n "${!source:-}" ]] && break
  done
  [[ -n "${source}" ]] ||
    die "${EXIT_BAD_INPUT}" "NNODES=${NNODES} but no node rank in the environment (JOB_COMPLETION_INDEX, PET_NODE_RANK or RANK); run the group as an Indexed Job, JobSet or PyTorchJob (scripts/submit.py renders them)"
  NODE_RANK=${!source}
  if ! [[ "${NODE_RANK}" =~ ^(0|[1-9][0-9]{0,8})$ ]] || ((NODE_RANK >= NNODES)); then
    die "${EXIT_BAD_INPUT}" "${source}=$(shown "${NODE_RANK}") is not a node rank below NNODES=${NNODES}; set NNODES to the number of pods"
  fi
  if [[ -z "${RDZV_ENDPOINT:-}" && -n "${MASTER_ADDR:-}" ]]; then
    RDZV_ENDPOINT=${MASTER_ADDR}:${MASTER_PORT:-29400}  # the training operator's (PyTorchJob)
  fi
  if ! [[ "${RDZV_ENDPOINT:-}" =~ ^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):([1-9][0-9]{0,4})$ ]] ||
    ((BASH_REMATCH[3] >= 65535)); then  # port + 1 is node 0's answer on the checkpoint
    die "${EXIT_BAD_INPUT}" "RDZV_ENDPOINT=$(shown "${RDZV_ENDPOINT:-}") must be host:port of node 0 (e.g. run-0.run:29400) when NNODES=${NNODES}; scripts/submit.py sets it"
  fi
  RDZV_HOST=${BASH_REMATCH[1]}
  GROUP_PORT=$((BASH_REMATCH[3] + 1))
  RDZV_TIMEOUT_SECONDS=${RDZV_TIMEOUT_SECONDS:-900}
  check_seconds RDZV_TIMEOUT_SECONDS 10 "how long a node waits for the others, which start seconds apart at best"
  export NODE_RANK RDZV_ENDPOINT RDZV_TIMEOUT_SECONDS
  check_group_secret
}

# Node 0 answers only requests signed with the group's secret (job/group.py): without one any pod
# on the network could stop the group. Never shown, not even its length.
check_group_secret() {
  if [[ -z "${GROUP_SECRET:-}" && -z "${CHECKPOINT_HMAC_KEY:-}" ]]; then
    die "${EXIT_BAD_INPUT}" "NNODES=${NNODES} but GROUP_SECRET is not set: node 0 would answer any pod on the network; render the group with scripts/submit.py (it makes the Secret <run>-group), or set GROUP_SECRET from a Secret of your own (16 bytes or more, the same in every pod of the group)"
  fi
  [[ -n "${GROUP_SECRET:-}" ]] || return 0
  local LC_ALL=C  # ${#...} counts bytes
  ((${#GROUP_SECRET} >= 16)) ||
    die "${EXIT_BAD_INPUT}" "GROUP_SECRET is set but shorter than 16 bytes (its value is not shown); put a random one in its Secret (e.g. openssl rand -hex 32), the same in every pod of the group"
  export GROUP_SECRET
}

validate_settings() {
  check_no_control_characters
  warn_near_misses
  check_s3_settings
  check_group
  check_timings
  check_secrets
  check_train_files
  READY_FILE=${READY_FILE:-/tmp/ready}
  HEALTH_FILE=${HEALTH_FILE:-/tmp/healthy}
  check_probe_file READY_FILE
  check_probe_file HEALTH_FILE
  check_nproc
  check_work_dir

  CODE_DIR=${WORK_DIR}
  DATA_DIR=${WORK_DIR}/data
  OUTPUT_DIR=${WORK_DIR}/out
  MODEL_DIR=""
  [[ -z "${S3_MODEL_URI:-}" ]] || MODEL_DIR=${WORK_DIR}/model
  STATE_DIR=${WORK_DIR}/.pod
  LOG_FILE=${STATE_DIR}/pod.log
  # Python (tempfile) silently falls back to /tmp when TMPDIR does not exist: make it first.
  TMPDIR=${WORK_DIR}/.tmp
  mkdir -p "${DATA_DIR}" "${OUTPUT_DIR}" "${STATE_DIR}" "${TMPDIR}"
  rm -f "${STATE_DIR}/${LEASE_STATE}" "${STATE_DIR}/${POD_ERROR}"  # an earlier pod's, on a WORK_DIR that outlives pods
  check_train_args
  # restore.py names the checkpoint it just hashed here; the trainer then checks it by size only.
  RESTORE_VERIFIED_FILE=${STATE_DIR}/restore-verified-${POD_TOKEN}.json  # this pod's, never an earlier one's
  export WORK_DIR CODE_DIR STATE_DIR LOG_FILE READY_FILE HEALTH_FILE TMPDIR RESTORE_VERIFIED_FILE
  export PYTHONUNBUFFERED=1
}
