"""The trainer: exact resume after SIGKILL (1 and 2 processes), the SIGTERM save, checkpoint
fallbacks, what it logs, and every config error path."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import checkpoint
from helpers import (events_of, final_model, on_event, run_until, sha256, train_command, train_env,
                     write_config, write_corpus)

MAX_STEPS = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("config") / "tiny.yaml")


def uninterrupted(tmp_path_factory, corpus, tiny_config, nproc):
    """The run's output folder; its log and heartbeat file lie beside it (copies of it leave them out)."""
    out = tmp_path_factory.mktemp(f"reference-{nproc}")
    code, output = run_until(train_command(tiny_config, corpus, out, nproc),
                             env=train_env(HEALTH_FILE=str(beside(out, "healthy"))))
    assert code == 0, output
    beside(out, "output.txt").write_text(output)
    return out


def beside(out: Path, name: str) -> Path:
    return out.with_name(f"{out.name}-{name}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, tiny_config):
    return uninterrupted(tmp_path_factory, corpus, tiny_config, 1)


@pytest.fixture(scope="module")
def reference_2proc(tmp_path_factory, corpus, tiny_config):
    return uninterrupted(tmp_path_factory, corpus, tiny_config, 2)


def kill_and_restart_until_done(command, seed: int, kills: int) -> list[str]:
    """SIGKILL the run when a randomly chosen step is logged (plus a random few ms, so kills land
    inside steps, evals and checkpoint writes), start it again, until it finishes."""
    rng = random.Random(seed)
    outputs = []
    for _ in range(kills):
        step = rng.randint(2, MAX_STEPS - 2)
        code, output = run_until(command, stop_when=on_event("step", step=step), delay=rng.uniform(0, 0.05))
        outputs.append(output)
        assert code in (-signal.SIGKILL, 0), output
        assert code == 0 or not events_of(output, "done"), "a killed run trains no further (its workers too)"
    code, output = run_until(command)
    outputs.append(output)
    assert code == 0, output
    return outputs


def test_resume_after_sigkill_is_bitwise_exact_one_process(tmp_path, corpus, tiny_config, reference):
    out = tmp_path / "out"
    outputs = kill_and_restart_until_done(train_command(tiny_config, corpus, out), seed=1, kills=3)
    assert any("resumed from step-" in o for o in outputs[1:]), "no restart resumed from a checkpoint"
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(reference, MAX_STEPS))


def test_resume_after_sigkill_is_bitwise_exact_two_processes(tmp_path, corpus, tiny_config, reference_2proc):
    out = tmp_path / "out"
    outputs = kill_and_restart_until_done(train_command(tiny_config, corpus, out, nproc=2), seed=2, kills=2)
    assert any("resumed from step-" in o for o in outputs[1:])
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(reference_2proc, MAX_STEPS))


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_commits_the_current_step_and_exits_143(tmp_path, corpus, tiny_config, nproc, reference,
                                                        reference_2proc):
    out = tmp_path / "out"
    command = train_command(tiny_config, corpus, out, nproc)
    code, output = run_until(command, stop_when=on_event("step", step=12), send=signal.SIGTERM)
    if nproc == 1:
        assert code == 143, output
    stopped_at = int(re.search(r"SIGTERM: step (\d+) finished", output).group(1))
    steps = [s for s, _ in checkpoint.committed_steps(out / "checkpoints")]
    assert steps[0] == stopped_at >= 12, (steps, stopped_at)  # the step it stopped at, saved
    (stopped,) = events_of(output, "stopped")  # rank 0 alone says it, once it is committed
    assert stopped["signal"] == "SIGTERM" and stopped["step"] == stopped_at
    assert events_of(output, "checkpoint")[-1]["step"] == stopped_at and not events_of(output, "done")
    code, output = run_until(command)
    assert code == 0 and f"resumed from step-{steps[0]:08d}" in output
    expected = reference if nproc == 1 else reference_2proc
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(expected, MAX_STEPS))


def test_a_two_process_run_and_its_resume_print_each_event_once(tmp_path, corpus, tiny_config):
    """What tools wait on (job/contract.py), printed by rank 0 alone: the first start saves in the
    background (checkpoint.async_save's default), the resume synchronously. ~12 s on 2 cores."""
    out = tmp_path / "out"
    for max_steps, async_save, start, saved in ((6, "true", 0, [5, 6]), (10, "false", 6, [10])):
        code, output = run_until(train_command(tiny_config, corpus, out, nproc=2, extra=(
            "--set", f"train.max_steps={max_steps}", "--set", f"checkpoint.async_save={async_save}")))
        assert code == 0, output
        events = events_of(output)
        assert all(e["source"] == "train" for e in events)
        assert [e["event"] for e in events][0] == "resumed" and [e["event"] for e in events][-1] == "done"
        (resumed,) = events_of(output, "resumed")
        assert resumed["step"] == start and resumed["seconds"] >= 0
        assert resumed["name"] == (checkpoint.step_dir_name(start) if start else None)
        steps = events_of(output, "step")
        assert [e["step"] for e in steps] == list(range(start + 1, max_steps + 1))
        assert all(e["max_steps"] == max_steps and e["loss"] > 0 and e["tokens_per_s"] > 0 for e in steps)
        saves = events_of(output, "checkpoint")
        assert [e["step"] for e in saves] == saved
        for save in saves:
            assert save["name"] == checkpoint.step_dir_name(save["step"]) and save["state"] == "committed"
            assert save["bytes"] == sum(p.stat().st_size for p in (out / "checkpoints" / save["name"]).iterdir())
            assert 0 <= save["blocked_seconds"] <= save["seconds"]
            if async_save == "false":
                assert save["blocked_seconds"] == save["seconds"], "a synchronous save blocks throughout"
        (done,) = events_of(output, "done")
        assert done["step"] == max_steps


def test_resume_skips_checkpoint_without_manifest(tmp_path, corpus, tiny_config, reference):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    newest = out / "checkpoints" / f"step-{MAX_STEPS:08d}"
    (newest / "manifest.json").unlink()
    torn = out / "checkpoints" / "step-99999999"
    shutil.copytree(out / "checkpoints" / f"step-{MAX_STEPS - 5:08d}", torn)
    (torn / "manifest.json").unlink()
    code, output = run_until(train_command(tiny_config, corpus, out))
    assert code == 0, output
    assert f"resumed from step-{MAX_STEPS - 5:08d}" in output
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(reference, MAX_STEPS))


def test_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path, corpus, tiny_config, reference):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    model = final_model(out, MAX_STEPS)
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(data)
    code, output = run_until(train_command(tiny_config, corpus, out))
    assert code == 0, output
    assert f"skipping checkpoint step-{MAX_STEPS:08d}: model.pt does not match its sha256" in output
    assert f"resumed from step-{MAX_STEPS - 5:08d}" in output
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(reference, MAX_STEPS))


def test_checkpoints_follow_the_contract(reference):
    root = reference / "checkpoints"
    steps = [s for s, _ in checkpoint.committed_steps(root)]
    assert steps == [MAX_STEPS, MAX_STEPS - 5], "keep: 2 newest, the last step always saved"
    assert not list(root.glob(".staging-*"))
    for folder in [p for _, p in checkpoint.committed_steps(root)] + [root / "best"]:
        assert checkpoint.verify(folder) is None
        weights = torch.load(folder / "model.pt", weights_only=True)
        assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights)
    meta = checkpoint.read_manifest(root / "best")["meta"]
    assert meta["val_loss"] == meta["best_val_loss"] and meta["step"] % 10 == 0
    state = torch.load(root / f"step-{MAX_STEPS:08d}" / "state.pt", weights_only=True)
    assert {"optimizer", "step", "rng", "best_val_loss", "data", "config"} <= set(state)


def test_verify_names_the_damaged_file_whichever_it_is(tmp_path):
    def committed() -> Path:
        folder = tmp_path / checkpoint.step_dir_name(len(list(tmp_path.iterdir())))
        with checkpoint.stage(folder) as staged:
            for name in ("a.pt", "b.pt", "c.pt"):
                with staged.open(name) as file:
                    file.write(name.encode() * 100_000)
            staged.commit()
        assert checkpoint.verify(folder) is None
        return folder

    flipped = committed()
    with open(flipped / "c.pt", "r+b") as file:
        file.seek(150_000)
        file.write(b"X")
    assert checkpoint.verify(flipped) == "c.pt does not match its sha256 in the manifest"
    assert checkpoint.verify(flipped, full=False) is None, "sizes only"
    truncated = committed()
    os.truncate(truncated / "b.pt", 10)
    assert checkpoint.verify(truncated) == "b.pt has 10 bytes, manifest says 400000"
    two = committed()
    (two / "c.pt").unlink()
    os.truncate(two / "b.pt", 10)
    assert checkpoint.verify(two) == "b.pt has 10 bytes, manifest says 400000", "the first in name order"
    assert checkpoint.verify(committed().parent / "nothing") == "no readable manifest.json"


def test_training_lowers_the_loss_and_logs_scalars_to_tensorboard(reference):
    files = list((reference / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, "one event file per start"
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert {"train/loss", "val/loss", "lr", "tokens_per_sec"} <= set(events.Tags()["scalars"])
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == MAX_STEPS
    assert losses[-1] < losses[0] - 1.0


def test_log_line_has_step_loss_lr_speed_and_eta(reference):
    output = beside(reference, "output.txt").read_text()
    line = next(l for l in output.splitlines() if f"step {MAX_STEPS}/{MAX_STEPS} |" in l)
    for part in ("loss ", "lr ", "ms/step", "tok/s", "eta "):
        assert part in line, line


def test_heartbeat_file_is_touched_while_training(reference):
    assert beside(reference, "healthy").exists()


BAD_RUNS = [
    ("missing config", lambda tmp, cfg, data: (tmp / "nope.yaml", data), "cannot read config"),
    ("bad config", lambda tmp, cfg, data: (write_config(tmp / "b.yaml", model__n_head=5), data), "model.n_embd (32) must be divisible"),
    ("no train.bin", lambda tmp, cfg, data: (cfg, tmp), "train.bin not found; run scripts/prepare_data.py"),
    ("vocab smaller than data", lambda tmp, cfg, data: (cfg, with_meta(tmp, data, 50257)), "model.vocab_size (256) is smaller than the data's vocabulary (50257"),
]


def with_meta(tmp, data, vocab):
    target = tmp / "data-meta"
    shutil.copytree(data, target)
    (target / "meta.json").write_text(f'{{"vocab_size": {vocab}}}')
    return target


@pytest.mark.parametrize("case,make,message", BAD_RUNS, ids=[c[0] for c in BAD_RUNS])
def test_bad_input_exits_64_with_one_line(tmp_path, corpus, tiny_config, case, make, message):
    cfg, data = make(tmp_path, tiny_config, corpus)
    result = subprocess.run(train_command(cfg, data, tmp_path / "out"), capture_output=True, text=True,
                            env=train_env())
    assert result.returncode == 64, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_checkpoint_of_another_model_shape_exits_64(tmp_path, corpus, reference):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    wider = write_config(tmp_path / "wide.yaml", model__n_embd=64)
    result = subprocess.run(train_command(wider, corpus, out), capture_output=True, text=True, env=train_env())
    assert result.returncode == 64
    assert f"checkpoint step-{MAX_STEPS:08d} was trained with model.n_embd=32 but the config says 64" in result.stderr


def test_config_error_under_torchrun_reaches_the_error_file_with_code_64(tmp_path, corpus):
    bad = write_config(tmp_path / "b.yaml", train__grad_accum_steps=3)
    error_file = tmp_path / "error.json"
    result = subprocess.run(train_command(bad, corpus, tmp_path / "out", nproc=2), capture_output=True,
                            text=True, env=train_env(TORCHELASTIC_ERROR_FILE=str(error_file)))
    assert result.returncode != 0
    assert '"errorCode": 64' in error_file.read_text()
    assert "must be divisible by the number of processes (2)" in error_file.read_text()


def test_restart_after_the_last_checkpoint_finishes_at_once(tmp_path, corpus, tiny_config, reference):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    code, output = run_until(train_command(tiny_config, corpus, out))
    assert code == 0, output
    assert f"resumed from step-{MAX_STEPS:08d}" in output and f"done: step {MAX_STEPS}, train loss 3." in output
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(reference, MAX_STEPS))


def test_a_checkpoint_past_a_lowered_max_steps_is_a_finished_run(tmp_path, corpus, reference):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    lowered = write_config(tmp_path / "lowered.yaml", train__max_steps=MAX_STEPS - 10)
    code, output = run_until(train_command(lowered, corpus, out))
    assert code == 0, output
    assert not events_of(output, "step") and not events_of(output, "checkpoint"), "nothing trained or saved"
    assert [e["step"] for e in events_of(output, "done")] == [MAX_STEPS]
    progress = json.loads((out / "progress.json").read_text())
    assert (progress["step"], progress["max_steps"]) == (MAX_STEPS, MAX_STEPS - 10)  # what the uploader judges
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(reference, MAX_STEPS))
