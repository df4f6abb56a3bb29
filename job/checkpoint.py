"""Checkpoint folders that count only once they are whole.

The protocol, for any trainer (this module needs only the standard library):

    with checkpoint.stage(root / checkpoint.step_dir_name(step)) as staged:
        with staged.open("model.pt") as f:
            torch.save(model.state_dict(), f)
        staged.commit(meta={"step": step})

Files are written into a hidden staging folder next to the target, fsynced, then `manifest.json`
(every file's size and sha256, plus `meta`) is written last and the folder is renamed into place.
A folder without a manifest, or whose files do not match it, is not a checkpoint: a crash at any
moment leaves either the previous state or a whole new checkpoint.

    newest_valid(root)   the newest step folder that verifies, skipping (and reporting) bad ones
    prune(root, keep)    keep the newest `keep` committed step folders, never the newest one

The pod runtime uploads a folder's files first and `manifest.json` last, so S3 obeys the same rule.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

MANIFEST = "manifest.json"
FORMAT = 1
STEP_DIR = re.compile(r"^step-(\d{8,})$")
STAGING_PREFIX = ".staging-"
_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


class _HashingWriter:
    """A file opened for writing that hashes and counts what goes through it."""

    def __init__(self, file):
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save hides it behind an opaque RuntimeError

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._file.flush()


class Staged:
    """A checkpoint being written. Nothing in it counts until commit() returns."""

    def __init__(self, final: Path):
        self.final = final
        self.path = final.parent / f"{STAGING_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir(parents=True)
        self._entries: dict[str, dict] = {}

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[_HashingWriter]:
        """A writable file in the checkpoint; hashed while written, fsynced when closed."""
        if "/" in name or name == MANIFEST:
            raise ValueError(f"bad checkpoint file name {name!r}")
        with open(self.path / name, "wb") as file:
            writer = _HashingWriter(file)
            try:
                yield writer
                file.flush()
                os.fsync(file.fileno())
            except Exception:
                if writer.error:  # e.g. no space left: say that, not what the serializer made of it
                    raise writer.error from None
                raise
        self._entries[name] = {"size": writer.size, "sha256": writer.sha256.hexdigest()}

    def adopt(self, name: str, entry: dict) -> None:
        """Count a file the caller put in self.path itself (a download), checked against `entry`."""
        problem = verify_file(self.path / name, entry)
        if problem:
            raise ValueError(problem)
        self._entries[name] = dict(entry)

    def add_link(self, source: Path, entry: dict) -> None:
        """Reuse a committed file (a hard link, no copy) whose manifest entry is already known."""
        os.link(source, self.path / source.name)
        self._entries[source.name] = dict(entry)

    def commit(self, meta: dict | None = None, replace: bool = False) -> Path:
        """Write the manifest last, then rename into place. An existing committed folder of the
        same name is kept unless `replace` (then it is swapped out, never left half-deleted)."""
        manifest = {"format": FORMAT, "files": self._entries, "meta": meta or {},
                    "committed_at": time.time()}
        _write_durably(self.path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_dir(self.path)
        retired = None
        if self.final.exists():
            if is_committed(self.final) and not replace:
                _remove_tree(self.path)
                return self.final
            # Renames are atomic; a crash between the two leaves the new folder staged, not torn.
            retired = self.final.parent / f"{STAGING_PREFIX}{self.final.name}-retired-{uuid.uuid4().hex[:8]}"
            os.rename(self.final, retired)
        os.rename(self.path, self.final)
        _fsync_dir(self.final.parent)
        if retired:
            _remove_tree(retired)
        return self.final

    def abandon(self) -> None:
        if self.path.exists():
            _remove_tree(self.path)


@contextlib.contextmanager
def stage(final: Path | str) -> Iterator[Staged]:
    """Write a checkpoint folder atomically; an exception (or no commit) leaves nothing behind."""
    staged = Staged(Path(final))
    try:
        yield staged
    finally:
        staged.abandon()


def read_manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if is_manifest(manifest) else None


def is_manifest(value) -> bool:
    """The shape of a manifest, wherever it was read from: each file with its size and sha256."""
    files = value.get("files") if isinstance(value, dict) else None
    return isinstance(files, dict) and all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
        for e in files.values())


def is_committed(folder: Path) -> bool:
    """Cheap test: the manifest is there and parses. verify() checks the bytes."""
    return read_manifest(folder) is not None


def verify(folder: Path, full: bool = True) -> str | None:
    """None if the folder is a whole checkpoint, else the reason it is not."""
    manifest = read_manifest(folder)
    if manifest is None:
        return f"no readable {MANIFEST}"
    files = sorted(manifest["files"].items())
    # hashlib lets go of the GIL: the files hash side by side (model and optimizer state, say).
    workers = min(len(files), os.cpu_count() or 1) if full else 1
    with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
        problems = pool.map(lambda item: verify_file(folder / item[0], item[1], full), files)
        return next((problem for problem in problems if problem), None)


def verify_file(path: Path, entry: dict, full: bool = True) -> str | None:
    try:
        size = path.stat().st_size
    except OSError:
        return f"{path.name} is missing"
    if size != entry.get("size"):
        return f"{path.name} has {size} bytes, manifest says {entry.get('size')}"
    if full and file_sha256(path) != entry.get("sha256"):
        return f"{path.name} does not match its sha256 in the manifest"
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """Committed step folders, newest first (manifest present; bytes not checked)."""
    if not root.is_dir():
        return []
    found = [(parse_step(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None and is_committed(p)), reverse=True)


def newest_valid(root: Path, on_skip: Callable[[Path, str], None] | None = None) -> Path | None:
    """The newest step folder that verifies in full; each bad one is reported and skipped."""
    for _, folder in committed_steps(Path(root)):
        problem = verify(folder)
        if problem is None:
            return folder
        if on_skip:
            on_skip(folder, problem)
    return None


def prune(root: Path, keep: int) -> list[Path]:
    """Remove committed step folders beyond the newest `keep` (at least the newest stays)."""
    doomed = [p for _, p in committed_steps(Path(root))[max(keep, 1):]]
    for folder in doomed:
        _retire(folder)
    return doomed


def discard(folder: Path) -> None:
    """Remove a checkpoint folder, manifest first, so no crash leaves it looking whole."""
    _retire(folder)


def remove_staging_leftovers(root: Path) -> None:
    """Staging folders of a writer that died mid-save; never a checkpoint, safe to drop."""
    if Path(root).is_dir():
        for path in Path(root).glob(f"{STAGING_PREFIX}*"):
            _remove_tree(path)


def _retire(folder: Path) -> None:
    # Uncommit first (the manifest goes), so a crash mid-delete leaves no folder that looks whole.
    (folder / MANIFEST).unlink(missing_ok=True)
    _fsync_dir(folder)
    _remove_tree(folder)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
