"""The pod runs code/finetune.py (TRAIN_SCRIPT) on a model snapshot from S3 (S3_MODEL_URI), through
the real job.yaml: a pod SIGKILLed once a checkpoint is in S3, then the next pod resumes from it
and completes, its adapter bitwise equal to an uninterrupted run's; a pod deleted mid-run commits
its step and the next redoes none. And the bad input S3_MODEL_URI can be: an empty prefix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pin it in requirements.txt)")
pytest.importorskip("peft", reason="LoRA needs peft (pin it in requirements.txt)")

from finetune_lab import make_jsonl, make_snapshot  # noqa: E402
from helpers import CODE, run_until  # noqa: E402
from podlab import BUCKET, ROOT, Run, tool_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]

MAX_STEPS = 60
CONFIG = f"""
model: {{method: lora, dtype: float32}}
lora: {{r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear}}
data: {{block_size: 32}}
train: {{batch_size: 4, grad_accum_steps: 2, max_steps: {MAX_STEPS}, learning_rate: 1.0e-3, warmup_steps: 2, seed: 7}}
eval: {{interval: 20, max_batches: 2}}
checkpoint: {{interval: 5, keep: 2}}
log: {{interval: 1}}
"""
MODEL_URI = f"s3://{BUCKET}/models/tiny-llama/"


@pytest.fixture
def finetune_run(s3, s3_endpoint, tmp_path, tool_path):
    """Code (with finetune.py) and a tiny Llama snapshot staged by stage.sh --model, JSONL data."""
    run = Run(s3, s3_endpoint, tmp_path, name="finetune")
    snapshot = make_snapshot(tmp_path / "snapshot")
    subprocess.run([str(ROOT / "scripts" / "stage.sh"), run.code_uri, "--model", str(snapshot), MODEL_URI],
                   check=True, capture_output=True, env=tool_env())
    data = make_jsonl(tmp_path / "data", 300)
    for name in ("train.jsonl", "val.jsonl"):
        s3.upload_file(str(data / name), BUCKET, f"data/{name}")
    s3.put_object(Bucket=BUCKET, Key="code/config/ft.yaml", Body=CONFIG.encode())
    return run


def finetune_env(**extra: str) -> dict:
    return {"TRAIN_SCRIPT": "finetune.py", "TRAIN_CONFIG": "config/ft.yaml", "S3_MODEL_URI": MODEL_URI, **extra}


def test_finetune_pod_killed_after_a_checkpoint_resumes_from_s3_and_completes(finetune_run):
    run = finetune_run
    pod = run.start(**finetune_env())
    pod.wait_for_event("uploaded", timeout=300)
    assert pod.lose_node(), "the pod had finished before the kill"
    assert pod.wait() == 137
    committed = run.committed_steps()
    assert committed and committed[0] < MAX_STEPS and "COMPLETE" not in run.keys(), pod.output
    assert "finetune.py --config config/ft.yaml --model_dir" in pod.output
    assert "model: " in pod.output and "sync model: done in" in pod.output

    code, second = run.run(**finetune_env())
    assert code == 0, second.output
    assert [e["step"] for e in second.events if e["event"] == "restore"] == [committed[0]], "the newest committed"
    assert f"resuming from step-{committed[0]:08d}" in second.output, "the Trainer went on from it"
    assert run.json("COMPLETE")["attempts"] == 2
    assert run.committed_steps()[0] == MAX_STEPS
    assert run.verify_in_s3(f"step-{MAX_STEPS:08d}") is None
    # The watching tools see a fine-tune run as they see a trainer run.
    shown = subprocess.run([sys.executable, str(ROOT / "scripts" / "status.py"), run.output_uri, "--json"],
                           capture_output=True, text=True, env=tool_env(), timeout=60)
    assert shown.returncode == 0, shown.stderr
    row = json.loads(shown.stdout)
    assert (row["state"], row["committed_step"], row["max_steps"], row["attempts"]) == ("completed", MAX_STEPS,
                                                                                         MAX_STEPS, 2), row
    assert row["train_loss"] is not None and row["val_loss"] is not None, row
    assert any(key.startswith("tensorboard/") and "tfevents" in key for key in run.keys()), "events went up"
    adapter = f"checkpoints/step-{MAX_STEPS:08d}/adapter_model.safetensors"
    assert run.read(adapter) == (uninterrupted(run.folder) / adapter).read_bytes(), "bitwise equal"


def uninterrupted(folder: Path) -> Path:
    """The same fine-tune (the fixture's snapshot and data) run once in one go by finetune.py alone."""
    (folder / "ft.yaml").write_text(CONFIG)
    out = folder / "reference"
    code, output = run_until([sys.executable, str(CODE / "finetune.py"), "--config", str(folder / "ft.yaml"),
                              "--model_dir", str(folder / "snapshot"), "--data_dir", str(folder / "data"),
                              "--output_dir", str(out)])
    assert code == 0, output
    return out


def test_empty_model_prefix_is_bad_input(finetune_run):
    run = finetune_run
    code, pod = run.run(**finetune_env(S3_MODEL_URI=f"s3://{BUCKET}/models/nothing-here/"))
    assert code == 64, pod.output
    errors = [line for line in pod.lines if "error: " in line]
    assert len(errors) == 1 and f"S3_MODEL_URI=s3://{BUCKET}/models/nothing-here/ is empty" in errors[0], pod.output
    # torchrun's workers may have started (they import torch while the model comes down), never the trainer.
    trainer_events = [e for e in pod.events if e["source"] not in ("script", "runtime")]
    assert not trainer_events and run.keys() == {}, "no trainer ran and nothing was written before the lease"


def test_finetune_pod_deleted_mid_run_commits_its_step_to_s3_and_the_next_pod_redoes_none(finetune_run):
    run = finetune_run
    pod = run.start(**finetune_env())
    pod.wait_for_event("uploaded", timeout=300)
    pod.delete()  # SIGTERM, as a drain or a preemption sends it
    assert pod.wait() == 143, pod.output
    stopped = re.search(r"SIGTERM: step (\d+) finished; committing", pod.output)
    assert stopped, pod.output
    step = int(stopped.group(1))
    assert run.committed_steps()[0] == step, "the step it stopped at is the newest committed in S3"
    assert run.verify_in_s3(f"step-{step:08d}") is None

    code, second = run.run(**finetune_env())
    assert code == 0, second.output
    assert f"resuming from step-{step:08d}" in second.output, "no step redone"
    assert run.committed_steps()[0] == MAX_STEPS
