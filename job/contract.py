"""The pod's contract, in one place: its exit codes and who decides each, the files the runtime and
a trainer share, the objects it keeps in S3, and the events a tool may rely on.

    python3 contract.py wait [--pid PID] LOG_FILE SECONDS KIND [key=value...]   # for shell tools (demo.sh)
    python3 contract.py near-misses    # the pod's env names that look like a mistyped setting

`wait` waits until LOG_FILE (a pod's output) holds that event, prints it as JSON and exits 0; exit 1
after SECONDS without it, or as soon as process PID (the pod) has ended without it: a pod that died
never says it. `near-misses` prints one line per name of the environment that is no setting but
close to one (TRAIN_ARG for TRAIN_ARGS), and exits 0.

job/script.sh mirrors the exit codes as `readonly EXIT_*` (bash cannot import this);
tests/unit/test_contract.py asserts the two agree. Everything else imports from here.

Standard library only: the image's python3 reads it before the pod's Python is chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

# -- exit codes --------------------------------------------------------------------------------
# The pod's (PID 1's) code is the Job's signal: job.yaml's podFailurePolicy fails the Job on 64,
# and counts any other failure against backoffLimit.

EXIT_DONE = 0
"""The run is finished: COMPLETE is in S3 (uploader.py final wrote it, or it was there already)."""

EXIT_BAD_INPUT = 64
"""EX_USAGE: no retry can pass (a setting, the code, data, a bucket, credentials). Decided by
script.sh's checks, s3.py's error table (BadInput) and the trainer's own checks."""

EXIT_UNAVAILABLE = 75
"""EX_TEMPFAIL: a retry may pass. Decided by s3.py (S3 unreachable past S3_RETRY_SECONDS:
Unavailable), uploader.py (the lease lost: another pod writes now; `final` could not put
COMPLETE), script.sh (the uploader died twice; the package index unreachable)."""

EXIT_LEASE_LOST = EXIT_UNAVAILABLE
"""uploader.py: another pod took the run's lease; this one stops writing, the Job's next pod goes on."""

EXIT_COMPLETE_FOUND = 3
"""Internal, never the pod's: lease.py acquire found COMPLETE while it waited; script.sh exits 0."""

EXIT_PEER_LOST = 138
"""A group of pods (NNODES > 1) lost a member after it trained a step: every other pod exits 138
(the trainer's peer check, code/config.py) and the Job restarts the whole group from S3. Indexed
Job: podFailurePolicy Ignore (uncounted); PyTorchJob: ExitCode restarts it; JobSet: restarts all.
A group that fails before its first step exits 75 instead: counted, so one that can never form
does not restart forever."""

EXIT_SIGINT = 130
EXIT_SIGTERM = 143
"""After SIGINT (SIGTERM): the trainer committed its step and the final upload ran (script.sh)."""

EXIT_TRAINER_FAILED = 1
"""Any other code is the trainer's own (torchrun's workers' first error); 1 is its usual crash."""

EXIT_USAGE = 2
"""A trainer that exits 2 refused its command line (argparse's usage error, Python's "can't open
file"): no retry can pass, so the pod exits 64 (script.sh)."""

EXIT_KILLED = 137
"""SIGKILL (node lost, OOM, liveness probe): decided by nobody in the pod; the next pod resumes."""

EXIT_CODES = {
    "EXIT_DONE": EXIT_DONE, "EXIT_BAD_INPUT": EXIT_BAD_INPUT, "EXIT_UNAVAILABLE": EXIT_UNAVAILABLE,
    "EXIT_COMPLETE_FOUND": EXIT_COMPLETE_FOUND, "EXIT_PEER_LOST": EXIT_PEER_LOST,
    "EXIT_SIGINT": EXIT_SIGINT, "EXIT_SIGTERM": EXIT_SIGTERM, "EXIT_USAGE": EXIT_USAGE,
}


def signal_exit_code(signum: int) -> int:
    return 128 + signum


# -- text from S3 or a folder, for a terminal ---------------------------------------------------

def printable(text: str, keep: str = "") -> str:
    """TEXT with every control or format character escaped (\\x1b, \\u202e), so a name or a line from
    S3 cannot move the cursor, recolour or rewrite the screen (status.py, stage.sh show it this way)."""
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


def _escape(char: str) -> str:
    return ascii(char)[1:-1]  # Python's own escape: \\n, \\x1b, \\u202e


# -- what a trainer and the runtime share, under OUTPUT_DIR (WORK_DIR/out) ----------------------
# A trainer MUST commit checkpoints as CHECKPOINTS_DIR/step-NNNNNNNN/ with MANIFEST written last
# (checkpoint.py does it). It MAY write PROGRESS_FILE (then COMPLETE waits for its max_steps;
# status.py shows it), TENSORBOARD_DIR (uploaded as it grows) and CHECKPOINTS_DIR/best/. It MUST touch
# $HEALTH_FILE at least every HEALTH_MAX_AGE_SECONDS while it trains: the liveness probe kills a pod
# whose heartbeat is older (the pod's own heartbeat runs only during the final upload: one while
# training would hide a hung step). Nothing else is read.

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
PROGRESS_FILE = "progress.json"   # {"step", "max_steps", losses, ms_per_step, eta...}: optional
TENSORBOARD_DIR = "tensorboard"   # optional

# -- the pod's own files, under STATE_DIR (WORK_DIR/.pod) ---------------------------------------

LEASE_STATE = "lease.json"        # lease.py acquire writes it once held: script.sh knows it holds one
POD_LOG = "pod.log"
TRAINER_ERROR = "trainer-error.json"  # TORCHELASTIC_ERROR_FILE: the worker's exit code and message
POD_ERROR = "last-error.txt"      # script.sh: the pod's last error line; uploader.py keeps it in status.json
READY_FILE_DEFAULT = "/tmp/ready"     # startup probe: touched once restored
HEALTH_FILE_DEFAULT = "/tmp/healthy"  # liveness probe: the trainer's heartbeat (train.py: every 2 s)
# $RESTORE_VERIFIED_FILE (restore-verified-<pod>.json): the checkpoint restore.py just hashed against
# its manifest (checkpoint.note_verified); a trainer MAY check that one by size only (read_verified).

# -- the run's objects in S3, under S3_OUTPUT_URI ----------------------------------------------

LEASE_KEY = "lease.json"          # one writer per prefix (lease.py)
STATUS_KEY = "status.json"        # attempts and state, for status.py (uploader.py)
COMPLETE_KEY = "COMPLETE"         # written last of all: the run is finished (a summary in JSON)
LOGS_PREFIX = "logs/"             # logs/attempt-NNNN-POD/NNNNNNNN.log

# -- the pod's settings ----------------------------------------------------------------------------
# Every environment variable the pod reads as a setting; job/script.sh's header says what each means
# and its default, and its `readonly SETTINGS` mirrors this (tests/unit/test_contract.py). A pod's
# env holds many other names (the image's, Kubernetes' service links): only those that look like a
# mistyped setting are worth a word.

SETTINGS = (
    "S3_CODE_URI", "S3_DATA_URI", "S3_OUTPUT_URI", "S3_MODEL_URI", "WORK_DIR", "NPROC_PER_NODE",
    "TRAIN_SCRIPT", "TRAIN_CONFIG", "TRAIN_ARGS", "SYNC_INTERVAL_SECONDS", "UPLOAD_RETRY_SECONDS",
    "READY_FILE", "HEALTH_FILE", "HEALTH_MAX_AGE_SECONDS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    "AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE", "S3_RETRY_SECONDS", "S3_LEASE", "LEASE_TTL_SECONDS", "LEASE_WAIT_SECONDS",
    "S3_SYNC_TOOL", "CHECKPOINT_HMAC_KEY", "EVENTS", "NNODES", "RDZV_ENDPOINT", "RDZV_TIMEOUT_SECONDS",
    "GROUP_SECRET",
)
SECRET_SETTINGS = ("CHECKPOINT_HMAC_KEY", "GROUP_SECRET")  # never shown; its bytes are its own business
# Read too, but set by a controller, not by hand: the node rank and the operator's rendezvous.
CONTROLLER_SETTINGS = ("JOB_COMPLETION_INDEX", "PET_NODE_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT")
# An s3://bucket/prefix/ URI: a bucket name S3 accepts, then an optional /prefix of any characters, a
# newline too, as bash's `.` (job/s3_uri.sh is the shell's copy; tests/unit/test_contract.py holds
# them to the same answers).
S3_URI_RULE = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?", re.DOTALL)
EVENTS_CHOICES = ("log", "stdout")  # EVENTS: where the event lines go besides the log (below)


def s3_uri_fault(uri: str) -> str:
    """Why uri is not an s3://bucket/prefix/ URI, or "" (job/s3_uri.sh says the same, word for word)."""
    if S3_URI_RULE.fullmatch(uri):
        return ""
    bucket_rule = " (a bucket name: 3 to 63 lowercase letters, digits, dots and hyphens)"
    return "is not an s3://bucket/prefix/ URI" + (bucket_rule if uri.startswith("s3://") else "")


class BadFlagParser(argparse.ArgumentParser):
    """A bad flag is bad input: one line and 64, not argparse's usage block and 2 (give prog="NAME.py")."""

    def error(self, message):
        print(f"{self.prog.removesuffix('.py')}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def near_misses(names) -> list[tuple[str, str]]:
    """(name, the setting it looks like) for each name that is no setting but within a typo of one:
    one edit (two for names of 8 characters or more), letter case aside."""
    known = set(SETTINGS) | set(CONTROLLER_SETTINGS)
    found = []
    for name in sorted(set(names) - known):
        for setting in SETTINGS:
            if _edits(name.upper(), setting) <= (2 if len(setting) >= 8 else 1):
                found.append((name, setting))
                break
    return found


def _edits(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions, swaps of neighbours."""
    if abs(len(a) - len(b)) > 2:
        return 3  # more than any threshold: not worth the table
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[i - 1][j] + 1, row[j - 1] + 1, rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[i - 2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


# -- events ------------------------------------------------------------------------------------
# One line each: EVENT_PREFIX and a JSON object with "event", "source" and "time" (Unix seconds).
# Tools match these, never prose. Every event is in the pod's log file (STATE_DIR/pod.log) and its
# copy in S3 (LOGS_PREFIX); on the pod's stdout (`kubectl logs`) only with EVENTS=stdout, so that a
# person reads sentences there (script.sh's output filter drops them; the lab's pods set stdout).
#   phase       name, state ("start" | "done"), seconds (done)      script.sh: check S3 access,
#               sync code, sync data, sync model, python environment, take the run's lease (node 0),
#               wait for node 0 (nodes k > 0 of a group), restore checkpoint; final upload (node 0;
#               with trainer_exit; exit: the uploader's code, at done)
#   ready       seconds (from the pod's start to training)            script.sh
#   preloaded   seconds (torch's import in torchrun's worker, while   preload.py (rank 0)
#               the pod syncs data, takes the lease and restores)
#   lease       state ("held" | "off" | "complete"), waited (held)   lease.py
#   restore     step, name (restored; null: the trainer starts at 0),  restore.py
#               bytes (of the checkpoint on this node's disk), absent (its files a node of a group
#               did not fetch: other ranks' shards, --ranks)
#   uploaded    step, name, bytes, seconds (committed in S3)          uploader.py
#   complete    state ("writing" | "written"), step                  uploader.py
#   exit        code, seconds                                        script.sh, last line
# The trainer's (source "train", whichever trainer: train.py, hf_resume.py; global rank 0 alone prints
# them, so each comes once however many processes train):
#   resumed     step, name, seconds   training starts at `step` from checkpoint `name` (null: from
#               step 0, nothing loaded), loaded in `seconds`; train.py adds hashed_by ("restore": the
#               pod's restore hashed it, the trainer checked sizes; "trainer")
#   step        step, max_steps, loss, ms_per_step, tokens_per_s (mfu when the GPU's peak is known): at
#               each log line (log.interval) and the last step; loss is the mean over processes, null
#               when not finite; speeds are over the steps since the last such line
#   checkpoint  step, name, state ("committed"), seconds, blocked_seconds, bytes: checkpoints/`name`
#               is committed locally; `seconds` from the request to the commit, `blocked_seconds` how
#               long training waited for it (sync: all of it; async: the snapshot copy, and the save
#               before it when that was still in flight), `bytes` of the folder (manifest included);
#               a background save's event comes a step or more after the request
#   stopped     signal ("SIGTERM" | "SIGINT"), step: `step` is committed, the trainer exits 128+signal
#   done        step: the last step is committed, the trainer exits 0
EVENT_PREFIX = "EVENT "
EVENTS = ("phase", "ready", "preloaded", "lease", "restore", "uploaded", "complete", "exit",
          "resumed", "step", "checkpoint", "stopped", "done")
TRAINER_SOURCE = "train"


def write_line(text: str) -> None:
    """text and its newline on stdout in one write, flushed. The pod's processes share one pipe, and
    print's two writes (text, then newline) let another process's line land between them: two lines
    glued into one, and an event at the end of a prose line is one no tool sees. (A pipe keeps a
    write of up to 4 KiB whole.)"""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def event(kind: str, source: str, /, **fields) -> None:
    """Print one event line (flushed: the tools wait on it)."""
    record = {"event": kind, "source": source, "time": round(time.time(), 3), **fields}
    write_line(EVENT_PREFIX + json.dumps(record, sort_keys=True))


def parse_event(line: str) -> dict | None:
    """The event a line carries, or None (prose, or not an object). The line must start with
    EVENT_PREFIX: text after anything else on a line (a quoted value, a carriage return) is prose."""
    line = line.rstrip("\n")
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        record = json.loads(line[len(EVENT_PREFIX):])
    except ValueError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


def matches(record: dict | None, kind: str, /, **fields) -> bool:
    return record is not None and record.get("event") == kind and all(record.get(k) == v for k, v in fields.items())


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def wait(path: str, seconds: float, kind: str, fields: dict, pid: int | None = None) -> dict | None:
    """The first matching event in the file; None after `seconds`, or once process `pid` has ended
    without it (the file read once more after its end: its last lines may have come meanwhile)."""
    deadline = time.monotonic() + seconds
    while True:
        ended = pid is not None and not _alive(pid)
        try:
            # newline="\n": a line ends at a newline only; a carriage return inside one starts none.
            with open(path, errors="replace", newline="\n") as file:
                for line in file:
                    record = parse_event(line)
                    if matches(record, kind, **fields):
                        return record
        except FileNotFoundError:
            pass
        if ended or time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    """Whether the process runs; one that ended but was not waited for yet (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


USAGE = "usage: contract.py wait [--pid PID] LOG_FILE SECONDS KIND [key=value...] | near-misses"


def main(argv: list[str]) -> int:
    if argv == ["near-misses"]:
        for name, setting in near_misses(os.environ):
            print(f"{name} is not a setting of the pod, so it is ignored; did you mean {setting}?")
        return 0
    pid = None
    if argv[:1] == ["wait"] and argv[1:2] == ["--pid"] and len(argv) > 2 and argv[2].isdigit():
        pid, argv = int(argv[2]), argv[:1] + argv[3:]
    if len(argv) < 4 or argv[0] != "wait" or not all("=" in a for a in argv[4:]):
        print(USAGE, file=sys.stderr)
        return 64
    fields = {k: _value(v) for k, v in (a.split("=", 1) for a in argv[4:])}
    record = wait(argv[1], float(argv[2]), argv[3], fields, pid)
    if record is None:
        why = f"process {pid} ended" if pid is not None and not _alive(pid) else f"not within {argv[2]}s"
        print(f"contract.py: no event {argv[3]} {json.dumps(fields)} in {argv[1]}: {why}", file=sys.stderr)
        return 1
    print(json.dumps(record, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
