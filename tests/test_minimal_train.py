"""code/minimal_train.py, the example a user copies: on its own (SIGTERM or SIGINT commits and exits 143 or 130,
SIGKILL and the same command again end bitwise equal to an uninterrupted run, bad settings exit 64),
and as a user's own folder staged with stage.sh --code and run by the real job.yaml: the node lost
once a checkpoint is in S3, the next pod resumes from it and completes, bitwise equal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import checkpoint
from kill_sweep import checkpoint_differences
from podlab import CODE, ROOT, Run, tool_env, wait_until, write_corpus

SCRIPT = CODE / "minimal_train.py"
# ~10 ms a step on one core: long enough for a signal to land mid-run, short enough to run often.
SETTINGS = {"max_steps": 100, "save_every": 10, "keep": 2, "batch_size": 256, "seed": 3}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data"))


def settings_file(folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "settings.yaml"
    path.write_text(yaml.safe_dump({**SETTINGS, **overrides}))
    return path


def start(config: Path, data: Path, out: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), "--config", str(config), "--data_dir", str(data),
                             "--output_dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=300)
    return proc.returncode, output


def progress_step(out: Path) -> int:
    try:
        return json.loads((out / "progress.json").read_text())["step"]
    except (OSError, ValueError):
        return 0


def final_state(out: Path, step: int) -> Path:
    folder = out / "checkpoints" / checkpoint.step_dir_name(step)
    assert checkpoint.verify(folder) is None
    return folder


def assert_same(folder: Path, reference: Path) -> None:
    """model.pt byte for byte; state.pt (optimizer, RNG, step) value by value and tensor by tensor
    (its bytes differ with pickle's memo: a resumed optimizer's key strings are other objects)."""
    assert (folder / "model.pt").read_bytes() == (reference / "model.pt").read_bytes()
    assert checkpoint_differences(folder, reference) == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The uninterrupted run's last checkpoint."""
    folder = tmp_path_factory.mktemp("reference")
    code, output = finish(start(settings_file(folder), corpus, folder / "out"))
    assert code == 0, output
    return final_state(folder / "out", SETTINGS["max_steps"])


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_signal_commits_the_step_and_exits_128_plus_it_then_the_same_command_completes_exactly(
        tmp_path, corpus, reference, stop_signal):
    config, out, health = settings_file(tmp_path), tmp_path / "out", tmp_path / "healthy"
    proc = start(config, corpus, out, HEALTH_FILE=str(health))
    assert wait_until(lambda: progress_step(out) >= 20, 120, interval=0.01), "never reached step 20"
    proc.send_signal(stop_signal)
    code, output = finish(proc)
    assert code == 128 + stop_signal, output
    stopped = progress_step(out)
    assert stopped < SETTINGS["max_steps"]
    assert checkpoint.committed_steps(out / "checkpoints")[0][0] == stopped, "the step it stopped at is committed"
    assert health.exists(), "the heartbeat was touched"
    code, output = finish(start(config, corpus, out))
    assert code == 0 and f"resumed from {checkpoint.step_dir_name(stopped)}" in output, output
    assert_same(final_state(out, SETTINGS["max_steps"]), reference)


def test_sigkill_anywhere_then_the_same_command_ends_bitwise_equal(tmp_path, corpus, reference):
    config, out = settings_file(tmp_path), tmp_path / "out"
    for step in (15, 62):  # between checkpoints: steps are redone from the newest committed one
        proc = start(config, corpus, out)
        assert wait_until(lambda: progress_step(out) >= step - 5, 120, interval=0.005)
        time.sleep(0.02)
        proc.kill()
        finish(proc)
    code, output = finish(start(config, corpus, out))
    assert code == 0 and "resumed from step-" in output, output
    assert_same(final_state(out, SETTINGS["max_steps"]), reference)


def test_a_run_whose_last_step_is_committed_exits_0_and_trains_nothing(tmp_path, corpus, reference):
    config, out, last = settings_file(tmp_path), tmp_path / "out", SETTINGS["max_steps"]
    shutil.copytree(reference.parent.parent, out)  # the uninterrupted run's output folder
    before = (final_state(out, last) / "manifest.json").read_bytes()
    code, output = finish(start(config, corpus, out))
    assert code == 0 and f"resumed from {checkpoint.step_dir_name(last)}" in output and "committed" not in output, \
        output
    assert (final_state(out, last) / "manifest.json").read_bytes() == before, "not saved again"


@pytest.mark.parametrize("problem,env,line", [
    ({"epochs": 3}, {}, "unknown setting epochs in"),
    ({}, {"WORLD_SIZE": "2"}, "one process only: set NPROC_PER_NODE=1"),
])
def test_bad_input_exits_64_with_one_line(tmp_path, corpus, problem, env, line):
    code, output = finish(start(settings_file(tmp_path, **problem), corpus, tmp_path / "out", **env))
    assert code == 64 and len(output.splitlines()) == 1 and line in output, output


def test_no_data_exits_64_with_one_line(tmp_path):
    code, output = finish(start(settings_file(tmp_path), tmp_path / "no-data", tmp_path / "out"))
    assert code == 64 and output.strip() == f"error: no train.bin in {tmp_path / 'no-data'}; make one with " \
        "scripts/prepare_data.py", output


# -- through the real job.yaml, as a user's own code folder --------------------------------------

POD_SETTINGS = {"max_steps": 400, "save_every": 20, "keep": 2, "batch_size": 256, "seed": 5}
POD_ENV = {"TRAIN_SCRIPT": "minimal_train.py", "TRAIN_CONFIG": "settings.yaml"}


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")
def test_a_user_folder_with_the_minimal_trainer_survives_a_lost_node_through_job_yaml(s3, s3_endpoint, tmp_path,
                                                                                         tool_path, corpus):
    project = tmp_path / "my-project"  # what a user has: the copied script and its settings, nothing else
    project.mkdir()
    shutil.copy(SCRIPT, project / "minimal_train.py")
    (project / "settings.yaml").write_text(yaml.safe_dump(POD_SETTINGS))
    run = Run(s3, s3_endpoint, tmp_path / "run", name="byo")
    staged = subprocess.run([str(ROOT / "scripts" / "stage.sh"), run.code_uri, "--code", str(project),
                             "--data", str(corpus), run.data_uri], capture_output=True, text=True, env=tool_env())
    assert staged.returncode == 0, staged.stderr

    pod = run.start(**POD_ENV)
    pod.wait_for_event("uploaded", timeout=300)
    assert pod.lose_node(), "the pod had finished before the kill"
    assert pod.wait() == 137
    committed = run.committed_steps()
    assert committed and committed[0] < POD_SETTINGS["max_steps"] and "COMPLETE" not in run.keys(), pod.output

    code, second = run.run(**POD_ENV)
    assert code == 0, second.output
    assert [e["step"] for e in second.events if e["event"] == "restore"] == [committed[0]]
    assert f"resumed from {checkpoint.step_dir_name(committed[0])}" in second.output
    assert run.json("COMPLETE")["steps"] == POD_SETTINGS["max_steps"] and run.json("COMPLETE")["attempts"] == 2
    last = checkpoint.step_dir_name(POD_SETTINGS["max_steps"])
    assert run.verify_in_s3(last) is None

    # The same settings and data, run once without a pod and without a kill.
    reference = tmp_path / "reference"
    code, output = finish(start(settings_file(reference, **POD_SETTINGS), corpus, reference / "out"))
    assert code == 0, output
    from_s3 = tmp_path / "from-s3" / last
    from_s3.mkdir(parents=True)
    for name in ("model.pt", "state.pt"):
        (from_s3 / name).write_bytes(run.read(f"checkpoints/{last}/{name}"))
    assert_same(from_s3, final_state(reference / "out", POD_SETTINGS["max_steps"]))
