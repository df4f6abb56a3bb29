"""status.json, the run's state for scripts/status.py: its attempts, one per pod, and the last one's.

    status = RunStatus(writer, out, state_dir)
    status.report("running")             # begins this pod's attempt, or carries it on
    status.end_attempt(exit_code)        # `final`: its end, exit code and the pod's last error line
    status.log_folder()                  # logs/ folder of this attempt's log, None before it began

An attempt is numbered from the attempts status.json in S3 records; earlier ones that never ended
were lost (their node died). A restarted watcher, and `final`, carry on this pod's open attempt
(STATE_DIR/attempt.json). A status.json in S3 that is not what this uploader writes counts as empty,
with one warning, and is replaced. A failed attempt keeps the pod's last error line (contract.POD_ERROR).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import checkpoint
import contract
import s3 as s3lib
from run_writer import RunWriter
from s3 import log

MAX_ERROR = 300  # characters of an attempt's error line in status.json


class RunStatus:
    def __init__(self, writer: RunWriter, out: Path, state_dir: Path):
        self.writer = writer
        self.out = out
        self.state_dir = state_dir
        self.attempt: dict = {}
        self.attempts: list[dict] = []

    def report(self, state: str) -> None:
        """status.json, for the attempt this pod began or carries on."""
        if not self.attempt:
            self.resume_attempt()
        self.write(state)

    def end_attempt(self, exit_code: int) -> None:
        if not self.attempt:
            self.resume_attempt()
        self.attempt.update(ended_at=time.time(), exit_code=exit_code)
        error = last_error(self.state_dir) if exit_code != 0 else None
        if error:
            self.attempt["error"] = error
        self.write(state_for(exit_code))

    def log_folder(self) -> str | None:
        """This attempt's log folder under logs/: its segments are NNNNNNNN.log."""
        if not self.attempt:
            return None
        return f"attempt-{self.attempt.get('attempt', 0):04d}-{self.attempt.get('pod', 'pod')}"

    def resume_attempt(self) -> None:
        """This pod's attempt, begun by its watcher (before a restart, or before `final`); or begin
        it now if S3 was down the whole time."""
        attempts = open_attempts(read_json(self.state_dir / "attempt.json"), pod_name())
        if attempts is None:
            self.begin_attempt()
            return
        self.attempts, self.attempt = attempts, attempts[-1]

    def begin_attempt(self) -> None:
        """Number this pod's attempt in status.json; earlier ones that never ended were lost."""
        attempts = self._attempts_in_s3()
        for old in attempts:
            if old.get("ended_at") is None:
                old.update(ended_at=old.get("heartbeat_at") or old.get("started_at"), exit_code=None, lost=True)
        now = time.time()
        self.attempt = {"attempt": len(attempts) + 1, "pod": pod_name(),
                        "started_at": now, "heartbeat_at": now, "ended_at": None, "exit_code": None,
                        "start_step": None, "end_step": None}
        attempts.append(self.attempt)
        self.attempts = attempts
        (self.state_dir / "attempt.json").write_text(json.dumps(attempts))
        self.write("starting")

    def _attempts_in_s3(self) -> list[dict]:
        writer = self.writer
        try:
            status, _ = s3lib.get_json(writer.s3, writer.run, writer.run.key(contract.STATUS_KEY), writer.retry)
            attempts = attempts_in(status)
        except ValueError:  # not JSON
            attempts = None
        if attempts is None:
            log("uploader", f"warning: {writer.run}status.json is damaged (not the JSON this uploader writes): "
                            "it counts as empty (earlier attempts are forgotten) and is replaced")
            return []
        return attempts

    def write(self, state: str) -> None:
        progress = read_progress(self.out)
        if progress and self.attempt.get("start_step") is None:
            self.attempt["start_step"] = progress.get("start_step", progress.get("step"))
        self.attempt["end_step"] = progress.get("step", self.attempt.get("end_step"))
        self.attempt["heartbeat_at"] = _heartbeat_time()
        newest = checkpoint.committed_steps(self.out / contract.CHECKPOINTS_DIR)
        status = {"state": state, "attempt": self.attempt["attempt"], "pod": self.attempt["pod"],
                  "started_at": self.attempt["started_at"], "heartbeat_at": self.attempt["heartbeat_at"],
                  "updated_at": time.time(), "progress": progress,
                  "committed_step": max((s for s, _ in newest), default=None),
                  "attempts": self.attempts}
        self.writer.put_json(self.writer.run.key(contract.STATUS_KEY), status)
        (self.state_dir / "attempt.json").write_text(json.dumps(self.attempts))


def read_progress(out: Path) -> dict:
    """What the trainer last reported; {} when it reports nothing (a trainer of one's own)."""
    progress = read_json(out / contract.PROGRESS_FILE)
    return progress if isinstance(progress, dict) else {}


def last_error(state_dir: Path) -> str | None:
    """The pod's last error line (script.sh writes it: contract.POD_ERROR), for the attempt that
    ends: why it failed, in status.json, where a retry of the same crash would otherwise say only
    its exit code. One line, control characters escaped, at most MAX_ERROR characters."""
    try:
        text = (state_dir / contract.POD_ERROR).read_bytes()
    except OSError:
        return None
    if not text:
        return None
    line = " ".join(text.decode("utf-8", "replace").split())
    line = contract.printable(line)
    return line[:MAX_ERROR - 3] + "..." if len(line) > MAX_ERROR else line or None


def attempts_in(status) -> list[dict] | None:
    """The attempts a status.json read from S3 records ([] when there is none yet); None when it is
    not what this uploader writes (damaged, or another tool's): then it counts as empty."""
    if status is None:
        return []
    attempts = status.get("attempts", []) if isinstance(status, dict) else None
    if not isinstance(attempts, list) or not all(_is_attempt(a) for a in attempts):
        return None
    return attempts


def open_attempts(saved, pod: str) -> list[dict] | None:
    """The attempts this pod's uploader saved locally, when their last is this pod's and still open:
    a restarted watcher, and `final`, carry that attempt on instead of beginning another."""
    if not isinstance(saved, list) or not saved or not all(_is_attempt(a) for a in saved):
        return None
    last = saved[-1]
    return saved if last.get("pod") == pod and last.get("ended_at") is None else None


def state_for(exit_code: int) -> str:
    if exit_code == 0:
        return "completed"
    if exit_code in (contract.EXIT_SIGINT, contract.EXIT_SIGTERM, contract.EXIT_PEER_LOST):
        return "interrupted"  # 138: a group stopped for a peer's sake, this pod did nothing wrong
    return "failed"


def pod_name() -> str:
    return os.environ.get("HOSTNAME", "pod")


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_attempt(value) -> bool:
    return (isinstance(value, dict) and _is_number(value.get("started_at"))
            and all(value.get(k) is None or _is_number(value[k]) for k in ("ended_at", "heartbeat_at")))


def _is_number(value) -> bool:
    """A time a clock gives: finite and far from float's limits (JSON's integers have none: one of
    401 digits overflowed the final upload's arithmetic)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -1e15 < value < 1e15


def _heartbeat_time() -> float:
    path = os.environ.get("HEALTH_FILE")
    try:
        return os.stat(path).st_mtime if path else time.time()
    except OSError:
        return time.time()
