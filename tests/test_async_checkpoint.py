"""Checkpoints committed by a background process (checkpoint.async_save, the default): the same
bytes as a synchronous save, exact resume after SIGKILL while a save is in flight, SIGTERM waits for
it, a dead save process fails the run loudly and leaves nothing that looks committed, and a save
requested while one is in flight waits for it. TRAIN_TEST_SAVE_DELAY holds each save mid-write."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import torch

import checkpoint
from helpers import final_model, on_event, run_until, sha256, train_command, train_env, write_config, write_corpus
from podlab import wait_until

MAX_STEPS = 40
SYNC = ("--set", "checkpoint.async_save=false")
SAVING = re.compile(r"saving (step-\d+) in the background \(pid (\d+)\)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("config") / "tiny.yaml")


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory, corpus, tiny_config):
    """An uninterrupted run that saves the old way, in the training process."""
    out = tmp_path_factory.mktemp("sync")
    code, output = run_until(train_command(tiny_config, corpus, out, extra=SYNC))
    assert code == 0, output
    assert "in the background" not in output
    return out


def same(a, b) -> bool:
    """Equal values, tensors equal in dtype, shape, strides and every bit."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(a.reshape(-1).view(torch.uint8),
                                                             b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def state_of(folder):
    state = torch.load(folder / "state.pt", weights_only=True)
    del state["config"]["checkpoint"]["async_save"]  # the one setting the two runs differ in
    return state


def committed(out) -> list[int]:
    return [s for s, _ in checkpoint.committed_steps(out / "checkpoints")]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def run_acting_on(command, env, act) -> tuple[int, str]:
    """Run the trainer; `act(line, proc)` sees each output line as it comes."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        act(line, proc)
    return proc.wait(timeout=300), "".join(lines)


def test_background_saves_write_the_bytes_a_synchronous_save_writes(tmp_path, corpus, tiny_config, sync_reference):
    out = tmp_path / "out"
    code, output = run_until(train_command(tiny_config, corpus, out))
    assert code == 0, output
    assert "saving step-00000005 in the background" in output
    assert f"checkpoint step-{MAX_STEPS:08d} committed" in output.split("done: step")[0], "waited for the last"
    assert committed(out) == committed(sync_reference) == [MAX_STEPS, MAX_STEPS - 5]
    for folder in (f"step-{MAX_STEPS:08d}", f"step-{MAX_STEPS - 5:08d}", "best"):
        assert sha256(out / "checkpoints" / folder / "model.pt") == \
            sha256(sync_reference / "checkpoints" / folder / "model.pt")
        assert checkpoint.verify(out / "checkpoints" / folder) is None
        if folder != "best":  # its bytes differ only where pickle's memo of a string does (sent between processes)
            assert same(state_of(out / "checkpoints" / folder), state_of(sync_reference / "checkpoints" / folder))
    assert checkpoint.read_manifest(out / "checkpoints" / "best")["meta"]["step"] == \
        checkpoint.read_manifest(sync_reference / "checkpoints" / "best")["meta"]["step"]
    assert not list((out / "checkpoints").glob(".staging-*"))


def test_sigkill_of_the_trainer_mid_save_commits_nothing_and_resume_is_bitwise_exact(
        tmp_path, corpus, tiny_config, sync_reference):
    out = tmp_path / "out"
    command = train_command(tiny_config, corpus, out)
    saver = {}

    def kill_trainer_only(line, proc):  # not its group: the save process must die with the trainer
        match = SAVING.search(line)
        if match and match.group(1) == "step-00000020" and not saver:
            saver["pid"] = int(match.group(2))
            # Mid-write: the save process has its staging folder (it then sleeps TRAIN_TEST_SAVE_DELAY);
            # the line alone can come before it has read the request.
            wait_until(lambda: list((out / "checkpoints").glob(".staging-step-00000020-*")), 30, interval=0.01)
            os.kill(proc.pid, signal.SIGKILL)

    code, output = run_acting_on(command, train_env(TRAIN_TEST_SAVE_DELAY="3"), kill_trainer_only)
    assert code == -signal.SIGKILL, output
    deadline = time.monotonic() + 60
    while alive(saver["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(saver["pid"]), "the save process outlived the trainer"
    assert 20 not in committed(out) and committed(out)[0] == 15, (committed(out), output)
    assert list((out / "checkpoints").glob(".staging-step-00000020-*")), "killed mid-write"
    code, output = run_until(command)
    assert code == 0 and "resumed from step-00000015" in output, output
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(sync_reference, MAX_STEPS))


def test_killed_save_process_fails_the_run_with_one_line_and_nothing_looks_committed(tmp_path, corpus, tiny_config):
    out = tmp_path / "out"

    def kill_saver(line, proc):
        match = SAVING.search(line)
        if match and match.group(1) == "step-00000010":
            os.kill(int(match.group(2)), signal.SIGKILL)

    code, output = run_acting_on(train_command(tiny_config, corpus, out), train_env(TRAIN_TEST_SAVE_DELAY="2"),
                                 kill_saver)
    assert code == 1, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert "the checkpoint save process died (exit code -9) while writing step-00000010" in errors[0]
    assert committed(out) == [5], "step 10 was never committed"
    assert checkpoint.verify(out / "checkpoints" / "step-00000005") is None


def test_sigterm_while_a_save_is_in_flight_commits_it_and_the_current_step(tmp_path, corpus, tiny_config,
                                                                          sync_reference):
    out = tmp_path / "out"
    command = train_command(tiny_config, corpus, out)
    code, output = run_until(command, stop_when="saving step-00000010 in the background", send=signal.SIGTERM,
                             env=train_env(TRAIN_TEST_SAVE_DELAY="2"))
    assert code == 143, output
    stopped_at = int(re.search(r"SIGTERM: step (\d+) finished", output).group(1))
    assert "checkpoint step-00000010 committed" in output
    assert committed(out)[0] == stopped_at >= 10 and 10 in committed(out), (committed(out), output)
    assert not list((out / "checkpoints").glob(".staging-*"))
    code, output = run_until(command)
    assert code == 0 and f"resumed from step-{stopped_at:08d}" in output, output
    assert sha256(final_model(out, MAX_STEPS)) == sha256(final_model(sync_reference, MAX_STEPS))


def test_a_save_requested_while_one_is_in_flight_waits_for_it_and_says_so(tmp_path, corpus, tiny_config):
    out = tmp_path / "out"
    code, output = run_until(train_command(tiny_config, corpus, out, extra=(
        "--set", "train.max_steps=3", "--set", "checkpoint.interval=1", "--set", "eval.interval=1")),
        env=train_env(TRAIN_TEST_SAVE_DELAY="5"))
    assert code == 0, output
    assert re.search(r"waited [\d.]+s for checkpoint step-00000001 to commit before taking step-00000002", output)
    assert re.search(r"waited [\d.]+s for checkpoint step-00000002 to commit before taking step-00000003", output)
    assert committed(out) == [3, 2]


def test_sigterm_to_the_process_group_while_the_save_process_starts_does_not_kill_it(tmp_path, corpus, tiny_config):
    # torchrun stops a worker with SIGTERM to its process group, the save process included; at the
    # first step the save process is still importing torch, before it could ignore the signal.
    out = tmp_path / "out"
    code, output = run_until(train_command(tiny_config, corpus, out), stop_when=on_event("step", step=1),
                             send=signal.SIGTERM, group=True)
    assert code == 143, output
    assert "save process died" not in output, output
    stopped_at = int(re.search(r"SIGTERM: step (\d+) finished", output).group(1))
    assert committed(out)[0] == stopped_at, output
