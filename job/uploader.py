"""Put what the trainer commits into S3 as it happens, and the rest when the pod ends.

    python uploader.py watch S3_OUTPUT_URI OUTPUT_DIR             # in the background, until SIGTERM
    python uploader.py final S3_OUTPUT_URI OUTPUT_DIR EXIT_CODE   # once, from the EXIT trap

Its parts, each with one job: run_writer.py (every write waits on the run's lease), checkpoint_sync.py
(committed checkpoints, within seconds, and retention), segment_sync.py (TensorBoard's event files and
this attempt's log, as new segments), run_status.py (status.json and the attempts), completion.py
(COMPLETE, last of all after exit 0). `watch` runs them as chores: checkpoints come first and depend
on nothing else, the others every SYNC_INTERVAL_SECONDS, each failing on its own (a warning, a
backoff of its own). `final` does one last round; only the checkpoints and COMPLETE decide its exit.

S3 outages: the watcher retries with exponential backoff and jitter forever (training never waits on
it); `final` gives up after S3_RETRY_SECONDS with exit 75. A lost lease (another pod
writes now): exit 75, nothing more is written.

Environment: SYNC_INTERVAL_SECONDS (60), UPLOAD_RETRY_SECONDS (30: one round of the watcher's
retries), S3_RETRY_SECONDS (600: `final`'s), LOG_FILE, STATE_DIR (lease and attempt), HEALTH_FILE,
HOSTNAME.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import contract
import s3 as s3lib
from checkpoint_sync import CheckpointSync
from completion import Completion
from lease import LeaseLost
from run_status import RunStatus
from run_writer import RunWriter
from s3 import Location, log
from segment_sync import SegmentSync

POLL_SECONDS = 1.0
EXIT_LEASE_LOST = contract.EXIT_LEASE_LOST


class Uploader:
    """The uploader's parts, composed for one run and one output folder."""

    def __init__(self, run: Location, out: Path, retry_seconds: float):
        state_dir = Path(os.environ.get("STATE_DIR", out / ".pod"))
        log_file = Path(os.environ["LOG_FILE"]) if os.environ.get("LOG_FILE") else None
        self.writer = RunWriter(run, retry_seconds, state_dir)
        self.checkpoints = CheckpointSync(self.writer, out)
        self.status = RunStatus(self.writer, out, state_dir)
        self.segments = SegmentSync(self.writer, out, log_file, self.status.log_folder)
        self.completion = Completion(self.writer, out, self.checkpoints, self.status)


class Chore:
    """One of the watcher's jobs, on its own schedule and with its own backoff: one that keeps
    failing (a damaged file, a bug) never delays another, above all not the checkpoints."""

    def __init__(self, name: str, do, every: float):
        self.name, self.do, self.every = name, do, every
        self.due, self.backoff = 0.0, 0.0

    def run_if_due(self) -> bool:
        """False when S3 stayed unreachable through a whole round of retries."""
        if time.monotonic() < self.due:
            return True
        try:
            self.do()
            self.backoff, self.due = 0.0, time.monotonic() + self.every
            return True
        except LeaseLost:
            raise
        except Exception as err:  # noqa: BLE001 - whatever it is, the watcher must not die silently
            self.backoff = min(60.0, max(2.0, self.backoff * 2))
            what = str(err) if isinstance(err, (s3lib.Unavailable, s3lib.BadInput)) else repr(err)
            log("uploader", f"warning: {self.name}: {what}; training goes on, next try in {self.backoff:.0f}s")
            self.due = time.monotonic() + self.backoff * random.uniform(0.5, 1.0)
            return not isinstance(err, s3lib.Unavailable)


def run_round(chores: list[Chore], stopping: threading.Event | None = None) -> float:
    """The chores that are due, in order; the seconds to wait before the next round. S3 being
    unreachable is every chore's problem: the round stops there and all wait out that backoff
    together (one retrying client at a time, not a hot loop through a long outage). A stop asked
    for meanwhile ends the round too: the final upload does the rest, inside the grace period."""
    for chore in chores:
        if stopping is not None and stopping.is_set():
            break
        if not chore.run_if_due():
            return max(POLL_SECONDS, chore.due - time.monotonic())
    return POLL_SECONDS


def watch(uploader: Uploader, interval: float) -> int:
    """Upload checkpoints as they commit, the rest every `interval`, until SIGTERM."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    uploader.writer.hold_lease()
    # The uploader starts before the restore: the run is "starting" until the pod is ready to train.
    ready = Path(os.environ.get("READY_FILE") or "/tmp/ready")
    status = Chore("status.json", lambda: uploader.status.report("running" if ready.exists() else "starting"), interval)

    def checkpoints() -> None:
        if uploader.checkpoints.sync():
            status.due = 0.0  # next in this round: a pod lost before its next report names that step
    chores = [Chore("checkpoints", checkpoints, 0.0), status,
              Chore("logs and events", uploader.segments.sync, interval)]
    while not stopping.is_set():
        try:
            pause = run_round(chores, stopping)
        except LeaseLost as err:
            log("uploader", f"error: {err}")
            os.kill(os.getppid(), signal.SIGTERM)  # the bootstrap stops the trainer
            return EXIT_LEASE_LOST
        stopping.wait(pause)
    uploader.writer.stop()
    return 0


def final(uploader: Uploader, exit_code: int) -> int:
    """The checkpoints left, then the attempt's end in status.json and the log, then COMPLETE; then
    the lease goes. Only the checkpoints and COMPLETE decide the exit code."""
    uploader.writer.hold_lease()
    started = time.monotonic()
    try:
        uploader.checkpoints.sync()
        refused = uploader.checkpoints.newest_refused()
        if refused:  # the pod's exit must not say its step is committed (143, 0)
            log("uploader", f"error: {refused}, the newest step here, is not in S3 (its files do not match its "
                            "manifest); the next pod resumes from the newest step S3 holds")
        _aside("status.json", lambda: uploader.status.end_attempt(exit_code))
        _aside("logs and events", uploader.segments.sync)
        if refused:
            code = s3lib.EXIT_UNAVAILABLE
        else:
            code = 0 if exit_code != 0 or uploader.completion.write() else s3lib.EXIT_UNAVAILABLE
    except LeaseLost as err:
        log("uploader", f"error: {err}; nothing more is uploaded")
        return EXIT_LEASE_LOST
    uploader.writer.let_go()
    log("uploader", f"final upload done in {time.monotonic() - started:.1f}s")
    return code


def _aside(name: str, do) -> None:
    """A part of the final upload that the run does not need: a failure is a warning. S3 being
    gone or the lease lost still end the final upload."""
    try:
        do()
    except (LeaseLost, s3lib.Unavailable):
        raise
    except Exception as err:  # noqa: BLE001 - one line, and the checkpoints and COMPLETE go on
        what = str(err) if isinstance(err, s3lib.BadInput) else repr(err)
        log("uploader", f"warning: {name}: {what}; not uploaded")


def _seconds_setting(name: str, default: str) -> float:
    value = os.environ.get(name, default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise s3lib.BadInput(f"{name}={value} must be a positive number of seconds; fix it in job.yaml")
    return seconds


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("watch", "final") or (argv[0] == "final") != (len(argv) == 4):
        print("usage: uploader.py watch S3_OUTPUT_URI OUTPUT_DIR | final S3_OUTPUT_URI OUTPUT_DIR EXIT_CODE",
              file=sys.stderr)
        return s3lib.EXIT_BAD_INPUT
    run, out = Location.parse(argv[1]), Path(argv[2])

    def run_watch() -> int:
        # Short retry rounds: the loop itself backs off and tries again, forever.
        uploader = Uploader(run, out, retry_seconds=_seconds_setting("UPLOAD_RETRY_SECONDS", "30"))
        return watch(uploader, _seconds_setting("SYNC_INTERVAL_SECONDS", "60"))

    if argv[0] == "watch":
        return s3lib.main_guard("uploader", run_watch)
    return s3lib.main_guard("uploader", lambda: final(Uploader(run, out, s3lib.retry_seconds()), int(argv[3])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
