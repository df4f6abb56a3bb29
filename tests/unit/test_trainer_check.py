"""The shipped trainers' --check: the config and the arguments alone, exit 0 or 64 with one line,
without importing torch (the pod runs it before anything else: it must cost a second, not ten)
and without data, model or output folders (the pod has synced none of them yet)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_torch(tmp_path) -> dict:
    """An environment in which `import torch` (or transformers) fails loudly."""
    for name in ("torch", "transformers"):
        package = tmp_path / "poison" / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"raise ImportError('{name} imported by --check')\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "poison")}


def check(trainer: str, config: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    extra = ["--model_dir", "/nonexistent/model"] if trainer == "finetune.py" else []
    command = [sys.executable, str(ROOT / "code" / trainer), "--check", "--config", str(ROOT / "config" / config),
               *extra, "--data_dir", "/nonexistent/data", "--output_dir", "/nonexistent/out", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT / "code")


@pytest.mark.parametrize("trainer,config", [("train.py", "smoke.yaml"), ("finetune.py", "finetune.yaml")])
def test_good_settings_pass_without_torch_data_or_model(no_torch, trainer, config):
    result = check(trainer, config, "--set", "train.max_steps=7", env=no_torch)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.parametrize("trainer,config,args,message", [
    ("train.py", "smoke.yaml", ["--set", "train.max_step=7"], "unknown setting train.max_step; did you mean train.max_steps?"),
    ("train.py", "smoke.yaml", ["--set", "train.max_steps=many"], "train.max_steps must be an integer, got 'many'"),
    ("finetune.py", "finetune.yaml", ["--set", "lora.rnk=3"], "unknown setting lora.rnk"),
])
def test_a_typo_in_the_settings_is_one_line_and_64(no_torch, trainer, config, args, message):
    result = check(trainer, config, *args, env=no_torch)
    assert result.returncode == 64, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr


def test_the_world_size_is_checked_as_torchrun_will_start_it(no_torch):
    # smoke.yaml's grad_accum_steps is split between the processes.
    result = check("train.py", "smoke.yaml", "--set", "train.grad_accum_steps=4", env={**no_torch, "WORLD_SIZE": "3"})
    assert result.returncode == 64 and "must be divisible by the number of processes (3)" in result.stderr


def test_an_argument_the_trainer_lacks_is_argparses_usage_error(no_torch):
    result = check("train.py", "smoke.yaml", "--sett", "x=1", env=no_torch)
    assert result.returncode == 2 and "unrecognized arguments: --sett" in result.stderr.splitlines()[-1]
