"""The trainer's side of the pod's contract (contract.py), once for every trainer: its log lines and
events, the heartbeat, the stop that every process agrees on, and progress.json.

    import trainer_kit
    log = trainer_kit.logger("train")                  # "2026-01-01T00:00:00Z train: ..."
    trainer_kit.event("step", step=7, ...)             # global rank 0 only
    heartbeat = trainer_kit.Heartbeat(os.environ.get("HEALTH_FILE"))   # .beat() as work completes
    stop = trainer_kit.StopSignal().install()          # SIGTERM/SIGINT recorded
    signum = stop.agreed(group)                        # a collective: every rank, each step
    trainer_kit.write_progress(out, step=..., start_step=..., max_steps=..., ...)

train.py and hf_resume.py use it. It ships with the runtime (job/, on the trainer's PYTHONPATH) and
code/ links it, so a trainer of one's own finds it either way. torch is imported only by the stop's
collective.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable

import contract


def logger(name: str) -> Callable[[str], None]:
    """A function that prints one stamped line as `name`: what people read (tools read events)."""
    def log(message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        print(f"{stamp} {name}: {message}", flush=True)
    return log


def event(kind: str, **fields) -> None:
    """One of the trainer's events (contract.py), with the same source whichever trainer runs."""
    contract.event(kind, contract.TRAINER_SOURCE, **fields)


def finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: such a value is reported as null."""
    return value if value is not None and math.isfinite(value) else None


class Heartbeat:
    """Touches $HEALTH_FILE as work completes (at most every `every` s); a hung step lets it go
    stale for the liveness probe. No path (another local rank, no probe): does nothing."""

    def __init__(self, path: str | None, every: float = 2.0):
        self.path = Path(path) if path else None
        self.every = every
        self.last = float("-inf")

    def beat(self) -> None:
        now = time.monotonic()
        if self.path and now - self.last >= self.every:
            self.path.touch()
            self.last = now


class StopSignal:
    """SIGTERM/SIGINT ask for a stop at the next step boundary; every process agrees on it."""

    def __init__(self):
        self.signum = 0  # the first signal this process received

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)
        return self

    def _request(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def agreed(self, group=None) -> int:
        """The signal number if any process got one, else 0: a max over every rank's (a collective:
        each calls it at the same step). `group`: one of CPU tensors (gloo) when the default is NCCL."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum
        import torch

        flag = torch.tensor([self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def write_progress(output_dir: Path | str, *, step: int, start_step: int | None, max_steps: int,
                   train_loss: float | None, val_loss: float | None, best_val_loss: float | None,
                   best_step: int, speed: dict | None = None) -> None:
    """OUTPUT_DIR/progress.json (contract.PROGRESS_FILE), replaced whole: the uploader's COMPLETE
    waits for step == max_steps in it, status.py shows it. Rank 0 only."""
    progress = {"step": step, "start_step": start_step, "max_steps": max_steps, "train_loss": finite(train_loss),
                "val_loss": finite(val_loss), "best_val_loss": finite(best_val_loss), "best_step": best_step,
                "updated_at": time.time(), **(speed or {})}
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / contract.PROGRESS_FILE
    temp = path.with_suffix(".json.tmp")
    temp.write_text(json.dumps(progress))
    os.replace(temp, path)
