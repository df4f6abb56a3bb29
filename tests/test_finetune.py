"""Hugging Face fine-tuning (code/finetune.py with hf_resume.py): a tiny random Llama and a
tokenizer trained here, saved as a local snapshot; the real transformers Trainer, peft and torchrun.
Exact resume after SIGKILL (LoRA and full, 1 and 2 processes), the SIGTERM save, a Trainer save
torn mid-write, what a run leaves on disk, and the bad-input exits."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pin it in requirements.txt)")

import checkpoint  # noqa: E402
from finetune_lab import make_jsonl, make_snapshot  # noqa: E402
from helpers import CODE, VENV_BIN, events_of, on_event, run_until, sha256, train_env  # noqa: E402

MAX_STEPS = 20
INTERVAL = 5
CONFIG = f"""
model:
  method: lora
  dtype: float32
lora:
  r: 4
  alpha: 8
  dropout: 0.1            # on, and attention_dropout in the model: resume must restore the RNG
  target_modules: all-linear
data:
  block_size: 32
train:
  batch_size: 4
  grad_accum_steps: 2
  max_steps: {MAX_STEPS}
  learning_rate: 1.0e-3
  warmup_steps: 2
  seed: 7
eval:
  interval: 10
  max_batches: 2
checkpoint:
  interval: {INTERVAL}
  keep: 2
log:
  interval: 1
"""
WEIGHTS = {"lora": "adapter_model.safetensors", "full": "model.safetensors"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune-lab")
    make_snapshot(root / "model")
    make_jsonl(root / "data", 300)
    (root / "finetune.yaml").write_text(CONFIG)
    return root


def command(lab: Path, out: Path, method: str = "lora", nproc: int = 1, extra: tuple = ()) -> list[str]:
    args = ["--config", str(lab / "finetune.yaml"), "--model_dir", str(lab / "model"), "--data_dir",
            str(lab / "data"), "--output_dir", str(out), "--set", f"model.method={method}", *extra]
    if nproc == 1:
        return [sys.executable, str(CODE / "finetune.py"), *args]
    return [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", str(CODE / "finetune.py"), *args]


def final_weights(out: Path, method: str) -> Path:
    return out / "checkpoints" / checkpoint.step_dir_name(MAX_STEPS) / WEIGHTS[method]


def uninterrupted(tmp_path_factory, lab, method: str, nproc: int = 1) -> Path:
    """The run's output folder; its heartbeat file lies beside it (copies of the run leave it out)."""
    out = tmp_path_factory.mktemp(f"reference-{method}-{nproc}")
    code, output = run_until(command(lab, out, method, nproc), env=train_env(HEALTH_FILE=str(heartbeat_of(out))))
    assert code == 0, output
    return out


def heartbeat_of(out: Path) -> Path:
    return out.with_name(f"{out.name}-healthy")


@pytest.fixture(scope="module")
def reference_lora(tmp_path_factory, lab):
    pytest.importorskip("peft", reason="LoRA needs peft (pin it in requirements.txt)")
    return uninterrupted(tmp_path_factory, lab, "lora")


@pytest.fixture(scope="module")
def reference_full(tmp_path_factory, lab):
    return uninterrupted(tmp_path_factory, lab, "full")


def kill_and_restart_until_done(cmd: list[str], seed: int, kills: int) -> list[str]:
    """SIGKILL the run when a randomly chosen step is logged (plus a few random ms, so kills land
    inside steps, evaluations and saves), start it again, until it finishes."""
    rng = random.Random(seed)
    outputs, killed = [], 0
    for _ in range(kills):
        step = rng.randint(INTERVAL + 1, MAX_STEPS - 4)  # after the first checkpoint: a restart resumes
        code, output = run_until(cmd, stop_when=on_event("step", step=step), delay=rng.uniform(0, 0.03))
        outputs.append(output)
        assert code in (-signal.SIGKILL, 0), output
        killed += code == -signal.SIGKILL
    assert killed, "no kill landed before the run finished"
    code, output = run_until(cmd)
    outputs.append(output)
    assert code == 0, output
    return outputs


# -- exact resume -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_resume_after_sigkill_is_bitwise_exact(tmp_path, lab, method, request):
    reference = request.getfixturevalue(f"reference_{method}")
    out = tmp_path / "out"
    # Two kills in a row of LoRA's run; one of the full run's (the same Trainer and resume path).
    kills = 2 if method == "lora" else 1
    outputs = kill_and_restart_until_done(command(lab, out, method), seed=3 if method == "lora" else 4, kills=kills)
    assert any("resuming from step-" in o for o in outputs[1:]), "no restart resumed from a checkpoint"
    assert sha256(final_weights(out, method)) == sha256(final_weights(reference, method))


@pytest.mark.slow
def test_two_processes_under_torchrun_resume_bitwise_exact(tmp_path_factory, tmp_path, lab, reference_lora):
    reference = uninterrupted(tmp_path_factory, lab, "lora", nproc=2)
    out = tmp_path / "out"
    outputs = kill_and_restart_until_done(command(lab, out, "lora", nproc=2), seed=5, kills=1)
    assert any("resuming from step-" in o for o in outputs[1:])
    final = out / "checkpoints" / checkpoint.step_dir_name(MAX_STEPS)
    assert sorted(p.name for p in final.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert sha256(final_weights(out, "lora")) == sha256(final_weights(reference, "lora"))


@pytest.mark.slow
@pytest.mark.parametrize("nproc,sig", [(1, signal.SIGTERM), (2, signal.SIGTERM), (1, signal.SIGINT)],
                         ids=["sigterm-1", "sigterm-2", "sigint-1"])
def test_sigterm_commits_the_current_step_exits_143_and_no_step_is_redone(tmp_path, lab, nproc, sig,
                                                                           reference_lora):
    out = tmp_path / "out"
    cmd = command(lab, out, "lora", nproc)
    code, output = run_until(cmd, stop_when=on_event("step", step=7), send=sig)
    if nproc == 1:  # torchrun reports its own code for a signalled worker
        assert code == 128 + sig, output
    stopped_at = int(re.search(rf"{sig.name}: step (\d+) finished", output).group(1))
    steps = [s for s, _ in checkpoint.committed_steps(out / "checkpoints")]
    assert steps[0] == stopped_at >= 7, (steps, stopped_at)  # the step it stopped at, committed
    assert not list(out.glob("checkpoint-*")), "a Trainer folder was left behind"
    assert [(e["signal"], e["step"]) for e in events_of(output, "stopped")] == [(sig.name, stopped_at)]  # rank 0's
    code, output = run_until(cmd)
    assert code == 0, output
    assert f"resuming from {checkpoint.step_dir_name(stopped_at)}" in output
    (resumed,) = events_of(output, "resumed")
    assert (resumed["step"], resumed["name"]) == (stopped_at, checkpoint.step_dir_name(stopped_at))
    trained = [e["step"] for e in events_of(output, "step")]
    assert trained[0] == stopped_at + 1, trained  # nothing redone
    assert [e["step"] for e in events_of(output, "done")] == [MAX_STEPS]
    if nproc == 1:
        assert sha256(final_weights(out, "lora")) == sha256(final_weights(reference_lora, "lora"))


@pytest.mark.slow
@pytest.mark.parametrize("max_steps", [MAX_STEPS, MAX_STEPS - INTERVAL], ids=["at-the-last-step", "past-it"])
def test_a_restart_from_the_last_step_or_past_it_trains_nothing_and_exits_0(tmp_path, lab, reference_lora,
                                                                           max_steps):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(reference_lora, out)
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    code, output = run_until(command(lab, out, extra=("--set", f"train.max_steps={max_steps}")))
    assert code == 0, output
    assert not events_of(output, "step") and not events_of(output, "checkpoint"), output
    assert [e["step"] for e in events_of(output, "done")] == [MAX_STEPS]
    assert {p.relative_to(out): p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == before
    progress = json.loads((out / "progress.json").read_text())
    assert (progress["step"], progress["max_steps"]) == (MAX_STEPS, max_steps)


# -- torn saves -------------------------------------------------------------------------------------

CRASH_IN_SAVE = """
import os, runpy, signal, sys
import transformers
crash_at = int(os.environ["CRASH_AT_STEP"])
original = transformers.Trainer._save_rng_state
def save_rng_state(self, output_dir):
    if self.state.global_step == crash_at:  # weights and optimizer are written, the rest is not
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, output_dir)
transformers.Trainer._save_rng_state = save_rng_state
sys.path.insert(0, os.path.dirname(sys.argv[1]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_trainer_save_killed_midway_is_never_resumed_from(tmp_path, lab, reference_lora):
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    wrapper = tmp_path / "crash_in_save.py"
    wrapper.write_text(CRASH_IN_SAVE)
    cmd = command(lab, out)
    env = train_env(CRASH_AT_STEP=str(2 * INTERVAL), HF_HUB_OFFLINE="1")
    code, output = run_until([cmd[0], str(wrapper), *cmd[1:]], env=env)
    assert code == -signal.SIGKILL, output
    torn = out / f"checkpoint-{2 * INTERVAL}"
    assert (torn / WEIGHTS["lora"]).is_file() and not (torn / "trainer_state.json").exists()
    # What the Trainer itself would resume from (transformers #35782): the torn folder.
    assert get_last_checkpoint(str(out)) == str(torn)

    code, output = run_until(cmd)
    assert code == 0, output
    assert f"warning: checkpoint-{2 * INTERVAL} is a Trainer save that never committed" in output
    assert f"resuming from {checkpoint.step_dir_name(INTERVAL)}" in output
    assert sha256(final_weights(out, "lora")) == sha256(final_weights(reference_lora, "lora"))


@pytest.mark.slow
def test_newest_step_folder_without_manifest_is_skipped(tmp_path, lab, reference_lora):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(reference_lora, out)
    newest = out / "checkpoints" / checkpoint.step_dir_name(MAX_STEPS)
    (newest / "manifest.json").unlink()
    code, output = run_until(command(lab, out))
    assert code == 0, output
    assert f"resuming from {checkpoint.step_dir_name(MAX_STEPS - INTERVAL)}" in output
    assert sha256(final_weights(out, "lora")) == sha256(final_weights(reference_lora, "lora"))


# -- what a run leaves ------------------------------------------------------------------------------

@pytest.mark.slow
def test_committed_checkpoints_hold_every_trainer_file_and_reports_are_written(reference_lora):
    out = reference_lora
    steps = [s for s, _ in checkpoint.committed_steps(out / "checkpoints")]
    assert steps == [MAX_STEPS, MAX_STEPS - INTERVAL]  # keep: 2
    folder = out / "checkpoints" / checkpoint.step_dir_name(MAX_STEPS)
    assert checkpoint.verify(folder) is None
    manifest = checkpoint.read_manifest(folder)
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt",
            "rng_state.pth", "trainer_state.json"} <= set(manifest["files"])
    assert manifest["meta"]["step"] == MAX_STEPS and manifest["meta"]["keep"] == 2
    assert manifest["meta"]["method"] == "lora"
    assert not list(out.glob("checkpoint-*"))
    progress = json.loads((out / "progress.json").read_text())
    assert progress["step"] == progress["max_steps"] == MAX_STEPS
    assert isinstance(progress["train_loss"], float) and isinstance(progress["val_loss"], float)
    assert heartbeat_of(out).exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"train/loss", "val/loss", "lr"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, MAX_STEPS + 1))


@pytest.mark.slow
def test_a_saved_dataset_dict_trains_and_evaluates(tmp_path, lab):
    import datasets

    from finetune_lab import sentences

    data = tmp_path / "dataset"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": sentences(200, seed=1)}),
                          "validation": datasets.Dataset.from_dict({"text": sentences(30, seed=2)})}
                         ).save_to_disk(str(data))
    out = tmp_path / "out"
    code, output = run_until(command(lab, out, "full", extra=("--data_dir", str(data), "--set", "train.max_steps=10")))
    assert code == 0, output
    assert "val loss" in output
    progress = json.loads((out / "progress.json").read_text())
    assert progress["step"] == 10 and isinstance(progress["val_loss"], float)


# -- any Trainer script --------------------------------------------------------------------------------

USER_SCRIPT = """
import sys
import datasets, torch
from transformers import (AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator)

model_dir, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
g = torch.Generator().manual_seed(0)
blocks = torch.randint(0, model.config.vocab_size, (64, 16), generator=g).tolist()
data = datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})
args = TrainingArguments(output_dir=out, max_steps=%(steps)d, per_device_train_batch_size=4, save_steps=%(interval)d,
                         save_total_limit=1, logging_steps=1, use_cpu=True, report_to="none", seed=3)
trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)

import hf_resume                                                # the change: these four lines
resume = hf_resume.attach(trainer)
trainer.train(resume_from_checkpoint=resume.checkpoint())
hf_resume.main_exit(resume.exit_code())
""" % {"steps": MAX_STEPS, "interval": INTERVAL}


@pytest.mark.slow
def test_a_plain_trainer_script_with_the_four_lines_resumes_exactly(tmp_path, lab):
    script = tmp_path / "user_train.py"
    script.write_text(USER_SCRIPT)
    env = train_env(PYTHONPATH=str(CODE), HF_HUB_OFFLINE="1")

    def cmd(out: Path) -> list[str]:
        return [sys.executable, str(script), str(lab / "model"), str(out)]

    code, output = run_until(cmd(tmp_path / "reference"), env=env)
    assert code == 0, output
    out = tmp_path / "out"
    code, output = run_until(cmd(out), stop_when=on_event("step", step=8), send=signal.SIGTERM, env=env)
    assert code == 143, output
    stopped_at = int(re.search(r"SIGTERM: step (\d+) finished", output).group(1))
    code, output = run_until(cmd(out), stop_when=on_event("step", step=stopped_at + 2), env=env)
    assert code == -signal.SIGKILL, output
    code, output = run_until(cmd(out), env=env)
    assert code == 0 and "resuming from step-" in output, output
    # save_total_limit=1 became keep=1: the newest committed checkpoint alone.
    assert [s for s, _ in checkpoint.committed_steps(out / "checkpoints")] == [MAX_STEPS]
    assert sha256(final_weights(out, "full")) == sha256(final_weights(tmp_path / "reference", "full"))


# -- bad input ----------------------------------------------------------------------------------------

def _without_text_field(lab: Path, tmp: Path) -> list[str]:
    data = make_jsonl(tmp / "data", 20, field="content")
    return ["--data_dir", str(data)]


def _saved_dataset_without_text_field(lab: Path, tmp: Path) -> list[str]:
    import datasets

    datasets.Dataset.from_dict({"body": ["a b c"] * 4}).save_to_disk(str(tmp / "ds"))
    return ["--data_dir", str(tmp / "ds")]


BAD_RUNS = [
    ("unknown key", lambda lab, tmp: ["--set", "train.max_step=5"],
     "unknown setting train.max_step; did you mean train.max_steps?"),
    ("wrong type", lambda lab, tmp: ["--set", "lora.r=many"], "lora.r must be an integer, got 'many'"),
    ("bad method", lambda lab, tmp: ["--set", "model.method=qlora"], "model.method must be lora or full"),
    ("missing snapshot", lambda lab, tmp: ["--model_dir", str(tmp / "nope")],
     "does not exist; save one with save_pretrained"),
    ("no text field", _without_text_field,
     "line 1 has no 'text' field (it has: content); add it, or set data.text_field"),
    ("saved dataset without text", _saved_dataset_without_text_field,
     "has no 'text' field (it has: body); add it, or set data.text_field"),
    ("too little data", lambda lab, tmp: ["--set", "data.block_size=100000"],
     "fewer than data.block_size (100000)"),
    ("fsdp on a cpu", lambda lab, tmp: ["--set", "train.parallelism=fsdp"],
     "train.parallelism: fsdp needs GPUs (accelerate shards a Trainer's model only across GPUs"),
]


@pytest.mark.parametrize("case,make,message", BAD_RUNS, ids=[c[0] for c in BAD_RUNS])
def test_bad_input_exits_64_with_one_line(tmp_path, lab, case, make, message):
    cmd = command(lab, tmp_path / "out") + make(lab, tmp_path)  # a later flag wins in argparse
    code, output = run_until(cmd)
    assert code == 64, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output


PRELOAD_PROBE = """
import json, os, sys
import huggingface_hub.constants as hub
print("REPORT " + json.dumps({"transformers": "transformers" in sys.modules, "trainer": "transformers.trainer" in sys.modules,
                              "hub_offline": hub.HF_HUB_OFFLINE, "env": os.environ.get("TRANSFORMERS_OFFLINE")}), flush=True)
"""


def test_the_shipped_finetune_py_finds_transformers_imported_offline_before_it_runs(tmp_path):
    """job/preload.py imports transformers for finetune.py during the restore (3.4 s here), with the
    hub offline as finetune.py's own first lines would have set it; never for another trainer."""
    reports = {}
    for name in ("finetune.py", "train.py"):
        folder = tmp_path / name.removesuffix(".py")
        folder.mkdir()
        (folder / name).write_text(PRELOAD_PROBE)
        (folder / "gate").write_text("go\n")
        done = subprocess.run([sys.executable, str(CODE.parent / "job" / "preload.py"), str(folder / "gate"),
                               str(folder / name)], capture_output=True, text=True, timeout=300,
                              env={"PATH": os.environ["PATH"], "PYTHONPATH": str(CODE.parent / "job"), "RANK": "1"})
        assert done.returncode == 0, done.stdout + done.stderr
        reports[name] = json.loads(done.stdout.split("REPORT ", 1)[1].splitlines()[0])
    assert reports["finetune.py"] == {"transformers": True, "trainer": True, "hub_offline": True, "env": "1"}
    assert reports["train.py"] == {"transformers": False, "trainer": False, "hub_offline": False, "env": None}
