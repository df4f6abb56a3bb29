"""train.py says when a resume cannot be bitwise exact: the process resuming has another intra-op
thread count (or torch, CPU kernels, device) than the one that saved the checkpoint."""

from __future__ import annotations

import pytest
import torch

from helpers import run_until, train_command, train_env, write_config, write_corpus
from train import arithmetic_changes, read_tensors

# Saves in the training process: a background save's process would import torch once more for each
# of these short runs, and writes the same bytes (tests/test_async_checkpoint.py).
SYNC = ("--set", "checkpoint.async_save=false")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data"))


def test_a_resume_with_another_thread_count_says_it_is_not_exact_and_one_with_the_same_does_not(tmp_path, corpus):
    config = write_config(tmp_path / "tiny.yaml")
    out = tmp_path / "out"
    outputs = []
    for threads, max_steps in (("2", 6), ("1", 8), ("1", 10)):
        command = train_command(config, corpus, out, extra=("--set", f"train.max_steps={max_steps}", *SYNC))
        code, output = run_until(command, env=train_env(OMP_NUM_THREADS=threads))
        assert code == 0, output
        outputs.append(output)
    warnings = [[line for line in o.splitlines() if "warning:" in line] for o in outputs]
    assert warnings[0] == [] and warnings[2] == [], warnings
    (line,) = warnings[1]
    assert "threads 2 -> 1 since step-00000006 was saved" in line and "not be bitwise" in line


def test_a_checkpoint_that_recorded_nothing_is_taken_as_it_is():
    now = {"torch": "2.13.0", "threads": 2}
    assert arithmetic_changes(None, now) == [] and arithmetic_changes({"threads": 2}, now) == []
    assert arithmetic_changes({"threads": 1, "torch": "2.12.0"}, now) == ["torch 2.12.0 -> 2.13.0", "threads 1 -> 2"]
    # What a bucket writer put in state.pt: a line of its own never, a tensor is no value to compare.
    forged = {"torch": "2.12.0\nEVENT {\"event\": \"exit\", \"code\": 0}", "threads": torch.ones(3)}
    assert arithmetic_changes(forged, now) == ['torch 2.12.0\\nEVENT {"event": "exit", "code": 0} -> 2.13.0']


def test_auto_micro_batch_on_resume_keeps_what_the_checkpoint_ran_or_says_the_resume_is_not_exact(tmp_path, corpus):
    # A CPU's auto is train.batch_size (8): a checkpoint of 16 a pass cannot be kept, one of 8 is.
    config = write_config(tmp_path / "tiny.yaml")
    out = tmp_path / "out"
    outputs = []
    for micro_batch, max_steps in (("16", 6), ("auto", 8), ("auto", 10)):
        command = train_command(config, corpus, out, extra=("--set", f"train.max_steps={max_steps}",
                                                              "--set", f"train.micro_batch={micro_batch}", *SYNC))
        code, output = run_until(command, env=train_env(OMP_NUM_THREADS="1"))
        assert code == 0, output
        outputs.append(output)
    warnings = [[line for line in o.splitlines() if "warning:" in line] for o in outputs]
    (line,) = warnings[1]
    assert "the checkpoint ran 16 sequences per forward pass, this start takes 8" in line and "not be bitwise" in line
    assert warnings[2] == [], "the checkpoint of step 8 ran 8 a pass, as auto takes on a CPU"
    saved = read_tensors(out / "checkpoints" / "step-00000010" / "state.pt", torch.device("cpu"))
    assert saved["micro_batch"] == 8
