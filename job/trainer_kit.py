"""The trainer's side of the pod's contract (contract.py), once for every trainer: its log lines and
events, the heartbeat, the stop that every process agrees on, and progress.json.

    import trainer_kit
    log = trainer_kit.logger("train")                  # "2026-01-01T00:00:00Z train: ..."
    trainer_kit.event("step", step=7, ...)             # global rank 0 only
    heartbeat = trainer_kit.Heartbeat(os.environ.get("HEALTH_FILE"))   # .beat() as work completes
    stop = trainer_kit.StopSignal().install()          # SIGTERM/SIGINT recorded
    signum = stop.agreed(group)                        # a collective: every rank, each step
    trainer_kit.write_progress(out, step=..., start_step=..., max_steps=..., ...)
    code = trainer_kit.group_failure_code(err, trained)    # a peer gone: 138 (or 75 before a step)
    trainer_kit.report_failure(message, rank, code)       # one line, and torchrun's error file

train.py and hf_resume.py use it. It ships with the runtime (job/, on the trainer's PYTHONPATH) and
code/ links it, so a trainer of one's own finds it either way. torch is imported only by the stop's
collective.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import contract


def logger(name: str) -> Callable[[str], None]:
    """A function that prints one stamped line as `name`: what people read (tools read events)."""
    def log(message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        contract.write_line(f"{stamp} {name}: {message}")
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


def stop_save_durable() -> bool:
    """Whether the save after a stop signal is fsynced: not in a pod (S3_OUTPUT_URI set), where the
    final upload puts it in S3, hashing each file as it sends it, and every start hashes a local
    copy before it is used; a run outside a pod has only the local copy. A save that is not
    fsynced prunes nothing: the step before it stays whole on disk until the next save."""
    return not os.environ.get("S3_OUTPUT_URI")


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


# How a collective fails when the process at the other end is gone: its socket closed by the
# kernel (pod killed, SIGKILL, OOM) or no answer within the process group's timeout (node lost).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")
_DIST_ERRORS = ("DistNetworkError", "DistBackendError", "DistStoreError")


def peer_lost(err: BaseException) -> bool:
    """Whether ERR is another process of the group gone, not a fault of this one."""
    text = str(err)
    if type(err).__name__ in _DIST_ERRORS:
        return True
    return isinstance(err, RuntimeError) and "gloo" in text and any(marker in text for marker in _PEER_GONE)


_PEER_DIED = ("Connection closed by peer", "Connection reset by peer")


def group_failure_code(err: BaseException, trained: bool) -> int | None:
    """The exit code for a collective that failed, or None when ERR is the trainer's own fault.
    138 when the group had formed: it trained a step here, or the peer was there and its
    connection closed (its pod died; its own exit is what the Job counts). 75 otherwise: a group
    that never gets that far (a wrong address, a firewall, timeouts) must use up the Job's retries,
    not restart forever."""
    if not peer_lost(err):
        return None
    if trained or any(marker in str(err) for marker in _PEER_DIED):
        return contract.EXIT_PEER_LOST
    return contract.EXIT_UNAVAILABLE


def record_exit(code: int, message: str) -> None:
    """torchelastic's error file with CODE, no line: torchrun exits 1 whatever its workers' codes,
    and a node stopped by its peers' signal has nothing to say on stderr."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        payload = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
        Path(error_file).write_text(json.dumps(payload))


def report_failure(message: str, rank: int, code: int = contract.EXIT_BAD_INPUT) -> int:
    """One line on stderr (rank 0), and torchelastic's error file, so the pod learns the code:
    torchrun itself exits 1 whatever its workers' codes, and copies this file with theirs."""
    if rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    record_exit(code, message)
    return code


def writer_not_on_node0(rank: int) -> str | None:
    """Rank 0 writes the checkpoints, and in a group of pods only node 0 uploads them (job/script.sh:
    NODE_RANK; torchrun: GROUP_RANK, this node's place in its rendezvous). Were they different
    nodes, every checkpoint would stay on a disk nobody uploads: the one line saying so, or None."""
    node, group = os.environ.get("NODE_RANK"), os.environ.get("GROUP_RANK")
    if rank == 0 and node not in (None, "0") and group == "0":
        return (f"global rank 0 (the checkpoint writer) runs on node {node}, not on node 0, which uploads; the "
                f"pods' names must sort with node 0 first (<run>-0, <run>-1, ...: scripts/submit.py names them so)")
    return None
