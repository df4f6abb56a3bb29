"""Checkpoint folders that count only once they are whole (standard library only, for any trainer).

    with checkpoint.stage(root / checkpoint.step_dir_name(step)) as staged:
        with staged.open("model.pt") as f:
            torch.save(model.state_dict(), f)
        staged.commit(meta={"step": step})

    newest_valid(root)   the newest step folder that verifies, skipping (and reporting) bad ones;
                         verified=read_verified(os.environ.get("RESTORE_VERIFIED_FILE")): the
                         folder the pod's restore just hashed is checked by size only
    prune(root, keep)    keep the newest `keep` committed step folders, never the newest one

Files go into a hidden staging folder, fsynced; manifest.json (each file's size and sha256, and
`meta`) is written last and the folder renamed into place, so a crash leaves the previous state or
a whole new checkpoint (or, for a file written with durable=False, one a power cut may have torn,
which verify() finds); the pod uploads manifest.json last too. Several processes may write one
(FSDP shards: Staged(final, path=folder), add_written()). A manifest may come from a bucket others
can write: every reader holds it to manifest_problem's rule, and with CHECKPOINT_HMAC_KEY set it
counts only signed for its folder and this run (COMPLETE alike: signed_complete, complete_problem).
docs/own-trainer.md and docs/security.md have the details.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
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
KNOWN_FORMATS = (1,)
HMAC_KEY_ENV = "CHECKPOINT_HMAC_KEY"
RUN_ENV = "S3_OUTPUT_URI"  # the run a signature binds (the pod exports it; unset outside a pod)
MAX_COMPLETE_BYTES = 64 << 10  # a COMPLETE is a few hundred bytes; anyone who may write the bucket may write it
# 8 to 12 digits: a trillion steps, and a name far from any file system's limit (a name of
# hundreds of digits in a bucket made the staging folder's name too long for the disk).
STEP_DIR = re.compile(r"step-([0-9]{8,12})")
STAGING_PREFIX = ".staging-"
MAX_NAME_LENGTH = 255  # what Linux file systems allow in one name
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    # fullmatch and [0-9]: no trailing newline ($ allows one), no non-ASCII digits (\d, int() take them).
    match = STEP_DIR.fullmatch(name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None


# The pod's own JSON nests 5 deep. Python's parser takes about 1,000 levels, and code that walks what
# it parsed (json.dumps for a signature, repr) recurses deeper than that and fails.
JSON_MAX_DEPTH = 64


class TooDeep(ValueError):
    """JSON nested deeper than JSON_MAX_DEPTH."""


def untrusted_json(raw: bytes | str):
    """json.loads for what S3 or another process handed over: ValueError when it is not JSON,
    TooDeep when it nests deeper than JSON_MAX_DEPTH (checked a level at a time, containers only)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise TooDeep("nested deeper than the parser goes") from None
    level, depth = ([value] if isinstance(value, (dict, list)) else []), 0
    while level:
        depth += 1
        if depth > JSON_MAX_DEPTH:
            raise TooDeep(f"nested deeper than {JSON_MAX_DEPTH} levels")
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
    return value


def is_file_name(name) -> bool:
    """A name a checkpoint may hold: one plain file in its folder, never a path out of it."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME_LENGTH and name.isascii()
            and name.isprintable() and "/" not in name and "\\" not in name
            and name not in (".", "..", MANIFEST))


class _HashingWriter:
    """A file opened for writing that hashes and counts what goes through it."""

    def __init__(self, file, name: str = "", limit: int | None = None):
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save hides it behind an opaque RuntimeError
        self._name, self._limit = name, limit

    def write(self, data) -> int:
        if self._limit is not None and self.size + len(data) > self._limit:
            # An object replaced after it was listed: stop at its manifest's size, not at a full disk.
            raise ValueError(f"{self._name} has more than {self._limit} bytes, manifest says {self._limit}")
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._file.flush()


def staging_path(final: Path) -> Path:
    """A fresh staging folder's name for the checkpoint `final` (not created)."""
    return final.parent / f"{STAGING_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"


class Staged:
    """A checkpoint being written. Nothing in it counts until commit() returns. `path`: a staging
    folder (staging_path()) that others are writing into, adopted as it is."""

    def __init__(self, final: Path, path: Path | None = None):
        self.final = final
        self.path = path or staging_path(final)
        if path is None:
            self.path.mkdir(parents=True)
        elif not self.path.is_dir() or not self.path.name.startswith(f"{STAGING_PREFIX}{final.name}-"):
            raise ValueError(f"{self.path} is not a staging folder of {final.name}")
        self._entries: dict[str, dict] = {}

    @contextlib.contextmanager
    def open(self, name: str, durable: bool = True) -> Iterator[_HashingWriter]:
        """A writable file in the checkpoint; hashed while written, fsynced when closed unless not
        `durable` (a save as the pod goes: S3's copy is the one that counts, and every start
        hashes a local copy before it is used)."""
        _check_file_name(name)
        with open(self.path / name, "wb") as file:
            writer = _HashingWriter(file)
            try:
                yield writer
                file.flush()
                if durable:
                    os.fsync(file.fileno())
            except Exception:
                if writer.error:  # e.g. no space left: say that, not what the serializer made of it
                    raise writer.error from None
                raise
        self._entries[name] = {"size": writer.size, "sha256": writer.sha256.hexdigest()}

    @contextlib.contextmanager
    def receive(self, name: str, entry: dict, durable: bool = True) -> Iterator[_HashingWriter]:
        """A file the caller writes front to back (a download), hashed as the bytes come rather
        than read back after, fsynced when closed unless not `durable`; it counts only if it
        matches `entry` (else ValueError says how). A local error writing it is a ValueError too
        (the checkpoint cannot be received here), but for a full or read-only disk, which stays
        the OSError it is. Not durable: a copy of what S3 holds, which every start hashes again
        before it is used (restore.py), so a power cut that tears it costs a fetch, not a step."""
        _check_file_name(name)
        try:
            file = open(self.path / name, "wb")
        except OSError as err:
            raise _not_written(name, err) from None
        with file:
            writer = _HashingWriter(file, name, limit=entry.get("size"))
            try:
                yield writer
            except Exception:
                if writer.error is not None:  # the disk's, whatever the downloader made of it
                    raise _not_written(name, writer.error) from None
                raise
            try:
                file.flush()
                if durable:
                    os.fsync(file.fileno())
            except OSError as err:
                raise _not_written(name, err) from None
        digest = writer.sha256.hexdigest()
        problem = entry_problem(name, writer.size, entry, lambda: digest)
        if problem:
            raise ValueError(problem)
        self._entries[name] = {"size": writer.size, "sha256": digest}

    def add_written(self, name: str, entry: dict) -> None:
        """A file another process wrote into the folder and fsynced, with the size and sha256 it
        measured as it wrote (its size is checked here; verify() checks the bytes)."""
        _check_file_name(name)
        problem = verify_file(self.path / name, entry, full=False)
        if problem:
            raise ValueError(problem)
        self._entries[name] = {"size": entry["size"], "sha256": entry["sha256"]}

    def add_link(self, source: Path, entry: dict) -> None:
        """Reuse a committed file (a hard link, no copy) whose manifest entry is already known."""
        os.link(source, self.path / source.name)
        self._entries[source.name] = dict(entry)

    def commit(self, meta: dict | None = None, replace: bool = False, files: dict | None = None,
               absent: tuple | list = ()) -> Path:
        """Write the manifest last, then rename into place. An existing committed folder of the
        same name is kept unless `replace` (then it is swapped out, never left half-deleted).
        `files` and `absent`: a partial copy (a node of a group restores the shard files its own
        ranks read): the manifest lists every file of the checkpoint as S3 has it, and `absent`
        names those not fetched here, which verify() does not look for."""
        manifest = {"format": FORMAT, "files": files if files is not None else self._entries,
                    "meta": meta or {}, "committed_at": time.time()}
        if absent:
            manifest["absent"] = sorted(absent)
        key = _hmac_key()
        if key:
            manifest.update(folder=self.final.name, run=run_identity())  # what the signature binds
            manifest = json.loads(json.dumps(manifest))  # sign exactly what a reader will parse
            manifest["hmac"] = manifest_hmac(manifest, key)
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
def fill_in(folder: Path, name: str) -> Iterator[_HashingWriter]:
    """Write a file that a partial copy's manifest lists (see commit()'s `absent`) into the
    committed folder: it takes its place only once it matches its manifest entry."""
    entry = read_manifest(folder)["files"][name]
    _check_file_name(name)
    incoming = folder / f"{STAGING_PREFIX}{name}"
    try:
        with open(incoming, "wb") as file:
            writer = _HashingWriter(file, name, limit=entry["size"])
            yield writer
            file.flush()
            os.fsync(file.fileno())
        digest = writer.sha256.hexdigest()
        problem = entry_problem(name, writer.size, entry, lambda: digest)
        if problem:
            raise ValueError(problem)
        os.replace(incoming, folder / name)
    finally:
        incoming.unlink(missing_ok=True)


@contextlib.contextmanager
def stage(final: Path | str) -> Iterator[Staged]:
    """Write a checkpoint folder atomically; an exception (or no commit) leaves nothing behind."""
    staged = Staged(Path(final))
    try:
        yield staged
    finally:
        staged.abandon()


def read_manifest(folder: Path) -> dict | None:
    manifest = _load_manifest(folder)
    return manifest if is_manifest(manifest, folder.name) else None


def _load_manifest(folder: Path):
    try:
        return untrusted_json((folder / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None


def is_manifest(value, folder: str) -> bool:
    """A manifest every reader may trust, read from FOLDER (its name), wherever that is (see
    manifest_problem)."""
    return manifest_problem(value, folder) is None


def manifest_problem(value, folder: str) -> str | None:
    """None for a manifest that counts in the checkpoint folder named FOLDER, else why not: each
    file a plain name with its size and sha256, a known format, and with CHECKPOINT_HMAC_KEY set, a
    valid hmac over a manifest signed for FOLDER and this run."""
    files = value.get("files") if isinstance(value, dict) else None
    if not isinstance(files, dict) or not files or not isinstance(value.get("meta", {}), dict) or not all(
            isinstance(e, dict) and type(e.get("size")) is int and e["size"] >= 0
            and isinstance(e.get("sha256"), str) and _SHA256.fullmatch(e["sha256"])
            for e in files.values()):
        return "its manifest does not list files with size and sha256"
    bad = next((name for name in files if not is_file_name(name)), None)
    if bad is not None:
        return f"its manifest names {shown(bad)}, which is not a plain file name"
    if type(value.get("format")) is not int or value["format"] not in KNOWN_FORMATS:
        return f"its manifest has format {shown(value.get('format'))}, this runtime reads format {FORMAT}"
    absent = value.get("absent", [])
    if not isinstance(absent, list) or not all(isinstance(n, str) and n in files for n in absent):
        return "its manifest's absent files are not names it lists"
    return _signature_problem(value, folder)


def absent_files(manifest: dict) -> set[str]:
    """The files a partial copy's manifest lists but this folder does not hold (see commit())."""
    return set(manifest.get("absent", []))


def manifest_hmac(manifest: dict, key: bytes) -> str:
    """HMAC-SHA256 of everything in the manifest but the hmac itself (committed_at, folder and run
    included: no field a reader sees is left unsigned, and a field added later is covered by default)."""
    return _mac(key, b"checkpoint-manifest\n", manifest)


def _signature_problem(manifest: dict, folder: str) -> str | None:
    key = _hmac_key()
    if not key:
        return None  # signing is off: an hmac field, if any, is not looked at
    given = manifest.get("hmac")
    if not isinstance(given, str):
        return f"its manifest is not signed ({HMAC_KEY_ENV} is set)"
    if not hmac.compare_digest(given.encode(), manifest_hmac(manifest, key).encode()):
        return f"its manifest's hmac does not match {HMAC_KEY_ENV}"
    return _binding_problem(manifest, folder, "its manifest")


def _binding_problem(signed: dict, folder: str | None, what: str) -> str | None:
    """A validly signed object that is not this run's (folder: and not this folder's)."""
    if "run" not in signed or (folder is not None and "folder" not in signed):
        return f"{what} is signed but names no folder and run (an older runtime signed it); it counts in no run"
    if folder is not None and signed["folder"] != folder:
        return f"{what} was signed for folder {shown(signed['folder'])}, not {shown(folder)} (a copy)"
    if signed["run"] != run_identity():
        return f"{what} was signed for run {shown(signed['run'])}, not {shown(run_identity())} (another run's)"
    return None


def run_identity() -> str:
    """The run a signature binds: S3_OUTPUT_URI with its trailing '/', '' outside a pod. The same
    on every restart and on every pod of the run; another run's differs."""
    uri = os.environ.get(RUN_ENV, "")
    return uri if not uri or uri.endswith("/") else uri + "/"


def signed_complete(summary: dict) -> dict:
    """COMPLETE's body: with CHECKPOINT_HMAC_KEY set, bound to this run and signed (another
    domain than a manifest's: a manifest's hmac is never a valid COMPLETE's)."""
    key = _hmac_key()
    if not key:
        return summary
    body = json.loads(json.dumps({**summary, "run": run_identity()}))
    body["hmac"] = _mac(key, b"run-complete\n", body)
    return body


def complete_problem(raw: bytes) -> str | None:
    """None when the object at COMPLETE ends the run: without a key any object does (as before);
    with one, only a JSON object signed with it for this run. Else why not."""
    key = _hmac_key()
    if not key:
        return None
    try:
        body = untrusted_json(raw) if len(raw) <= MAX_COMPLETE_BYTES else None
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("hmac"), str):
        return f"it is not signed ({HMAC_KEY_ENV} is set)"
    if not hmac.compare_digest(body["hmac"].encode(), _mac(key, b"run-complete\n", body).encode()):
        return f"its hmac does not match {HMAC_KEY_ENV}"
    return _binding_problem(body, None, "it")


def _mac(key: bytes, domain: bytes, value: dict) -> str:
    body = {k: v for k, v in value.items() if k != "hmac"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, domain + canonical.encode(), hashlib.sha256).hexdigest()


def _hmac_key() -> bytes | None:
    return os.environ.get(HMAC_KEY_ENV, "").encode() or None  # an empty key is no key


def shown(value) -> str:
    """A value from an untrusted manifest, as one short escaped token for a log line."""
    text = ascii(value)
    return text if len(text) <= 60 else text[:57] + "..."


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # the volume's fault, not the checkpoint's


def _not_written(name: str, err: OSError) -> Exception:
    if err.errno in NO_ROOM:
        return err
    return ValueError(f"{name} could not be written here ({err.strerror or type(err).__name__})")


def _check_file_name(name) -> None:
    if not is_file_name(name):
        raise ValueError(f"bad checkpoint file name {shown(name)}: a checkpoint holds plain file names only")


def is_committed(folder: Path) -> bool:
    """Cheap test: the manifest is there and parses. verify() checks the bytes."""
    return read_manifest(folder) is not None


def verify(folder: Path, full: bool = True) -> str | None:
    """None if the folder is a whole checkpoint, else the reason it is not."""
    manifest = _load_manifest(folder)
    if manifest is None:
        return f"no readable {MANIFEST}"
    problem = manifest_problem(manifest, folder.name)
    if problem:
        return problem
    absent = absent_files(manifest)
    files = sorted((name, entry) for name, entry in manifest["files"].items() if name not in absent)
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
    return entry_problem(path.name, size, entry, (lambda: file_sha256(path)) if full else None)


def entry_problem(name: str, size: int, entry: dict, sha256: Callable[[], str] | None) -> str | None:
    """How a file of `size` bytes (and `sha256()`, when given) differs from its manifest entry."""
    if size != entry.get("size"):
        return f"{name} has {size} bytes, manifest says {entry.get('size')}"
    if sha256 and sha256() != entry.get("sha256"):
        return f"{name} does not match its sha256 in the manifest"
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


def newest_valid(root: Path, on_skip: Callable[[Path, str], None] | None = None,
                 verified: dict | None = None) -> Path | None:
    """The newest step folder that verifies in full; each bad one is reported and skipped. The one
    `verified` names (read_verified) is checked by size only: its bytes were just hashed."""
    for _, folder in committed_steps(Path(root)):
        problem = verify(folder, full=not is_verified(folder, verified))
        if problem is None:
            return folder
        if on_skip:
            on_skip(folder, problem)
    return None


def note_verified(path: Path, folder: Path) -> None:
    """Record that `folder`, exactly as its manifest is now, was hashed against that manifest (by
    restore.py, seconds before the trainer loads it: hashing it twice cost 0.7 s per 1.5 GB)."""
    record = {"name": folder.name, "manifest_sha256": _manifest_digest(folder)}
    written = path.with_name(path.name + ".new")
    written.write_text(json.dumps(record))
    os.replace(written, path)


def read_verified(path: str | Path | None) -> dict | None:
    """What note_verified wrote at `path`, or None (no path, no file, or not such a record)."""
    try:
        record = json.loads(Path(path).read_text())
    except (TypeError, OSError, ValueError):
        return None
    ok = isinstance(record, dict) and all(isinstance(record.get(k), str) for k in ("name", "manifest_sha256"))
    return record if ok else None


def is_verified(folder: Path, verified: dict | None) -> bool:
    """The record names this folder and its manifest has not changed since (a step saved again is
    another commit of the same name)."""
    return bool(verified) and verified["name"] == folder.name and \
        verified["manifest_sha256"] == _manifest_digest(folder)


def _manifest_digest(folder: Path) -> str | None:
    try:
        return hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()
    except OSError:
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
    """Staging folders of a writer that died mid-save, and step folders whose manifest is gone (a
    prune or discard cut short: the manifest goes first); never a checkpoint, safe to drop."""
    if not Path(root).is_dir():
        return
    for path in Path(root).iterdir():
        uncommitted = parse_step(path.name) is not None and not (path / MANIFEST).exists()
        if path.name.startswith(STAGING_PREFIX) or (uncommitted and path.is_dir()):
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
