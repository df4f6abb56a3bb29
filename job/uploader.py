"""Put what the trainer commits into S3 as it happens, and the rest when the pod ends.

    python uploader.py watch S3_OUTPUT_URI OUTPUT_DIR             # in the background, until SIGTERM
    python uploader.py final S3_OUTPUT_URI OUTPUT_DIR EXIT_CODE   # once, from the EXIT trap

Checkpoints: a newly committed local folder goes up within seconds, its files first and
manifest.json last, so S3 never shows half a checkpoint as committed. A step already in S3 with
other bytes (a redone step) is uncommitted first. S3 keeps what the trainer keeps: the newest
`keep` committed folders plus best/ (copied server-side when it is a step already in S3); the
newest is never deleted.

Every SYNC_INTERVAL_SECONDS: what the TensorBoard event files (up to their last whole record: a
file being written never goes up cut mid-record) and this attempt's log (up to its last whole line)
gained since the last round, each as a new object (FILE.NNNNNNNN, logs/attempt-NNNN-POD/NNNNNNNN.log),
and status.json, the run's state for scripts/status.py. `final` does one last round (a failed
attempt keeps the pod's last error line, contract.POD_ERROR, as its "error"); after exit code 0 it
writes COMPLETE, last of all, once the trainer's last step is in S3 (the step progress.json reports
as max_steps; for a trainer that writes no progress.json, its newest committed step); with
CHECKPOINT_HMAC_KEY set, signed for this run (checkpoint.signed_complete).

Checkpoints come first and depend on nothing else: status.json and the growing files each fail on
their own (a warning, a backoff of their own). A status.json in S3 that is not what this uploader
writes counts as empty, with one warning, and is replaced. A restarted watcher (the pod restarts
one that died) carries on this pod's attempt.

Every write first proves the pod still holds the run's lease (lease.py). S3 outages: the watcher
retries with exponential backoff and jitter forever (training never waits on it); `final` gives up
after S3_RETRY_SECONDS with exit 75.

Environment: SYNC_INTERVAL_SECONDS (60), UPLOAD_RETRY_SECONDS (30: one round of the watcher's
retries), S3_RETRY_SECONDS (600: `final`'s), LOG_FILE, STATE_DIR (lease and attempt), HEALTH_FILE,
HOSTNAME.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path


import checkpoint  # the runtime's own copy of the protocol, never the user's upload
import contract
import remote_checkpoints
import s3 as s3lib
from lease import Keeper, Lease, LeaseLost
from s3 import Location, log


POLL_SECONDS = 1.0
MAX_ERROR = 300  # characters of an attempt's error line in status.json
SEGMENT_DIGITS = 8  # a segment a minute for 190 years
EXIT_LEASE_LOST = contract.EXIT_LEASE_LOST


def whole_records_length(path: Path, offset: int = 0) -> int:
    """Bytes of an event file up to its last complete TFRecord (length, crc, data, crc),
    scanning on from `offset`, a record boundary found before (event files only grow)."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        while offset + 12 <= size:
            file.seek(offset)
            (length,) = struct.unpack("<Q", file.read(8))
            end = offset + 12 + length + 4
            if end > size:
                break
            offset = end
    return offset


def whole_lines_length(path: Path, tail: int = 1 << 20) -> int:
    """Bytes of a log up to its last complete line."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        file.seek(max(0, size - tail))
        chunk = file.read(size - file.tell())
    cut = chunk.rfind(b"\n")
    return size - len(chunk) + cut + 1 if cut >= 0 else 0


@dataclass
class Growing:
    """A growing file as S3 holds it: `segments` objects with `sent` of its bytes."""

    sent: int = 0
    segments: int = 0  # the next segment's number
    inode: int | None = None  # of the file those bytes came from, once this process has seen it


def segment_key(prefix: str, number: int, suffix: str) -> str:
    """Fixed-width numbers: S3 lists, and TensorBoard reads, names in byte order."""
    return f"{prefix}{number:0{SEGMENT_DIGITS}d}{suffix}"


def growing_from_listing(listed: list[tuple[str, int]], prefix: str, suffix: str, size: int) -> Growing:
    """Where a file's upload stands, from the (key, size) S3 lists under its prefix: the next
    segment comes after the highest there, and carries on from the bytes they hold; when they hold
    more than the file has, it was replaced (a restarted log): its bytes start anew. Other keys
    under the prefix (another file whose name starts alike) are not its segments."""
    pattern = re.compile(re.escape(prefix) + rf"([0-9]{{{SEGMENT_DIGITS},}}){re.escape(suffix)}")
    numbers, sent = [], 0
    for key, length in listed:
        match = pattern.fullmatch(key)
        if match:
            numbers.append(int(match.group(1)))
            sent += length
    return Growing(sent=sent if sent <= size else 0, segments=max(numbers, default=-1) + 1)


def part_start(sent: int, inode: int | None, size: int, current_inode: int) -> int:
    """Where the next segment starts in the file: after what S3 has, or at 0 when the file was
    replaced (another inode) or cut (shorter than what went up)."""
    if (inode is not None and current_inode != inode) or size < sent:
        return 0
    return sent


class Uploader:
    def __init__(self, run: Location, out: Path, retry_seconds: float):
        self.s3 = s3lib.client()
        self.run = run
        self.out = out
        self.ckpts = run.child("checkpoints")
        self.retry = s3lib.retrying("upload", run.bucket, seconds=retry_seconds, name="uploader")
        self.state_dir = Path(os.environ.get("STATE_DIR", out / ".pod"))
        self.log_file = Path(os.environ["LOG_FILE"]) if os.environ.get("LOG_FILE") else None
        self.growing: dict[str, Growing] = {}  # segment prefix -> what S3 has of that file
        self.whole_sent: dict[str, tuple[int, int]] = {}  # key -> (size, mtime) of what went up whole
        self.retention_checked = False
        self.remote: dict[str, dict | None] = {}  # checkpoint name -> its manifest's files in S3
        self.partial_seen: set[str] = set()  # partial local copies already warned of
        self.keeper: Keeper | None = None
        self.attempt: dict = {}
        self.attempts: list[dict] = []

    # -- the lease ------------------------------------------------------------------------------

    def hold_lease(self) -> None:
        # The lease renews through a client of its own: this one's writes wait on the lease, its
        # renewals must not.
        self.keeper = Keeper(Lease.load(s3lib.client(), self.run, self.state_dir / "lease.json"))
        self.keeper.start()
        # Every request that can change what S3 shows goes out only while the lease is fresh, each
        # of botocore's own retries and each part of a multipart upload included: a check at the
        # start of a write alone would let a long upload run on past another pod's takeover.
        for operation in ("PutObject", "UploadPart", "CompleteMultipartUpload", "CopyObject", "UploadPartCopy",
                          "DeleteObject", "DeleteObjects"):
            self.s3.meta.events.register(f"before-send.s3.{operation}", lambda **_: self.keeper.check())

    def may_write(self) -> None:
        self.keeper.check(self.retry)

    def write(self, call, *args, **kwargs):
        """A write to S3, retried; each try first proves this pod still holds the run's lease, so
        no retry outlives it."""
        def attempt():
            self.may_write()
            return call(*args, **kwargs)

        return self.retry(attempt)

    # -- checkpoints -----------------------------------------------------------------------------

    def sync_checkpoints(self) -> None:
        local = checkpoint.committed_steps(self.out / "checkpoints")
        if not local:
            return
        keep = _keep_of(local[0][1])
        uploaded = [self.upload_checkpoint(folder) for _, folder in local[:keep]]
        best = self.out / "checkpoints" / "best"
        if checkpoint.is_committed(best):
            self.upload_checkpoint(best)
        if any(uploaded) or not self.retention_checked:
            self.apply_retention(keep)
            self.retention_checked = True

    def remote_files(self, name: str) -> dict | None:
        """The files S3's manifest of a checkpoint lists; None when not committed there, {} when
        its manifest is damaged (then the local one replaces it)."""
        if name not in self.remote:
            manifest, problem = remote_checkpoints.manifest_of(self.s3, self.ckpts, name, self.retry)
            if manifest is None and problem is None:
                self.remote[name] = None
            else:
                self.remote[name] = {} if problem else manifest["files"]
        return self.remote[name]

    def upload_checkpoint(self, folder: Path) -> bool:
        """True when the folder went up now; False when S3 had it already or it is gone."""
        manifest_bytes = _read_or_none(folder / checkpoint.MANIFEST)
        if manifest_bytes is None:
            return False  # pruned by the trainer meanwhile: a newer one exists
        manifest = json.loads(manifest_bytes)
        if self.remote_files(folder.name) == manifest["files"]:
            return False
        if checkpoint.absent_files(manifest):  # a node's part of a step restored from S3: never uploaded
            if folder.name not in self.partial_seen:
                self.partial_seen.add(folder.name)
                log("uploader", f"warning: {folder.name} here holds only this node's shard files and S3 no "
                                "longer has it whole; it is not uploaded")
            return False
        handles = _open_all(folder, manifest["files"])
        if handles is None:
            return False
        if _read_or_none(folder / checkpoint.MANIFEST) != manifest_bytes:  # best/ swapped meanwhile
            for handle in handles.values():
                handle.close()
            return False
        started = time.monotonic()
        try:
            if self.remote_files(folder.name) is not None:
                self._uncommit(folder.name)
            # Called as the bytes go: a part that takes longer than ttl/2 to send stops once the
            # lease is lost.
            still_ours = lambda _bytes: self.keeper.check()  # noqa: E731
            remote_checkpoints.put_checkpoint(self.s3, self.ckpts, folder.name, handles, manifest_bytes,
                                              self.write, still_ours, self._same_bytes_in_s3(folder.name, manifest))
        finally:
            for handle in handles.values():
                handle.close()
        self.remote[folder.name] = manifest["files"]
        size = sum(e["size"] for e in manifest["files"].values())
        took = time.monotonic() - started
        log("uploader", f"{folder.name} is in S3: {size / 1e6:.1f} MB in {took:.1f}s "
                        f"({size / 1e6 / max(took, 1e-3):.0f} MB/s), manifest last")
        contract.event("uploaded", "uploader", name=folder.name, step=checkpoint.parse_step(folder.name),
                       bytes=size, seconds=round(took, 3))
        return True

    def _same_bytes_in_s3(self, folder_name: str, manifest: dict) -> dict[str, str]:
        """best/'s files that the step it is a copy of already has in S3: file name -> key."""
        meta = manifest.get("meta")
        step = meta.get("step") if isinstance(meta, dict) else None
        if checkpoint.parse_step(folder_name) is not None or not isinstance(step, int) or step < 0:
            return {}
        source = checkpoint.step_dir_name(step)
        remote = self.remote_files(source)
        return {name: self.ckpts.key(source, name) for name, entry in manifest["files"].items()
                if remote and remote.get(name) == entry}

    def _uncommit(self, name: str) -> None:
        remote_checkpoints.uncommit(self.s3, self.ckpts, name, self.write)
        self.remote[name] = None

    def apply_retention(self, keep: int) -> None:
        objects = s3lib.list_objects(self.s3, self.ckpts, self.retry)
        listed = [item["Key"][len(self.ckpts.prefix):] for item in objects]
        ours = {s for s, _ in checkpoint.committed_steps(self.out / "checkpoints")}
        for name, keys in remote_checkpoints.to_prune(listed, keep, ours):
            self.remote.pop(name, None)  # forgotten first: what S3 holds of it is read again if asked
            remote_checkpoints.prune(self.s3, self.ckpts, name, keys, self.write)
            log("uploader", f"retention: removed {name} from S3")

    # -- growing files ---------------------------------------------------------------------------
    # S3 has no append, and putting a growing file whole every round costs the square of its size
    # over a run. So each round puts only the whole records (lines) written since the last one, as
    # an object of their own: the file's next segment, which sorts after its earlier ones. Each
    # object is written once; TensorBoard reads a folder's event files in name order as one run,
    # and an attempt's log is its segments in name order.

    def sync_growing_files(self) -> None:
        events = self.out / "tensorboard"
        if events.is_dir():
            for path in sorted(p for p in events.rglob("*") if p.is_file()):
                key = self.run.key("tensorboard", str(path.relative_to(events)))
                if ".tfevents." in path.name:  # records only grow: new ones go up as a segment
                    self._put_new_part(path, key + ".", "", whole_records_length)
                else:  # a projector config, a profile: whole, when it changed
                    self._put_whole_if_changed(path, key)
        if self.log_file and self.log_file.is_file() and self.attempt:  # its name needs the attempt
            self._put_new_part(self.log_file, self.run.key("logs", self.log_name()) + "/", ".log",
                               lambda path, _start: whole_lines_length(path))

    def _put_whole_if_changed(self, path: Path, key: str) -> None:
        stat = path.stat()
        seen = (stat.st_size, stat.st_mtime_ns)
        if self.whole_sent.get(key) == seen:
            return
        with open(path, "rb") as file:
            body = file.read()
        self.write(self.s3.put_object, Bucket=self.run.bucket, Key=key, Body=body)
        self.whole_sent[key] = seen

    def _put_new_part(self, path: Path, prefix: str, suffix: str, whole_length) -> None:
        """Put the file's bytes from what S3 has of it up to its last whole record (line), as its
        next segment; nothing (no request) when there is none."""
        state = self.growing.get(prefix)
        if state is None:  # first sight in this process: S3 says how far an earlier one got
            state = self.growing[prefix] = self._growing_in_s3(prefix, suffix, path.stat().st_size)
        stat = path.stat()
        state.sent = part_start(state.sent, state.inode, stat.st_size, stat.st_ino)
        state.inode = stat.st_ino
        length = whole_length(path, state.sent)
        if length <= state.sent:
            return
        with open(path, "rb") as file:
            file.seek(state.sent)
            body = file.read(length - state.sent)
        key = segment_key(prefix, state.segments, suffix)
        self.write(self.s3.put_object, Bucket=self.run.bucket, Key=key, Body=body)
        state.sent, state.segments = state.sent + len(body), state.segments + 1

    def _growing_in_s3(self, prefix: str, suffix: str, size: int) -> Growing:
        """What an earlier process of this pod (a watcher that died, the watcher before `final`)
        put of a file: one listing, once per file and process."""
        listed = s3lib.list_objects(self.s3, Location(self.run.bucket, prefix), self.retry)
        return growing_from_listing([(item["Key"], item["Size"]) for item in listed], prefix, suffix, size)

    def log_name(self) -> str:
        """This attempt's log folder under logs/: its segments are NNNNNNNN.log."""
        return f"attempt-{self.attempt.get('attempt', 0):04d}-{self.attempt.get('pod', 'pod')}"

    # -- status ------------------------------------------------------------------------------------

    def begin_attempt(self) -> None:
        """Number this pod's attempt in status.json; earlier ones that never ended were lost."""
        attempts = self._attempts_in_s3()
        for old in attempts:
            if old.get("ended_at") is None:
                old.update(ended_at=old.get("heartbeat_at") or old.get("started_at"), exit_code=None, lost=True)
        now = time.time()
        self.attempt = {"attempt": len(attempts) + 1, "pod": _pod_name(),
                        "started_at": now, "heartbeat_at": now, "ended_at": None, "exit_code": None,
                        "start_step": None, "end_step": None}
        attempts.append(self.attempt)
        self.attempts = attempts
        (self.state_dir / "attempt.json").write_text(json.dumps(attempts))
        self.write_status("starting")

    def _attempts_in_s3(self) -> list[dict]:
        try:
            status, _ = s3lib.get_json(self.s3, self.run, self.run.key("status.json"), self.retry)
            attempts = attempts_in(status)
        except ValueError:  # not JSON
            attempts = None
        if attempts is None:
            log("uploader", f"warning: {self.run}status.json is damaged (not the JSON this uploader writes): "
                            "it counts as empty (earlier attempts are forgotten) and is replaced")
            return []
        return attempts

    def resume_attempt(self) -> None:
        """This pod's attempt, begun by its watcher (before a restart, or before `final`); or begin
        it now if S3 was down the whole time."""
        attempts = open_attempts(_read_json(self.state_dir / "attempt.json"), _pod_name())
        if attempts is None:
            self.begin_attempt()
            return
        self.attempts, self.attempt = attempts, attempts[-1]

    def report(self, state: str) -> None:
        """status.json, for the attempt this pod began or carries on."""
        if not self.attempt:
            self.resume_attempt()
        self.write_status(state)

    def write_status(self, state: str) -> None:
        progress = self.progress()
        if progress and self.attempt.get("start_step") is None:
            self.attempt["start_step"] = progress.get("start_step", progress.get("step"))
        self.attempt["end_step"] = progress.get("step", self.attempt.get("end_step"))
        self.attempt["heartbeat_at"] = _heartbeat_time()
        newest = checkpoint.committed_steps(self.out / "checkpoints")
        status = {"state": state, "attempt": self.attempt["attempt"], "pod": self.attempt["pod"],
                  "started_at": self.attempt["started_at"], "heartbeat_at": self.attempt["heartbeat_at"],
                  "updated_at": time.time(), "progress": progress,
                  "committed_step": max((s for s, _ in newest), default=None),
                  "attempts": self.attempts}
        s3lib.put_json(self.s3, self.run, self.run.key("status.json"), status, self.write)
        (self.state_dir / "attempt.json").write_text(json.dumps(self.attempts))

    def progress(self) -> dict:
        """What the trainer last reported; {} when it reports nothing (a trainer of one's own)."""
        progress = _read_json(self.out / "progress.json")
        return progress if isinstance(progress, dict) else {}

    def write_complete(self) -> bool:
        progress = self.progress()
        newest = max((s for s, _ in checkpoint.committed_steps(self.out / "checkpoints")), default=None)
        last, why = step_to_complete(progress, newest)
        if last is not None and self.remote_files(checkpoint.step_dir_name(last)) is None:
            last, why = None, f"step {last} is not in S3"
        if last is None:
            log("uploader", f"not writing COMPLETE: {why}")
            return False
        seconds = sum((a.get("ended_at") or time.time()) - a["started_at"] for a in self.attempts)
        summary = {"steps": last, "train_loss": progress.get("train_loss"), "val_loss": progress.get("val_loss"),
                   "best_val_loss": progress.get("best_val_loss"), "best_step": progress.get("best_step"),
                   "attempts": len(self.attempts) or 1, "wall_seconds": round(seconds, 1),
                   "completed_at": time.time(), "pod": self.attempt.get("pod", _pod_name())}
        summary = checkpoint.signed_complete(summary)  # with CHECKPOINT_HMAC_KEY: bound to this run, signed
        log("uploader", "writing COMPLETE...")
        contract.event("complete", "uploader", state="writing", step=last)
        s3lib.put_json(self.s3, self.run, self.run.key(contract.COMPLETE_KEY), summary, self.write)
        log("uploader", f"wrote {self.run}COMPLETE: {json.dumps({k: v for k, v in summary.items() if k != 'hmac'})}")
        contract.event("complete", "uploader", state="written", step=last)
        return True


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
    uploader.hold_lease()
    chores = [Chore("checkpoints", uploader.sync_checkpoints, 0.0),
              Chore("status.json", lambda: uploader.report("running"), interval),
              Chore("logs and events", uploader.sync_growing_files, interval)]
    while not stopping.is_set():
        try:
            pause = run_round(chores, stopping)
        except LeaseLost as err:
            log("uploader", f"error: {err}")
            os.kill(os.getppid(), signal.SIGTERM)  # the bootstrap stops the trainer
            return EXIT_LEASE_LOST
        stopping.wait(pause)
    uploader.keeper.stop()
    uploader.keeper.join(timeout=5)  # not mid-renewal when `final` takes over
    return 0


def final(uploader: Uploader, exit_code: int) -> int:
    """The checkpoints left, then the attempt's end in status.json and the log, then COMPLETE; then
    the lease goes. Only the checkpoints and COMPLETE decide the exit code."""
    uploader.hold_lease()
    started = time.monotonic()

    def end_attempt() -> None:
        if not uploader.attempt:
            uploader.resume_attempt()
        uploader.attempt.update(ended_at=time.time(), exit_code=exit_code)
        error = last_error(uploader.state_dir) if exit_code != 0 else None
        if error:
            uploader.attempt["error"] = error
        uploader.write_status(_state_for(exit_code))

    try:
        uploader.sync_checkpoints()
        _aside("status.json", end_attempt)
        _aside("logs and events", uploader.sync_growing_files)
        code = 0 if exit_code != 0 or uploader.write_complete() else s3lib.EXIT_UNAVAILABLE
    except LeaseLost as err:
        log("uploader", f"error: {err}; nothing more is uploaded")
        return EXIT_LEASE_LOST
    uploader.keeper.stop()
    try:
        uploader.keeper.lease.release(uploader.retry)
    except (s3lib.BadInput, s3lib.Unavailable) as err:  # everything is up: the lease lapses in its TTL
        log("uploader", f"warning: the lease was not released ({err}); the next pod waits out its TTL")
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


def last_error(state_dir: Path) -> str | None:
    """The pod's last error line (script.sh writes it: contract.POD_ERROR), for the attempt that
    ends: why it failed, in status.json, where a retry of the same crash would otherwise say only
    its exit code. One line, control characters escaped, at most MAX_ERROR characters."""
    text = _read_or_none(state_dir / contract.POD_ERROR)
    if not text:
        return None
    line = " ".join(text.decode("utf-8", "replace").split())
    line = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in line)
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


def step_to_complete(progress: dict, newest_local: int | None) -> tuple[int | None, str]:
    """The step S3 must hold for COMPLETE after the trainer exited 0, or None and why not: the last
    step when progress.json reports one (max_steps), else the newest step the trainer committed
    (a trainer of one's own need not write progress.json)."""
    step, last = progress.get("step"), progress.get("max_steps")
    if _is_int(step) and _is_int(last):
        # Past the last step: a run restored from a checkpoint beyond a lowered max_steps is done.
        return (step, "") if step >= last else (None, f"the trainer reported step {step} of {last}")
    if newest_local is None:
        return None, "the trainer committed no checkpoint"
    return newest_local, ""


def _is_attempt(value) -> bool:
    return (isinstance(value, dict) and _is_number(value.get("started_at"))
            and all(value.get(k) is None or _is_number(value[k]) for k in ("ended_at", "heartbeat_at")))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pod_name() -> str:
    return os.environ.get("HOSTNAME", "pod")


def _seconds_setting(name: str, default: str) -> float:
    value = os.environ.get(name, default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise s3lib.BadInput(f"{name}={value} must be a positive number of seconds; fix it in job.yaml")
    return seconds


def _state_for(exit_code: int) -> str:
    if exit_code == 0:
        return "completed"
    if exit_code in (contract.EXIT_SIGINT, contract.EXIT_SIGTERM, contract.EXIT_PEER_LOST):
        return "interrupted"  # 138: a group stopped for a peer's sake, this pod did nothing wrong
    return "failed"


def _keep_of(folder: Path) -> int:
    """The trainer's checkpoint.keep, which it records in each manifest (3 when it records none
    that makes sense: a trainer of one's own may write anything there)."""
    manifest = checkpoint.read_manifest(folder) or {}
    meta = manifest.get("meta")
    keep = meta.get("keep") if isinstance(meta, dict) else None
    return keep if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1 else 3


def _heartbeat_time() -> float:
    path = os.environ.get("HEALTH_FILE")
    try:
        return os.stat(path).st_mtime if path else time.time()
    except OSError:
        return time.time()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _open_all(folder: Path, files: dict) -> dict | None:
    """Open every file first: the trainer may prune the folder meanwhile, open files stay readable."""
    handles = {}
    try:
        for name in sorted(files):
            handles[name] = open(folder / name, "rb")
    except OSError:
        for handle in handles.values():
            handle.close()
        return None
    return handles


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
