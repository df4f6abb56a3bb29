"""Bring back the newest committed checkpoint from S3, and only that one.

    python restore.py S3_OUTPUT_URI OUTPUT_DIR [--step NAME] [--ranks FIRST:COUNT:WORLD]

--step: that checkpoint and no other (the step node 0 chose; empty: none), waited for up to
S3_RETRY_SECONDS while node 0's uploader puts it in S3. --ranks: this node runs ranks
FIRST..FIRST+COUNT-1 of WORLD; a sharded step saved at that world size comes down in part (the
local manifest names the rest as absent), any other whole.

A step counts only with its manifest.json in S3 (the uploader writes it last). Its files are
hashed as they come, checked against the manifest and committed locally with the trainer's own
protocol; a damaged one is skipped with a warning and the one before it tried. Nothing in S3 is
changed, nothing written outside the staging folder, and a manifest is judged as untrusted input
(checkpoint.is_manifest, listed sizes checked before a byte is fetched). remote_checkpoints.py is
how S3 holds a checkpoint; this file chooses which step. The one restored is named in
RESTORE_VERIFIED_FILE, so the trainer checks it by size only. docs/how-it-works.md has the rest.

Exit 0 (restored, or nothing to restore), 64 (bad input, a checkpoint too big for the disk), 75 (S3
unreachable).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import checkpoint  # the runtime's own copy of the protocol, never the user's upload
import contract
import remote_checkpoints
import s3 as s3lib
from remote_checkpoints import side_by_side  # noqa: F401 - tests/test_reliability.py reaches it here
from s3 import Location, log


def restore(s3, run: Location, out: Path, ranks: tuple[int, int, int] | None = None) -> str | None:
    """The name of the checkpoint now committed under OUT/checkpoints, or None."""
    retry = s3lib.retrying("restore", run.bucket, name="restore")
    remote = run.child("checkpoints")
    local_root = out / "checkpoints"
    for name in remote_checkpoints.committed(s3, remote, retry):
        manifest, problem = remote_checkpoints.manifest_of(s3, remote, name, retry)
        if manifest is None and problem is None:
            log("restore", f"{name} in S3 has no manifest.json: never committed, ignored")
            continue
        if problem:
            log("restore", f"warning: {name} in S3 is damaged ({problem}); trying the one before it")
            continue
        if checkpoint.verify(local_root / name) is None:
            log("restore", f"{name} is already here and whole")
            return name
        discard_damaged(local_root / name)
        problem = remote_checkpoints.fetch(s3, remote, name, manifest, local_root, retry, ranks)
        if problem is None:
            return name
        log("restore", f"warning: {name} in S3 is damaged ({problem}); trying the one before it")
    log("restore", f"no committed checkpoint in {remote}: the trainer starts from step 0")
    return None


def discard_damaged(folder: Path) -> None:
    """A local copy that failed its hash goes before the fetch: a commit would keep it over the
    fresh, verified download."""
    if folder.is_dir():
        log("restore", f"warning: {folder.name} here does not match its manifest; fetching it again")
        checkpoint.discard(folder)


def record_verified(out: Path, name: str) -> None:
    """Best effort: without the record the trainer hashes the checkpoint in full."""
    try:
        checkpoint.note_verified(Path(os.environ["RESTORE_VERIFIED_FILE"]), out / "checkpoints" / name)
    except OSError as err:
        log("restore", f"warning: could not record {name} as verified ({err.strerror}); the trainer hashes it again")


def restore_named(s3, run: Location, out: Path, name: str, wait_seconds: float,
                  ranks: tuple[int, int, int] | None = None) -> str | None:
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
    discard_damaged(out / "checkpoints" / name)
    deadline = time.monotonic() + wait_seconds
    while True:
        manifest, problem = remote_checkpoints.manifest_of(s3, remote, name, retry)
        if manifest is None and problem is None:
            problem = "not committed in S3 yet"
        if problem is None:
            problem = remote_checkpoints.fetch(s3, remote, name, manifest, out / "checkpoints", retry, ranks)
            if problem is None:
                return name
        if time.monotonic() >= deadline:
            raise s3lib.Unavailable(f"node 0 chose {name}, but in {remote} it is {problem} after "
                                    f"{wait_seconds:.0f}s (S3_RETRY_SECONDS); the group restarts")
        log("restore", f"{name}, node 0's choice, is {problem}; asking again in 5s")
        time.sleep(5)


def parse_ranks(text: str) -> tuple[int, int, int] | None:
    """FIRST:COUNT:WORLD, or None when it is not that (FIRST + COUNT <= WORLD, COUNT >= 1)."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    first, count, world = map(int, parts)
    return (first, count, world) if count >= 1 and first + count <= world else None


def parse_args(argv: list[str]) -> tuple[list[str], dict] | None:
    """(positional, {"--step": NAME, "--ranks": (first, count, world)}), or None for bad usage."""
    positional, options = argv[:2], {}
    rest = argv[2:]
    if len(positional) != 2 or len(rest) % 2:
        return None
    for flag, value in zip(rest[::2], rest[1::2]):
        if flag not in ("--step", "--ranks") or flag in options:
            return None
        options[flag] = value if flag == "--step" else parse_ranks(value)
        if options[flag] is None:
            return None
    return positional, options


def main(argv: list[str]) -> int:
    parsed = parse_args(argv)
    if parsed is None:
        print("usage: restore.py S3_OUTPUT_URI OUTPUT_DIR [--step NAME] [--ranks FIRST:COUNT:WORLD]", file=sys.stderr)
        return contract.EXIT_BAD_INPUT
    (uri, output_dir), options = parsed

    def run() -> int:
        run_uri, out = Location.parse(uri), Path(output_dir)
        ranks = options.get("--ranks")
        if "--step" in options:
            wait = float(os.environ.get("S3_RETRY_SECONDS") or 600)
            name = restore_named(s3lib.client(), run_uri, out, options["--step"], wait, ranks)
        else:
            name = restore(s3lib.client(), run_uri, out, ranks)
        if name and os.environ.get("RESTORE_VERIFIED_FILE"):
            record_verified(out, name)
        manifest = (checkpoint.read_manifest(out / "checkpoints" / name) if name else None) or {"files": {}}
        absent = checkpoint.absent_files(manifest)
        held = sum(e["size"] for n, e in manifest["files"].items() if n not in absent)
        # The step the trainer goes on from (null: step 0); tools wait on this, not the prose.
        contract.event("restore", "restore", step=checkpoint.parse_step(name) if name else None, name=name,
                       bytes=held, absent=sorted(absent))
        return 0

    return s3lib.main_guard("restore", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
