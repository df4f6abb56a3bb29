"""Growing files in S3, which has no append: TensorBoard's event files and this attempt's log.

    segments = SegmentSync(writer, out, log_file, log_folder)   # log_folder(): logs/<name>, or None
    segments.sync()                      # what each file gained since the last round, as new objects

Putting a growing file whole every round costs the square of its size over a run. So each round
puts only the whole records (an event file's TFRecords, a log's lines) written since the last one,
as an object of their own, FILE.NNNNNNNN or logs/attempt-NNNN-POD/NNNNNNNN.log: the file's next
segment, which sorts after the earlier ones. Each object is written once; TensorBoard reads a
folder's event files in name order as one run, and an attempt's log is its segments in name order.
A file being written never goes up cut mid-record. Other files under tensorboard/ (a projector
config, a profile) go up whole when they change.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import contract
import s3 as s3lib
from run_writer import RunWriter
from s3 import Location

SEGMENT_DIGITS = 8  # a segment a minute for 190 years


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


class SegmentSync:
    def __init__(self, writer: RunWriter, out: Path, log_file: Path | None, log_folder):
        self.writer = writer
        self.events = out / contract.TENSORBOARD_DIR
        self.log_file = log_file
        self.log_folder = log_folder  # () -> this attempt's folder under logs/, None before it has one
        self.growing: dict[str, Growing] = {}  # segment prefix -> what S3 has of that file
        self.whole_sent: dict[str, tuple[int, int]] = {}  # key -> (size, mtime) of what went up whole

    def sync(self) -> None:
        run = self.writer.run
        if self.events.is_dir():
            for path in sorted(p for p in self.events.rglob("*") if p.is_file()):
                key = run.key(contract.TENSORBOARD_DIR, str(path.relative_to(self.events)))
                if ".tfevents." in path.name:  # records only grow: new ones go up as a segment
                    self._put_new_part(path, key + ".", "", whole_records_length)
                else:
                    self._put_whole_if_changed(path, key)
        folder = self.log_folder()
        if self.log_file and self.log_file.is_file() and folder:  # its name needs the attempt
            self._put_new_part(self.log_file, run.key(contract.LOGS_PREFIX + folder) + "/", ".log",
                               lambda path, _start: whole_lines_length(path))

    def _put_whole_if_changed(self, path: Path, key: str) -> None:
        stat = path.stat()
        seen = (stat.st_size, stat.st_mtime_ns)
        if self.whole_sent.get(key) == seen:
            return
        with open(path, "rb") as file:
            body = file.read()
        self.writer.write(self.writer.s3.put_object, Bucket=self.writer.run.bucket, Key=key, Body=body)
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
        self.writer.write(self.writer.s3.put_object, Bucket=self.writer.run.bucket, Key=key, Body=body)
        state.sent, state.segments = state.sent + len(body), state.segments + 1

    def _growing_in_s3(self, prefix: str, suffix: str, size: int) -> Growing:
        """What an earlier process of this pod (a watcher that died, the watcher before `final`)
        put of a file: one listing, once per file and process."""
        listed = s3lib.list_objects(self.writer.s3, Location(self.writer.run.bucket, prefix), self.writer.retry)
        return growing_from_listing([(item["Key"], item["Size"]) for item in listed], prefix, suffix, size)
