"""Bring back the newest committed checkpoint from S3, and only that one.

    python restore.py S3_OUTPUT_URI OUTPUT_DIR [--step NAME]

--step: that checkpoint and no other (a node of a group takes the step node 0 chose; an empty NAME:
none, the group starts at step 0). Until it is in S3 it is waited for, up to S3_RETRY_SECONDS: node
0 may hold it only on its disk yet, with its uploader putting it there.

A step folder in S3 counts only if its manifest.json is there (the uploader writes it last). Its
files are downloaded into a staging folder, each checked against the manifest (size and sha256),
and committed locally with the same protocol the trainer uses. A damaged one is skipped with a
warning that names it, and the one before it is tried. Nothing in S3 is changed.

Whoever can write the bucket can write a manifest, so one counts only if checkpoint.is_manifest
says so (plain file names, a known format, a valid hmac when CHECKPOINT_HMAC_KEY is set), every
object's size in the listing matches it before a byte is fetched, and nothing is written outside
the staging folder. A checkpoint that cannot fit on the local disk is bad input.

Exit 0 (restored, or nothing to restore), 64 (bad input), 75 (S3 unreachable).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import botocore.exceptions

import checkpoint  # the runtime's own copy of the protocol, never the user's upload
import contract
import s3 as s3lib
from s3 import Location, log

def newest_first(names: list[str]) -> list[str]:
    steps = [(checkpoint.parse_step(n), n) for n in names]
    return [n for _, n in sorted(((s, n) for s, n in steps if s is not None), reverse=True)]


def restore(s3, run: Location, out: Path) -> str | None:
    """The name of the checkpoint now committed under OUT/checkpoints, or None."""
    retry = s3lib.retrying("restore", run.bucket, name="restore")
    remote = run.child("checkpoints")
    local_root = out / "checkpoints"
    for name in newest_first(s3lib.list_prefixes(s3, remote, retry)):
        try:
            manifest, _ = s3lib.get_json(s3, remote, remote.key(name, checkpoint.MANIFEST), retry)
        except ValueError as damage:
            manifest, problem = {}, str(damage)
        else:
            if manifest is None:
                log("restore", f"{name} in S3 has no manifest.json: never committed, ignored")
                continue
            problem = checkpoint.manifest_problem(manifest)
        if problem:
            log("restore", f"warning: {name} in S3 is damaged ({problem}); trying the one before it")
            continue
        if checkpoint.verify(local_root / name) is None:
            log("restore", f"{name} is already here and whole")
            return name
        problem = download(s3, remote.child(name), manifest, local_root / name, retry)
        if problem is None:
            return name
        log("restore", f"warning: {name} in S3 is damaged ({problem}); trying the one before it")
    log("restore", f"no committed checkpoint in {remote}: the trainer starts from step 0")
    return None


def restore_named(s3, run: Location, out: Path, name: str, wait_seconds: float) -> str | None:
    """Exactly the checkpoint NAME, committed under OUT/checkpoints; None for an empty NAME."""
    if not name:
        log("restore", "node 0 starts from step 0: nothing to restore")
        return None
    if not checkpoint.is_file_name(name) or checkpoint.parse_step(name) is None:
        raise s3lib.BadInput(f"--step {name!a} is not a checkpoint folder name (step-NNNNNNNN)")
    retry = s3lib.retrying("restore", run.bucket, name="restore")
    remote = run.child("checkpoints")
    if checkpoint.verify(out / "checkpoints" / name) is None:
        log("restore", f"{name} is already here and whole")
        return name
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            manifest, _ = s3lib.get_json(s3, remote, remote.key(name, checkpoint.MANIFEST), retry)
        except ValueError as damage:
            manifest, problem = {}, str(damage)
        else:
            problem = "not committed in S3 yet" if manifest is None else checkpoint.manifest_problem(manifest)
        if problem is None:
            problem = download(s3, remote.child(name), manifest, out / "checkpoints" / name, retry)
            if problem is None:
                return name
        if time.monotonic() >= deadline:
            raise s3lib.Unavailable(f"node 0 chose {name}, but in {remote} it is {problem} after "
                                    f"{wait_seconds:.0f}s (S3_RETRY_SECONDS); the group restarts")
        log("restore", f"{name}, node 0's choice, is {problem}; asking again in 5s")
        time.sleep(5)


def download(s3, where: Location, manifest: dict, final: Path, retry) -> str | None:
    """Download and verify one checkpoint; None when committed locally, else what was wrong."""
    files = manifest["files"]
    problem = size_problem(files, listed_sizes(s3, where, retry))
    if problem:
        return problem
    size = sum(entry["size"] for entry in files.values())
    final.parent.mkdir(parents=True, exist_ok=True)
    check_room(final, size)
    log("restore", f"restoring {final.name}: {len(files)} files, {size / 1e6:.1f} MB")
    started = time.monotonic()

    def fetch_and_check(name: str, entry: dict) -> str | None:
        target = staged.path / name
        if target.resolve().parent != staged.path.resolve():  # is_manifest forbids it; never trust one check
            return f"{name!a} would be written outside the checkpoint folder"
        if not retry(fetch, s3, where, name, target):
            return f"{name} is named in the manifest but missing"
        try:
            staged.adopt(name, entry)
        except ValueError as problem:
            return str(problem)
        return None

    with checkpoint.stage(final) as staged:
        problem = side_by_side(fetch_and_check, sorted(files.items()))
        if problem:
            return problem
        staged.commit(meta=manifest.get("meta"))
    took = time.monotonic() - started
    log("restore", f"restored {final.name}: {size / 1e6:.1f} MB in {took:.1f}s "
                   f"({size / 1e6 / max(took, 1e-3):.0f} MB/s), verified against its manifest")
    return None


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
    """work(name, entry) for every item, a few at a time, so one file is hashed while another
    still downloads. The first problem in name order wins, as one after another would have it, and
    after any problem no further file is started (a damaged checkpoint costs no more bytes)."""
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


def fetch(s3, where: Location, name: str, target: Path) -> bool:
    try:
        s3.download_file(where.bucket, where.key(name), str(target), Config=s3lib.TRANSFER)
    except botocore.exceptions.ClientError as err:
        if s3lib.not_found(err):
            return False
        raise
    return True


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--step"):
        print("usage: restore.py S3_OUTPUT_URI OUTPUT_DIR [--step NAME]", file=sys.stderr)
        return contract.EXIT_BAD_INPUT

    def run() -> int:
        run_uri, out = Location.parse(argv[0]), Path(argv[1])
        if len(argv) == 4:
            wait = float(os.environ.get("S3_RETRY_SECONDS") or 600)
            name = restore_named(s3lib.client(), run_uri, out, argv[3], wait)
        else:
            name = restore(s3lib.client(), run_uri, out)
        # The step the trainer goes on from (null: step 0); tools wait on this, not the prose.
        contract.event("restore", "restore", step=checkpoint.parse_step(name) if name else None, name=name)
        return 0

    return s3lib.main_guard("restore", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
