"""What scripts/stage.sh puts in S3_CODE_URI, decided before anything is uploaded.

    python3 stage_code.py layout SOURCE WORK --runtime JOB_DIR [--config-dir DIR] [--exclude GLOB]...
    python3 stage_code.py plan WORK BUCKET PREFIX LISTING [RECORD] [--delete]
    python3 stage_code.py listed LISTING KEY      # exit 0 when LISTING holds KEY

`layout` walks SOURCE (a code folder, recursively, links followed), checks every name and file,
and lists the result in WORK/layout.json (each file's path, size and MD5) with the runtime's
checkpoint.py and contract.py beside it (unless SOURCE has its own). `plan` compares it with LISTING
(list-objects-v2 JSON of PREFIX) and RECORD (what an earlier stage.sh staged there), writes
WORK/upload/ (new and changed files, and the record) and, only with --delete and something to
delete, WORK/delete-NNN.json (delete-objects requests of at most 1000 keys) and
WORK/final-record.json (the record once every delete succeeded), and prints one line per file to
upload or delete. Bad input: one line on stderr naming the file and the fix, exit 64, before
anything is uploaded.

Why a record: files put in the prefix by other means (a user's own script, a package) must never
be deleted; --delete removes only what an earlier stage.sh put there and the folder no longer has.
Standard library only: it runs on a laptop beside the AWS CLI.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "job"))  # after the libraries: job/ names no shadow
from contract import EXIT_BAD_INPUT, printable  # noqa: E402 - the exit codes' one definition, the escaper
RECORD_KEY = ".stage-record.json"
RUNTIME_MODULES = ("checkpoint.py", "contract.py")
# The pod syncs the code prefix into WORK_DIR, where these are its own folders (job/script.sh):
# data/, out/ (checkpoints: a planted one would be resumed), model/, .pod/, .tmp/, .venv-*.
POD_FOLDERS = ("data", "out", "model", ".pod", ".tmp")
POD_FOLDER_GLOBS = (".venv-*",)
# Never code, and often large (a virtualenv: the pod makes its own from requirements.txt): left out.
SKIPPED = ("__pycache__", "*.pyc", ".git", ".DS_Store", ".ipynb_checkpoints", ".venv", ".mypy_cache",
           ".pytest_cache", ".ruff_cache")
# Files that usually hold secrets, which the pod must get from its Secret, never from code.
SECRET_NAMES = (".env", ".env.*", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa", "id_dsa", "id_ecdsa",
                "id_ed25519", ".netrc", ".pgpass", ".git-credentials", ".pypirc", ".npmrc", "credentials",
                "kubeconfig", "*.kubeconfig")
NOT_SECRET_SUFFIXES = (".example", ".sample", ".template", ".dist")
MAX_NAME_BYTES = 255  # one path component, as Linux file systems allow
MAX_KEY_BYTES = 1024  # an S3 key
MAX_RECORD_BYTES = 4 << 20
MAX_DELETE_KEYS = 1000  # per DeleteObjects request, S3's limit
LARGE_BYTES = 100 << 20


class BadInput(Exception):
    """One line naming the file and the fix; exit 64."""


@dataclass
class Layout:
    files: dict[str, Path] = field(default_factory=dict)  # relative key -> the file (links resolved)
    skipped: int = 0
    warnings: list[str] = field(default_factory=list)


# -- the folder --------------------------------------------------------------------------------

def collect(source: Path, excludes: tuple[str, ...] = (), prefix: str = "") -> Layout:
    """Every file under `source` by its relative key, checked; raises BadInput on the first problem."""
    if not source.is_dir():
        raise BadInput(f"{source} is not a folder; give --code the folder that holds your training script")
    layout = Layout()
    _walk(source, prefix, excludes, layout, ancestors=(source.resolve(),))
    return layout


def _walk(folder: Path, prefix: str, excludes, layout: Layout, ancestors: tuple) -> None:
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        path = Path(entry.path)
        name = _text_name(path)
        relative = prefix + name
        if _matches(relative, name, SKIPPED):
            layout.skipped += 1
            continue
        if _matches(relative, name, excludes):
            continue
        check_name(relative, path)
        target = _resolved(path)
        mode = target.stat().st_mode
        if stat.S_ISDIR(mode):
            real = target.resolve()
            if real in ancestors:
                raise BadInput(f"{path} links back to {real}, a folder it is in (a loop); remove the link")
            _walk(path, relative + "/", excludes, layout, ancestors + (real,))
        elif stat.S_ISREG(mode):
            check_not_secret(relative, name, path)
            layout.files[relative] = target.resolve()
        else:
            raise BadInput(f"{path} is not a file or a folder (a socket, pipe or device); remove it or --exclude it")


def _text_name(path: Path) -> str:
    name = path.name
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"{os.fsencode(path)!r} has a name that is not UTF-8, which S3 keys must be; "
                       f"rename it") from None
    return name


def _resolved(path: Path) -> Path:
    if not path.is_symlink():
        return path
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:
        raise BadInput(f"{path} is a link to {os.readlink(path)}, which does not exist; fix or remove the link") from None
    except RuntimeError:  # a loop of links
        raise BadInput(f"{path} is a loop of links; remove it") from None
    return target


def _matches(relative: str, name: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(relative, g) for g in globs)


def check_name(relative: str, path: Path | str) -> None:
    """A name S3 can hold as a key and every pod can write as a file in its WORK_DIR."""
    for part in relative.split("/"):
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise BadInput(f"{path}: a name of more than {MAX_NAME_BYTES} bytes, which a file system cannot "
                           f"hold; shorten it")
        if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in part) or "\\" in part:
            raise BadInput(f"{ascii(str(path))} has a control character or a backslash in its name; rename it")
    top = relative.split("/")[0]
    if top == RECORD_KEY:
        raise BadInput(f"{path}: {RECORD_KEY} is stage.sh's record of what it staged; rename it or --exclude it")
    if top in POD_FOLDERS or any(fnmatch.fnmatchcase(top, g) for g in POD_FOLDER_GLOBS):
        raise BadInput(f"{path}: the pod puts the code in its WORK_DIR beside its own data/, out/, model/, .pod/, "
                       f".tmp/ and .venv-*, and {top} would land in one; rename it or --exclude it")


def check_not_secret(relative: str, name: str, path: Path) -> None:
    lower = name.lower()
    if lower.endswith(NOT_SECRET_SUFFIXES):
        return
    if any(fnmatch.fnmatchcase(lower, g) for g in SECRET_NAMES):
        raise BadInput(f"{path} looks like a secret ({name}), and code in S3 is read by every pod and "
                       f"whoever reads the bucket; give the pod secrets through its Secret, and move the "
                       f"file out of the folder or --exclude {relative}")


def add_runtime(layout: Layout, runtime: Path, source: Path) -> None:
    """The runtime's checkpoint.py and contract.py beside the trainer, unless it brings its own
    (on the pod, a trainer's own module wins over the runtime's on PYTHONPATH too)."""
    for name in RUNTIME_MODULES:
        theirs = runtime / name
        if name not in layout.files:
            layout.files[name] = theirs.resolve()
        elif file_md5(layout.files[name]) != file_md5(theirs):
            layout.warnings.append(f"{source / name} is not the runtime's {name}: your trainer imports yours "
                                   f"(the pod's restore and uploader use the runtime's)")


def add_configs(layout: Layout, config_dir: Path) -> None:
    for path in sorted(config_dir.glob("*.yaml")):
        layout.files.setdefault(f"config/{path.name}", path.resolve())


def check_keys(layout: Layout, prefix: str) -> None:
    for relative in layout.files:
        if len((prefix + relative).encode("utf-8")) > MAX_KEY_BYTES:
            raise BadInput(f"{relative}: its S3 key would be longer than {MAX_KEY_BYTES} bytes; shorten the "
                           f"path or the prefix")


def describe(layout: Layout) -> dict[str, dict]:
    """Each file's path (links resolved), size and MD5: what plan compares with the prefix."""
    return {relative: {"path": str(path), "size": path.stat().st_size, "md5": file_md5(path)}
            for relative, path in layout.files.items()}


def file_md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# -- against what the prefix holds ---------------------------------------------------------------

@dataclass
class Plan:
    new: list[str]
    changed: list[str]
    unchanged: list[str]
    delete: list[str]
    stale: list[str]  # an earlier stage.sh put them there, the folder no longer has them, no --delete
    foreign: list[str]  # in the prefix, never staged by stage.sh: never deleted
    record: list[str]  # what stage.sh will have staged there afterwards


def plan(local: dict[str, dict], remote: dict[str, dict], recorded: set[str], delete: bool) -> Plan:
    """local: relative key -> {size, md5}; remote: relative key -> {size, etag}; recorded: what an
    earlier stage.sh staged. An object counts as unchanged when its ETag is the file's MD5 (a
    multipart or KMS-encrypted object's is not: it is uploaded again)."""
    new = sorted(k for k in local if k not in remote)
    changed = sorted(k for k in local if k in remote and not _same(local[k], remote[k]))
    unchanged = sorted(k for k in local if k in remote and _same(local[k], remote[k]))
    others = sorted(k for k in remote if k not in local and k != RECORD_KEY)
    stale = [k for k in others if k in recorded]
    foreign = [k for k in others if k not in recorded]
    if delete:
        return Plan(new, changed, unchanged, stale, [], foreign, sorted(local))
    return Plan(new, changed, unchanged, [], stale, foreign, sorted(set(local) | set(stale)))


def _same(mine: dict, theirs: dict) -> bool:
    return mine["size"] == theirs.get("size") and mine["md5"] == theirs.get("etag")


def read_listing(path: Path, prefix: str) -> dict[str, dict]:
    """`aws s3api list-objects-v2 --output json` of the prefix: relative key -> {size, etag}."""
    text = path.read_text() if path.exists() else ""
    listing = json.loads(text) if text.strip() else {}
    objects = listing.get("Contents") or [] if isinstance(listing, dict) else []
    remote = {}
    for item in objects:
        key = item.get("Key") if isinstance(item, dict) else None
        if isinstance(key, str) and key.startswith(prefix) and len(key) > len(prefix):
            remote[key[len(prefix):]] = {"size": item.get("Size"), "etag": str(item.get("ETag", "")).strip('"')}
    return remote


def read_record(path: Path | None) -> tuple[set[str], str | None]:
    """The keys an earlier stage.sh staged (untrusted: it is read from S3), and a warning when the
    record is there but not one this script wrote."""
    if path is None or not path.exists():
        return set(), None
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise ValueError("too large")
        record = json.loads(path.read_text())
        files = record["files"]
        if record.get("format") != 1 or not isinstance(files, list) or not all(
                isinstance(k, str) and _is_relative_key(k) for k in files):
            raise ValueError("not a record")
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return set(), f"{RECORD_KEY} in the prefix is not a record stage.sh wrote: nothing is deleted"
    return set(files), None


def _is_relative_key(key: str) -> bool:
    parts = key.split("/")
    return bool(key) and key != RECORD_KEY and all(p not in ("", ".", "..") for p in parts)


def write_plan(work: Path, result: Plan, local: dict[str, dict], prefix: str, recorded: set[str]) -> None:
    """WORK/upload/ (new and changed files, and the record when it changes: one upload for all),
    with deletions WORK/delete-001.json... (delete-objects requests) and WORK/final-record.json, and
    WORK/counts ("staged uploaded deleted kept")."""
    upload = work / "upload"
    upload.mkdir(exist_ok=True)
    for relative in result.new + result.changed:
        target = upload / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local[relative]["path"], target)
    # The record that goes up with the code still names the files to delete: should a delete fail,
    # a rerun still knows them as stage.sh's. stage.sh uploads the final one after every delete.
    uploaded_record = sorted(set(result.record) | set(result.delete))
    if set(uploaded_record) != recorded:
        _write_record(upload / RECORD_KEY, uploaded_record)
    for number, request in enumerate(delete_requests(prefix, result.delete), start=1):
        (work / f"delete-{number:03d}.json").write_text(json.dumps(request))
    if result.delete:
        _write_record(work / "final-record.json", result.record)
    staged = len(result.new) + len(result.changed) + len(result.unchanged)
    kept = len(result.stale) + len(result.foreign)
    (work / "counts").write_text(f"{staged} {len(result.new) + len(result.changed)} {len(result.delete)} {kept}\n")


def delete_requests(prefix: str, keys: list[str]) -> list[dict]:
    """delete-objects requests for KEYS, at most MAX_DELETE_KEYS each (S3 refuses more: MalformedXML)."""
    return [{"Objects": [{"Key": prefix + k} for k in keys[start:start + MAX_DELETE_KEYS]], "Quiet": True}
            for start in range(0, len(keys), MAX_DELETE_KEYS)]


def _write_record(path: Path, files: list[str]) -> None:
    path.write_text(json.dumps({"format": 1, "files": files}, indent=1))


def show_plan(result: Plan, uri: str) -> None:
    """One line per file to upload or delete; every key escaped (it may come from S3)."""
    for key in result.new:
        print(f"  upload (new):     {printable(key)}")
    for key in result.changed:
        print(f"  upload (changed): {printable(key)}")
    for key in result.delete:
        print(f"  delete:           {printable(key)}")
    if result.unchanged:
        print(f"  unchanged:        {len(result.unchanged)} file(s)")
    if result.stale:
        print(f"  kept:             {_few(result.stale)} (staged before, no longer in the folder; --delete removes them)")
    if result.foreign:
        print(f"  kept:             {_few(result.foreign)} (in {printable(uri)}, not put there by stage.sh: never deleted)")


def _few(keys: list[str]) -> str:
    return ", ".join(map(printable, keys[:5])) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


# -- command line ------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        if args.command == "layout":
            return run_layout(args)
        if args.command == "listed":
            return run_listed(args)
        return run_plan(args)
    except BadInput as err:
        print(f"stage.sh: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run_layout(args) -> int:
    source, work = Path(args.source), Path(args.work)
    layout = collect(source, tuple(args.exclude))
    if args.config_dir:
        add_configs(layout, Path(args.config_dir))
    if not any(k.endswith(".py") for k in layout.files):
        raise BadInput(f"{source} holds no .py file; give --code the folder that holds your training script")
    add_runtime(layout, Path(args.runtime), source)
    check_keys(layout, args.prefix)
    entries = describe(layout)
    (work / "layout.json").write_text(json.dumps(entries))
    for warning in layout.warnings:
        print(f"stage.sh: warning: {warning}", file=sys.stderr)
    size = sum(e["size"] for e in entries.values())
    if size > LARGE_BYTES:
        print(f"stage.sh: warning: {source} holds {size / 1e6:.0f} MB, which every pod downloads at every "
              f"start; keep data in S3_DATA_URI and models in S3_MODEL_URI", file=sys.stderr)
    return 0


def run_listed(args) -> int:
    """0 when the listing holds the record at a size worth reading (it comes from S3)."""
    entry = read_listing(Path(args.listing), "").get(args.key)
    if entry is None:
        return 1
    if not isinstance(entry["size"], int) or entry["size"] > MAX_RECORD_BYTES:
        print(f"stage.sh: warning: {args.key} is larger than a record stage.sh writes: nothing is deleted",
              file=sys.stderr)
        return 1
    return 0


def run_plan(args) -> int:
    work = Path(args.work)
    local = json.loads((work / "layout.json").read_text())
    remote = read_listing(Path(args.listing), args.prefix)
    recorded, warning = read_record(Path(args.record) if args.record else None)
    if warning:
        print(f"stage.sh: warning: {warning}", file=sys.stderr)
    result = plan(local, remote, recorded, args.delete)
    write_plan(work, result, local, args.prefix, recorded)
    show_plan(result, f"s3://{args.bucket}/{args.prefix}")
    return 0


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(prog="stage_code.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    layout = commands.add_parser("layout")
    layout.add_argument("source")
    layout.add_argument("work")
    layout.add_argument("--runtime", required=True)
    layout.add_argument("--prefix", default="")
    layout.add_argument("--config-dir")
    layout.add_argument("--exclude", action="append", default=[])
    planned = commands.add_parser("plan")
    planned.add_argument("work")
    planned.add_argument("bucket")
    planned.add_argument("prefix")
    planned.add_argument("listing")
    planned.add_argument("record", nargs="?")
    planned.add_argument("--delete", action="store_true")
    listed = commands.add_parser("listed")
    listed.add_argument("listing")
    listed.add_argument("key")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
