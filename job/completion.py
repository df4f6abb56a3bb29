"""COMPLETE, written last of all after the trainer exited 0: the run is finished.

    Completion(writer, out, checkpoints, status).write()   # False (and why, logged) when not yet

It is written once the trainer's last step is in S3: the step progress.json reports as max_steps
(or past it: a run restored from a checkpoint beyond a lowered max_steps is done), or for a trainer
that writes no progress.json, its newest committed step. With CHECKPOINT_HMAC_KEY set it is signed
for this run (checkpoint.signed_complete): lease.py trusts no other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import checkpoint
import contract
from checkpoint_sync import CheckpointSync
from run_status import RunStatus, pod_name, read_progress
from run_writer import RunWriter
from s3 import log


class Completion:
    def __init__(self, writer: RunWriter, out: Path, checkpoints: CheckpointSync, status: RunStatus):
        self.writer, self.out, self.checkpoints, self.status = writer, out, checkpoints, status

    def write(self) -> bool:
        progress = read_progress(self.out)
        newest = max((s for s, _ in checkpoint.committed_steps(self.out / contract.CHECKPOINTS_DIR)), default=None)
        last, why = step_to_complete(progress, newest)
        if last is not None and self.checkpoints.in_s3(checkpoint.step_dir_name(last)) is None:
            last, why = None, f"step {last} is not in S3"
        if last is None:
            log("uploader", f"not writing COMPLETE: {why}")
            return False
        summary = checkpoint.signed_complete(self._summary(last, progress))  # with CHECKPOINT_HMAC_KEY: signed
        log("uploader", "writing COMPLETE...")
        contract.event("complete", "uploader", state="writing", step=last)
        self.writer.put_json(self.writer.run.key(contract.COMPLETE_KEY), summary)
        shown = {k: v for k, v in summary.items() if k != "hmac"}
        log("uploader", f"wrote {self.writer.run}COMPLETE: {json.dumps(shown)}")
        contract.event("complete", "uploader", state="written", step=last)
        return True

    def _summary(self, last: int, progress: dict) -> dict:
        attempts = self.status.attempts
        seconds = sum((a.get("ended_at") or time.time()) - a["started_at"] for a in attempts)
        return {"steps": last, "train_loss": progress.get("train_loss"), "val_loss": progress.get("val_loss"),
                "best_val_loss": progress.get("best_val_loss"), "best_step": progress.get("best_step"),
                "attempts": len(attempts) or 1, "wall_seconds": round(seconds, 1),
                "completed_at": time.time(), "pod": self.status.attempt.get("pod", pod_name())}


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
