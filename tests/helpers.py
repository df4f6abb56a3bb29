"""What the trainer tests share: the trainer's command line, and a run that can be killed when a
chosen line appears. Corpus and config builders come from lab/podlab.py."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import contract
from podlab import CODE, ROOT, TINY_CONFIG, VENV_BIN, venv_path, write_config, write_corpus  # noqa: F401

def train_command(cfg: Path, data: Path, out: Path, nproc: int = 1, extra: tuple = ()) -> list[str]:
    args = ["--config", str(cfg), "--data_dir", str(data), "--output_dir", str(out), *extra]
    if nproc == 1:
        return [sys.executable, str(CODE / "train.py"), *args]
    return [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
            str(CODE / "train.py"), *args]


def train_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = venv_path()
    env.update(extra)
    return env


def on_event(kind: str, **fields) -> Callable[[str], bool]:
    """A stop_when for run_until: the trainer's event (job/contract.py), not its prose."""
    return lambda line: contract.matches(contract.parse_event(line), kind, **fields)


def events_of(output: str, kind: str | None = None) -> list[dict]:
    """The event lines of an output, parsed (only those of `kind` if given)."""
    return [e for e in map(contract.parse_event, output.splitlines()) if e and kind in (None, e["event"])]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (parents before their children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """`sig` to a process and every process below it, all found before any is signalled: torchrun
    starts each worker in a session of its own, so a signal to torchrun's process group alone
    left the workers training on (and a "SIGKILLed" run finished its steps)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


def run_until(command: list[str], stop_when: str | Callable[[str], bool] | None = None, send: int = signal.SIGKILL,
              delay: float = 0.0, env: dict | None = None, timeout: float = 300,
              group: bool = False) -> tuple[int, str]:
    """Run a command; if a line containing `stop_when` appears (or one it accepts, if a function:
    on_event), wait `delay` s and send the signal (SIGKILL: to every process of the run, torchrun's
    workers included; any other signal with `group`: to its process group, as a pod's runtime
    signals torchrun; else to the process). Returns (exit code, output)."""
    if isinstance(stop_when, str):
        text = stop_when
        stop_when = lambda line: text in line  # noqa: E731
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or train_env(), start_new_session=True)
    lines, signalled = [], False
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if stop_when and not signalled and stop_when(line):
            time.sleep(delay)
            signalled = True
            if send == signal.SIGKILL:
                kill_tree(proc.pid)
            else:
                os.killpg(proc.pid, send) if group else proc.send_signal(send)
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise TimeoutError("".join(lines[-30:]))
    return proc.wait(), "".join(lines)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def final_model(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}" / "model.pt"
