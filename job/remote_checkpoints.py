"""The S3 side of the checkpoint protocol (checkpoint.py is the local side): one place that knows
how a checkpoint is laid out in S3, how it is committed there, read back, uncommitted and pruned.

A step folder under checkpoints/ counts only once its manifest.json is there and passes
checkpoint.manifest_problem: its files go up first, the manifest last, and the manifest goes first
when a step is redone or pruned. Whoever can write the bucket can write a manifest, so it is read
and judged in one place (manifest_of) by every reader.

    committed(s3, ckpts, retry)              step folders S3 lists, newest first
    manifest_of(s3, ckpts, name, retry)      (manifest, problem), judged
    fetch(s3, ckpts, name, manifest, local_root, retry, ranks)   download, verify, commit locally
    ranks_files(manifest, ranks)             a sharded step's files some ranks read (pure)
    put_checkpoint(s3, ckpts, name, handles, manifest_bytes, files, write, still_ours, copies, replaces)
    uncommit(s3, ckpts, name, write)         its manifest goes: no longer committed
    to_prune(listed, keep, ours)             which steps retention removes (pure)
    prune(s3, ckpts, name, keys, write)      remove one step: uncommit first, then the rest

Who calls them decides when and why: restore.py (which step, fallbacks), uploader.py (when, the
lease: every write goes through its `write`, which proves the lease on each try).
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import botocore.exceptions

import checkpoint  # the runtime's own copy of the protocol, never the user's upload
import s3 as s3lib
from s3 import Location, log

DELETE_BATCH = 1000  # the most keys one DeleteObjects takes
READ_CHUNK = 8 << 20  # what a check reads at a time of a file no upload read


# -- reading ---------------------------------------------------------------------------------------

def committed(s3, ckpts: Location, retry) -> list[str]:
    """The step folders S3 lists under `ckpts`, newest first: a listing cannot tell a committed
    one from a half-uploaded one, so each is a candidate until manifest_of says so."""
    return newest_first(s3lib.list_prefixes(s3, ckpts, retry))


def newest_first(names: list[str]) -> list[str]:
    """The names that are step folders (checkpoint.parse_step), the newest step first."""
    steps = [(checkpoint.parse_step(n), n) for n in names]
    return [n for _, n in sorted(((s, n) for s, n in steps if s is not None), reverse=True)]


def manifest_of(s3, ckpts: Location, name: str, retry) -> tuple[dict | None, str | None]:
    """A checkpoint's manifest in S3, judged: (None, None) when there is none (never committed),
    (None, problem) when it is not JSON or too large, else (manifest, checkpoint.manifest_problem)."""
    try:
        manifest, _ = s3lib.get_json(s3, ckpts, ckpts.key(name, checkpoint.MANIFEST), retry)
    except ValueError as damage:
        return None, str(damage)
    if manifest is None:
        return None, None
    return manifest, checkpoint.manifest_problem(manifest, name)  # signed for this folder and run, with a key


# -- fetching ----------------------------------------------------------------------------------

def fetch(s3, ckpts: Location, name: str, manifest: dict, local_root: Path, retry,
          ranks: tuple[int, int, int] | None = None) -> str | None:
    """Download and verify one checkpoint whose manifest passed manifest_of; None when committed
    under local_root/name, else what was wrong. ranks (first, count, world size): of a sharded
    step saved at that world size, only the files those ranks read (ranks_files); the local
    manifest lists the others as absent."""
    where, final = ckpts.child(name), local_root / name
    files = manifest["files"]
    problem = size_problem(files, listed_sizes(s3, where, retry))
    if problem:
        return problem
    wanted = ranks_files(manifest, ranks) if ranks else None
    fetched = {n: e for n, e in files.items() if wanted is None or n in wanted}
    size = sum(entry["size"] for entry in fetched.values())
    final.parent.mkdir(parents=True, exist_ok=True)
    check_room(final, size)
    whose = f" (the files ranks {ranks[0]}..{ranks[0] + ranks[1] - 1} read)" if wanted is not None else ""
    log("restore", f"restoring {final.name}: {len(fetched)} of {len(files)} files, {size / 1e6:.1f} MB{whose}")
    started = time.monotonic()

    def fetch_and_check(file_name: str, entry: dict) -> str | None:
        target = staged.path / file_name
        if target.resolve().parent != staged.path.resolve():  # is_manifest forbids it; never trust one check
            return f"{file_name!a} would be written outside the checkpoint folder"
        try:
            if not retry(_receive_file, s3, where, file_name, staged, entry):
                return f"{file_name} is named in the manifest but missing"
        except ValueError as problem:
            return str(problem)
        return None

    try:
        with checkpoint.stage(final) as staged:
            problem = side_by_side(fetch_and_check, sorted(fetched.items()))
            if problem:
                return problem
            staged.commit(meta=manifest.get("meta"), files=files, absent=sorted(set(files) - set(fetched)))
    except OSError as err:  # staging folder, manifest, renames: this checkpoint cannot be had here
        if err.errno in checkpoint.NO_ROOM:
            raise s3lib.BadInput(f"restore: {s3lib.explain(err, ckpts.bucket)}") from None
        return f"it could not be written here ({err.strerror or type(err).__name__})"
    took = time.monotonic() - started
    log("restore", f"restored {final.name}: {size / 1e6:.1f} MB in {took:.1f}s "
                   f"({size / 1e6 / max(took, 1e-3):.0f} MB/s), verified against its manifest")
    return None


def ranks_files(manifest: dict, ranks: tuple[int, int, int]) -> set[str] | None:
    """The files ranks first..first+count-1 of a group of `world` read, when the manifest is of a
    sharded step saved at that world size (train.py under FSDP: meta "shards"); else None, all of
    them. The manifest is judged already; what its meta says is checked here."""
    first, count, world = ranks
    shards = manifest.get("meta", {}).get("shards")
    if not isinstance(shards, dict) or shards.get("world_size") != world:
        return None
    reads, common, files = shards.get("reads"), shards.get("common"), manifest["files"]
    if not (isinstance(reads, list) and len(reads) == world and isinstance(common, list)
            and all(isinstance(r, list) for r in reads)):
        return None
    named = [common, *reads[first:first + count]]
    if not all(isinstance(n, str) for names in named for n in names):  # a forged meta may hold anything
        return None
    wanted = set().union(*named)
    return wanted if all(n in files for n in wanted) else None


def listed_sizes(s3, where: Location, retry) -> dict[str, int]:
    """Each object of a checkpoint folder in S3 and its size, from one listing."""
    return {item["Key"][len(where.prefix):]: item["Size"] for item in s3lib.list_objects(s3, where, retry)}


def size_problem(files: dict[str, dict], sizes: dict[str, int]) -> str | None:
    """What the listing says is wrong with a checkpoint, before any byte is fetched."""
    for name, entry in sorted(files.items()):
        if name not in sizes:
            return f"{name} is named in the manifest but missing"
        if sizes[name] != entry["size"]:
            return f"{name} has {sizes[name]} bytes in S3, manifest says {entry['size']}"
    return None


def check_room(final: Path, size: int) -> None:
    """Bad input when the checkpoint cannot fit: a full disk no retry makes room on."""
    free = shutil.disk_usage(final.parent).free
    if size > free:
        raise s3lib.BadInput(f"checkpoint {final.name} needs {size / 1e6:.1f} MB, {free / 1e6:.1f} MB free in "
                             f"{final.parent}; give the workspace volume more room (emptyDir sizeLimit)")


def side_by_side(work, items: list[tuple[str, dict]], workers: int = 4) -> str | None:
    """work(name, entry) for every item, a few at a time (files download side by side, each with
    its own parts side by side). The first problem in name order wins, as one after another would
    have it, and after any problem no further file is started (a damaged checkpoint costs no more
    bytes)."""
    failed = threading.Event()

    def guarded(name: str, entry: dict) -> str | None:
        if failed.is_set():
            return f"{name} not fetched: another file failed"  # never the first problem in name order
        try:
            problem = work(name, entry)
        except BaseException:
            failed.set()
            raise
        if problem:
            failed.set()
        return problem

    with ThreadPoolExecutor(max_workers=max(1, min(len(items), workers))) as pool:
        futures = [pool.submit(guarded, name, entry) for name, entry in items]
    for future in futures:
        problem = future.result()  # raises the error of the first file, in name order, that had one
        if problem:
            return problem
    return None


def _receive_file(s3, where: Location, name: str, staged: checkpoint.Staged, entry: dict) -> bool:
    """One attempt: the whole file again, in order, hashed as it comes (s3transfer puts the parts
    it fetched side by side back in order for a stream). Not fsynced: S3 holds the checkpoint, and
    every start hashes the local copy before it counts (restore.py); the disk's writes then go on
    while the trainer starts (1.5 GB: about 2 s less here, docs/performance.md)."""
    try:
        with staged.receive(name, entry, durable=False) as stream:
            s3.download_fileobj(where.bucket, where.key(name), stream, Config=s3lib.IN_ORDER)
    except botocore.exceptions.ClientError as err:
        if s3lib.not_found(err):
            return False
        raise
    return True


# -- writing: every call goes through the caller's `write(call, *args, **kwargs)` ------------------

class NotAsCommitted(ValueError):
    """A local file's bytes are not those its manifest names (a disk that lost or changed them
    after the commit): the checkpoint is not committed in S3."""


def put_checkpoint(s3, ckpts: Location, name: str, handles: dict, manifest_bytes: bytes, files: dict, write,
                   still_ours, copies: dict[str, str] | None = None, replaces: bool = False) -> None:
    """Commit a checkpoint in S3: its files first (handles: file name -> open file), manifest.json
    last, so S3 never shows half of one as committed. files: the manifest's entries. Each file is
    hashed as s3transfer reads it to send it, and the manifest goes only once every file sent
    matched its entry (else NotAsCommitted, and S3 holds files that no manifest counts).
    replaces: S3 has this step committed with other bytes (a redone step); its manifest goes
    first, and only once every file here has been read, hashed and matched (S3's copy is never
    traded for a damaged one); the upload then hashes what it sends again.
    copies: file name -> the key of the same bytes already in S3 (checked as they went up), copied
    inside S3 instead of uploaded. still_ours(bytes) is called as the bytes go (every 256 KB or
    so): a part that outlasts the lease stops, and s3transfer aborts the multipart upload."""
    copies = copies or {}
    sent = {file_name: _CheckedReader(handle, file_name, files.get(file_name, {}))
            for file_name, handle in handles.items() if file_name not in copies}
    if replaces:
        _raise_any_problem(sent.values())
        uncommit(s3, ckpts, name, write)
    for file_name, handle in handles.items():
        _put_file(s3, ckpts, ckpts.key(name, file_name), sent.get(file_name, handle), write, still_ours,
                  copies.get(file_name))
    _raise_any_problem(sent.values())
    write(s3.put_object, Bucket=ckpts.bucket, Key=ckpts.key(name, checkpoint.MANIFEST), Body=manifest_bytes,
          ContentType="application/json")


def _raise_any_problem(readers) -> None:
    for reader in readers:
        problem = reader.problem()
        if problem:
            raise NotAsCommitted(problem)


class _CheckedReader:
    """A committed file as s3transfer reads it to upload it, hashed on the way. s3transfer reads a
    part at a time from the front; botocore reads a single PutObject's body for its checksum, then
    from the start again to send it, and a retry starts over too: a seek to the start begins the
    hash anew, so the pass that counts is the last, the one sent. Bytes read again without that
    seek are not added twice. problem() hashes whatever was not read (nothing, after an upload)
    and compares with the manifest's entry."""

    def __init__(self, handle, name: str, entry: dict):
        self._handle, self._name, self._entry = handle, name, entry
        self._sha256, self._hashed = hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        start = self._handle.tell()
        data = self._handle.read(size)
        if start <= self._hashed < start + len(data):
            self._sha256.update(memoryview(data)[self._hashed - start:])
            self._hashed = start + len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        position = self._handle.seek(offset, whence)
        if position == 0:
            self._sha256, self._hashed = hashlib.sha256(), 0
        return position

    def tell(self) -> int:
        return self._handle.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        """Kept open: s3transfer closes the body of a single PutObject, and the file is still to be
        checked (problem()), or sent again by a retry; its opener closes it."""

    def problem(self) -> str | None:
        where = self._handle.tell()
        self._handle.seek(self._hashed)  # the file's own seek: what was hashed stays
        while self.read(READ_CHUNK):
            pass
        self._handle.seek(where)
        digest = self._sha256.hexdigest()
        return checkpoint.entry_problem(self._name, self._hashed, self._entry, lambda: digest)


def _put_file(s3, ckpts: Location, key: str, handle, write, still_ours, source: str | None) -> None:
    if source:  # best/ is a step that is already up: copy inside S3
        write(s3.copy, {"Bucket": ckpts.bucket, "Key": source}, ckpts.bucket, key, Config=s3lib.TRANSFER,
              Callback=still_ours)
        return

    def put():
        handle.seek(0)  # a retry sends the file from its start
        s3.upload_fileobj(handle, ckpts.bucket, key, Config=s3lib.TRANSFER, Callback=still_ours)

    write(put)


def uncommit(s3, ckpts: Location, name: str, write) -> None:
    """Its manifest goes, first of all: from then on the step is not committed in S3, whatever
    of its files is left."""
    write(s3.delete_object, Bucket=ckpts.bucket, Key=ckpts.key(name, checkpoint.MANIFEST))


# -- retention ---------------------------------------------------------------------------------

def to_prune(listed: list[str], keep: int, ours: set[int]) -> list[tuple[str, list[str]]]:
    """The step folders retention removes, oldest first, each with its keys (listed: every key
    under checkpoints/, relative to it). Kept: the newest `keep` committed steps (at least the
    newest), the steps in `ours` (this pod's own line: what it restored from and trained since;
    a newer step in S3 may be one whose files are damaged), and anything newer than the newest
    committed step (an upload under way). Removed: pruned steps, and leftovers of uploads that a
    dead pod never finished (no manifest)."""
    by_step: dict[int, list[str]] = {}
    committed_steps = set()
    for key in listed:
        name, _, rest = key.partition("/")
        step = checkpoint.parse_step(name)
        if step is None:
            continue
        by_step.setdefault(step, []).append(key)
        if rest == checkpoint.MANIFEST:
            committed_steps.add(step)
    if not committed_steps:
        return []
    kept = sorted(committed_steps, reverse=True)[:max(keep, 1)]
    newest = kept[0]
    doomed = [s for s in by_step if s not in kept and s not in ours and s < newest]
    return [(checkpoint.step_dir_name(s), by_step[s]) for s in sorted(doomed)]


def prune(s3, ckpts: Location, name: str, keys: list[str], write) -> None:
    """Remove one step folder (keys relative to `ckpts`, as to_prune gives them): uncommit first,
    so a half-deleted folder never looks whole."""
    manifest = f"{name}/{checkpoint.MANIFEST}"
    if manifest in keys:
        uncommit(s3, ckpts, name, write)
    rest = [{"Key": ckpts.key(k)} for k in keys if k != manifest]
    for start in range(0, len(rest), DELETE_BATCH):
        batch = rest[start:start + DELETE_BATCH]
        write(s3.delete_objects, Bucket=ckpts.bucket, Delete={"Objects": batch, "Quiet": True})
