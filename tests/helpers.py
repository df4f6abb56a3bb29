"""Small builders the tests share: a tiny corpus, a tiny config, and a trainer run that can be
killed when a chosen line appears."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "code"
VENV_BIN = Path(sys.executable).parent

TINY_CONFIG = {
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 256,
              "dropout": 0.1, "bias": False},
    "train": {"batch_size": 8, "grad_accum_steps": 2, "max_steps": 40, "learning_rate": 3e-3,
              "min_lr": 3e-4, "warmup_steps": 5, "seed": 7},
    "eval": {"interval": 10, "steps": 2},
    "checkpoint": {"interval": 5, "keep": 2},
    "log": {"interval": 1},
    "system": {"dtype": "float32", "compile": False},
}


def write_corpus(folder: Path, documents: int = 3000, seed: int = 0) -> Path:
    """Byte-level train.bin/val.bin of made-up sentences: enough structure to learn from."""
    rng = random.Random(seed)
    words = "the a cat dog runs jumps over under quick lazy brown fox sleeps eats red blue".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "."
                     for _ in range(documents))
    tokens = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)
    cut = int(len(tokens) * 0.9)
    folder.mkdir(parents=True, exist_ok=True)
    tokens[:cut].tofile(folder / "train.bin")
    tokens[cut:].tofile(folder / "val.bin")
    return folder


def write_config(path: Path, **overrides) -> Path:
    """TINY_CONFIG with `group__key=value` overrides, as YAML."""
    cfg = yaml.safe_load(yaml.safe_dump(TINY_CONFIG))
    for name, value in overrides.items():
        group, key = name.split("__")
        cfg[group][key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_command(cfg: Path, data: Path, out: Path, nproc: int = 1, extra: tuple = ()) -> list[str]:
    args = ["--config", str(cfg), "--data_dir", str(data), "--output_dir", str(out), *extra]
    if nproc == 1:
        return [sys.executable, str(CODE / "train.py"), *args]
    return [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
            str(CODE / "train.py"), *args]


def train_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def run_until(command: list[str], stop_when: str | None = None, send: int = signal.SIGKILL,
              delay: float = 0.0, env: dict | None = None, timeout: float = 300) -> tuple[int, str, float]:
    """Run a command; if a line containing `stop_when` appears, wait `delay` s and send the signal
    to its whole process group. Returns (exit code, output, seconds from signal to exit)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or train_env(), start_new_session=True)
    lines, signalled_at = [], None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if stop_when and signalled_at is None and stop_when in line:
            time.sleep(delay)
            signalled_at = time.monotonic()
            os.killpg(proc.pid, send) if send == signal.SIGKILL else proc.send_signal(send)
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError("".join(lines[-30:]))
    code = proc.wait()
    took = time.monotonic() - signalled_at if signalled_at else 0.0
    return code, "".join(lines), took


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def final_model(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}" / "model.pt"
