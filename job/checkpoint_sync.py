"""The trainer's committed checkpoints, put in S3 as they commit; S3 keeps what the trainer keeps.

    sync = CheckpointSync(writer, out)       # writer: a RunWriter that holds the lease
    sync.sync()                              # every new local commit goes up, then retention
    sync.in_s3("step-00000100")              # what S3's manifest of it lists, None if not committed

A newly committed local folder goes up with its files first and manifest.json last, so S3 never
shows half a checkpoint as committed; a step already in S3 with other bytes (a redone step) is
uncommitted first. S3 keeps the newest `keep` committed folders (the trainer's checkpoint.keep, from
its manifests) plus best/, copied inside S3 when it is a step already there; the newest is never
deleted. A node's partial copy of a sharded step (restored per node) is never uploaded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import checkpoint  # the runtime's own copy of the protocol, never the user's upload
import contract
import remote_checkpoints
import s3 as s3lib
from run_writer import RunWriter
from s3 import log


class CheckpointSync:
    def __init__(self, writer: RunWriter, out: Path):
        self.writer = writer
        self.local = out / contract.CHECKPOINTS_DIR
        self.ckpts = writer.run.child(contract.CHECKPOINTS_DIR)
        self.remote: dict[str, dict | None] = {}  # checkpoint name -> its manifest's files in S3
        self.retention_checked = False
        self.partial_seen: set[str] = set()  # partial local copies already warned of
        self.damaged: dict[str, bytes] = {}  # name -> the manifest its files did not match, said once

    def sync(self) -> bool:
        """True when a step's checkpoint went up now."""
        local = checkpoint.committed_steps(self.local)
        if not local:
            return False
        keep = keep_of(local[0][1])
        uploaded = [self.upload(folder) for _, folder in local[:keep]]
        best = self.local / "best"
        if checkpoint.is_committed(best):
            self.upload(best)
        if any(uploaded) or not self.retention_checked:
            self.apply_retention(keep)
            self.retention_checked = True
        return any(uploaded)

    def newest_refused(self) -> str | None:
        """The newest committed step here, when it was not put in S3 because its files do not
        match its manifest."""
        local = checkpoint.committed_steps(self.local)
        name = local[0][1].name if local else None
        return name if name in self.damaged else None

    def in_s3(self, name: str) -> dict | None:
        """The files S3's manifest of a checkpoint lists; None when not committed there, {} when
        its manifest is damaged (then the local one replaces it)."""
        if name not in self.remote:
            manifest, problem = remote_checkpoints.manifest_of(self.writer.s3, self.ckpts, name, self.writer.retry)
            if manifest is None and problem is None:
                self.remote[name] = None
            else:
                self.remote[name] = {} if problem else manifest["files"]
        return self.remote[name]

    def upload(self, folder: Path) -> bool:
        """True when the folder went up now; False when S3 had it already or it is gone."""
        manifest_bytes = _read_or_none(folder / checkpoint.MANIFEST)
        if manifest_bytes is None:
            return False  # pruned by the trainer meanwhile: a newer one exists
        manifest = json.loads(manifest_bytes)
        if (self.in_s3(folder.name) == manifest["files"] or self._partial(folder.name, manifest)
                or self.damaged.get(folder.name) == manifest_bytes):
            return False
        handles = _open_all(folder, manifest["files"])
        if handles is None:
            return False
        try:
            if _read_or_none(folder / checkpoint.MANIFEST) != manifest_bytes:  # best/ swapped meanwhile
                return False
            started = time.monotonic()
            self._put(folder.name, manifest, manifest_bytes, handles)
        except remote_checkpoints.NotAsCommitted as damage:
            self._said_damaged(folder.name, manifest_bytes, damage)
            return False
        finally:
            for handle in handles.values():
                handle.close()
        self.damaged.pop(folder.name, None)  # saved again since, and whole this time
        self._said_uploaded(folder.name, manifest, time.monotonic() - started)
        return True

    def _partial(self, name: str, manifest: dict) -> bool:
        """A node's part of a step restored from S3: never uploaded (said once)."""
        if not checkpoint.absent_files(manifest):
            return False
        if name not in self.partial_seen:
            self.partial_seen.add(name)
            log("uploader", f"warning: {name} here holds only this node's shard files and S3 no "
                            "longer has it whole; it is not uploaded")
        return True

    def _put(self, name: str, manifest: dict, manifest_bytes: bytes, handles: dict) -> None:
        writer = self.writer
        redone = self.in_s3(name) is not None
        try:
            remote_checkpoints.put_checkpoint(writer.s3, self.ckpts, name, handles, manifest_bytes, manifest["files"],
                                              writer.write, writer.still_ours, self._same_bytes_in_s3(name, manifest),
                                              replaces=redone)
        finally:
            self.remote.pop(name, None)  # read again if asked: S3's manifest may be gone, or this one
        self.remote[name] = manifest["files"]

    def _said_damaged(self, name: str, manifest_bytes: bytes, damage: Exception) -> None:
        self.damaged[name] = manifest_bytes
        log("uploader", f"warning: {name} here does not match its manifest ({damage}); it is not committed "
                        "in S3 (what S3 had committed stays)")

    def _said_uploaded(self, name: str, manifest: dict, took: float) -> None:
        size = sum(e["size"] for e in manifest["files"].values())
        log("uploader", f"{name} is in S3: {size / 1e6:.1f} MB in {took:.1f}s "
                        f"({size / 1e6 / max(took, 1e-3):.0f} MB/s), manifest last")
        contract.event("uploaded", "uploader", name=name, step=checkpoint.parse_step(name),
                       bytes=size, seconds=round(took, 3))

    def _same_bytes_in_s3(self, folder_name: str, manifest: dict) -> dict[str, str]:
        """best/'s files that the step it is a copy of already has in S3: file name -> key."""
        meta = manifest.get("meta")
        step = meta.get("step") if isinstance(meta, dict) else None
        if checkpoint.parse_step(folder_name) is not None or not isinstance(step, int) or step < 0:
            return {}
        source = checkpoint.step_dir_name(step)
        remote = self.in_s3(source)
        return {name: self.ckpts.key(source, name) for name, entry in manifest["files"].items()
                if remote and remote.get(name) == entry}

    def apply_retention(self, keep: int) -> None:
        writer = self.writer
        objects = s3lib.list_objects(writer.s3, self.ckpts, writer.retry)
        listed = [item["Key"][len(self.ckpts.prefix):] for item in objects]
        ours = {s for s, _ in checkpoint.committed_steps(self.local)}
        for name, keys in remote_checkpoints.to_prune(listed, keep, ours):
            self.remote.pop(name, None)  # forgotten first: what S3 holds of it is read again if asked
            remote_checkpoints.prune(writer.s3, self.ckpts, name, keys, writer.write)
            log("uploader", f"retention: removed {name} from S3")


def keep_of(folder: Path) -> int:
    """The trainer's checkpoint.keep, which it records in each manifest (3 when it records none
    that makes sense: a trainer of one's own may write anything there)."""
    manifest = checkpoint.read_manifest(folder) or {}
    meta = manifest.get("meta")
    keep = meta.get("keep") if isinstance(meta, dict) else None
    return keep if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1 else 3


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
