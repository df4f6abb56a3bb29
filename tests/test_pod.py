"""The real job.yaml, run by the local pod runner against the local S3: completion, SIGKILL and
resume, graceful deletion, a finished run, an uncommitted checkpoint in S3, a hung trainer."""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import pytest

from podlab import BUCKET, Run, scaled_job_yaml

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]
MAX_STEPS = 60


@pytest.fixture
def run(module_s3, s3_endpoint, tmp_path, request):
    """A run of its own prefix in the module's S3 (reset once: the finished run below is shared)."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_"))[:60].strip("-")
    return Run(module_s3, s3_endpoint, tmp_path, name=name).stage()


@pytest.fixture(scope="module")
def finished(module_s3, s3_endpoint, tmp_path_factory):
    """One pod trained to the end, beside a COMPLETE.txt (a note, not the marker): the happy path,
    the reference of every resume here, and the run a next pod finds finished."""
    run = Run(module_s3, s3_endpoint, tmp_path_factory.mktemp("finished"), name="finished").stage()
    run.s3.put_object(Bucket=BUCKET, Key=f"{run.prefix}COMPLETE.txt", Body=b"a note, not the marker")
    code, pod = run.run()
    assert code == 0, pod.output
    return run, pod


@pytest.fixture
def reference_sha(finished):
    """sha256 of the final model.pt of an uninterrupted pod."""
    return lambda: finished[0].model_sha(MAX_STEPS)


def copy_run(run: Run, source: Run) -> None:
    """Everything under source's prefix, copied under run's (S3 to S3)."""
    for key in source.keys():
        run.s3.copy_object(Bucket=BUCKET, Key=run.prefix + key,
                           CopySource={"Bucket": BUCKET, "Key": source.prefix + key})


def test_happy_path_ends_with_complete(finished):
    run, pod = finished
    assert not [line for line in pod.lines if "error: " in line or "warning: " in line], pod.output
    summary = run.json("COMPLETE")
    assert summary["steps"] == MAX_STEPS and summary["attempts"] == 1
    assert summary["val_loss"] < 5.5 and summary["best_val_loss"] <= summary["val_loss"]
    keys = run.keys()
    assert run.committed_steps() == [MAX_STEPS, MAX_STEPS - 5], "keep: 2"
    for step in run.committed_steps():
        assert run.verify_in_s3(f"step-{step:08d}") is None
    assert run.verify_in_s3("best") is None
    assert any(k.startswith("tensorboard/events.out.tfevents") for k in keys)
    # The attempt's log is its segments, in name order.
    log = b"".join(run.read(k) for k in sorted(keys) if k.startswith("logs/attempt-0001-")).decode()
    assert "torchrun --standalone --nproc_per_node=1" in log
    assert "final upload (trainer exit 0)" in log
    status = run.json("status.json")
    assert status["state"] == "completed" and status["attempts"][0]["exit_code"] == 0
    assert "lease.json" not in keys, "the lease is released on exit"
    done = [e["name"] for e in pod.events if e["event"] == "phase" and e["state"] == "done"]
    assert done == ["check S3 access", "sync code", "python environment", "check the trainer's settings", "sync data",
                    "take the run's lease", "restore checkpoint", "final upload"], pod.output
    assert [e["event"] for e in pod.events if e["event"] in ("ready", "exit")] == ["ready", "exit"]
    assert pod.events[-1]["event"] == "exit" and pod.events[-1]["code"] == 0
    assert [(e["state"], e["step"]) for e in pod.events if e["event"] == "complete"] == [
        ("writing", MAX_STEPS), ("written", MAX_STEPS)]


@pytest.mark.parametrize("seed", [1])
def test_sigkill_then_next_pod_resumes_from_newest_committed_step_and_completes(run, reference_sha, seed):
    pod = run.start()
    uploaded = pod.wait_for_event("uploaded")["step"]
    step = random.Random(seed).randint(uploaded + 1, MAX_STEPS - 3)
    pod.wait_for_event("step", step=step)
    pod.lose_node()
    assert pod.wait() == 137
    committed = run.committed_steps()
    assert committed and committed[0] <= step and "COMPLETE" not in run.keys()
    for s in committed:
        assert run.verify_in_s3(f"step-{s:08d}") is None, "S3 shows only whole checkpoints as committed"
    code, second = run.run()
    assert code == 0, second.output
    assert f"resumed from step-{committed[0]:08d}" in second.output
    assert [e["hashed_by"] for e in second.events if e["event"] == "resumed"] == ["restore"], \
        "restore.py hashed what it fetched; the trainer checked its sizes, not every byte again"
    assert run.json("COMPLETE")["attempts"] == 2
    attempts = run.json("status.json")["attempts"]
    assert attempts[0]["lost"] and attempts[1]["exit_code"] == 0
    assert run.model_sha(MAX_STEPS) == reference_sha(), "resume is exact"


def test_pod_deletion_leaves_a_checkpoint_of_the_current_step_in_s3(run):
    pod = run.start(TRAIN_ARGS="--set train.max_steps=2000 --set log.interval=1")
    line = pod.wait_for_event("step", step=12)
    pod.delete()
    assert pod.wait() == 143, pod.output
    newest = run.committed_steps()[0]
    assert newest >= 12, newest
    assert run.verify_in_s3(f"step-{newest:08d}") is None
    assert "got SIGTERM" in pod.output and f"SIGTERM: step {newest} finished" in pod.output
    assert "torchrun: stopped by SIGTERM; its workers were told to stop" in pod.output
    assert "Traceback" not in pod.output and "SignalException" not in pod.output, "one line, not 30"
    assert [(e["signal"], e["step"]) for e in pod.events if e["event"] == "stopped"] == [("SIGTERM", newest)]
    status = run.json("status.json")
    assert status["state"] == "interrupted" and status["attempts"][-1]["exit_code"] == 143
    assert "lease.json" not in run.keys()
    assert line  # the pod was training when deleted


@pytest.mark.parametrize("tool", ["s5cmd", "aws"])
def test_run_after_complete_exits_at_once_without_touching_s3(finished, tool):
    run, first = finished
    assert "torchrun" in first.output, "only COMPLETE itself ends a run (COMPLETE.txt was there)"
    before = run.keys()
    code, pod = run.run(S3_SYNC_TOOL=tool)
    assert code == 0, pod.output
    assert f"sync with {tool}" in pod.output
    assert "COMPLETE exists: this run is finished" in pod.output
    assert f"To train it further, raise train.max_steps and remove COMPLETE (aws s3 rm {run.output_uri}COMPLETE)" \
        in pod.output, "it says what to do"
    assert "sync code" not in pod.output and "torchrun" not in pod.output, "at once: nothing synced or run"
    assert run.keys() == before


def test_checkpoint_in_s3_without_manifest_is_ignored(run, finished, reference_sha):
    copy_run(run, finished[0])
    newest, older = run.committed_steps()
    # As if the pod died after uploading the files of its newest checkpoint, before the manifest.
    run.s3.delete_object(Bucket=BUCKET, Key=f"{run.prefix}checkpoints/step-{newest:08d}/manifest.json")
    run.s3.delete_object(Bucket=BUCKET, Key=f"{run.prefix}COMPLETE")
    code, pod = run.run()
    assert code == 0, pod.output
    assert f"step-{newest:08d} in S3 has no manifest.json: never committed, ignored" in pod.output
    assert f"resumed from step-{older:08d}" in pod.output
    assert run.committed_steps()[0] == newest and run.verify_in_s3(f"step-{newest:08d}") is None
    assert run.model_sha(MAX_STEPS) == reference_sha()


def test_stale_heartbeat_fails_the_liveness_probe_and_kills_the_pod(run, tmp_path):
    job = scaled_job_yaml(tmp_path, period=1, failure=2, grace=3)
    pod = run.start(job, HEALTH_MAX_AGE_SECONDS="10", TRAIN_ARGS="--set train.max_steps=100000 --set log.interval=1")
    pod.wait_for_event("step", step=5)
    hung = trainer_pids(pod.pid1())
    assert hung
    assert "Liveness probe failed" not in pod.output, "a training pod with a fresh heartbeat must live"
    for pid in hung:
        os.kill(pid, signal.SIGSTOP)  # a hung step: alive, no progress
    code = pod.wait(timeout=90)
    assert "Liveness probe failed (2/2)" in pod.output
    assert code in (137, 143), pod.output


def trainer_pids(pid1: int) -> list[int]:
    """The train.py workers under a pod's PID 1 (not torchrun itself)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        is_worker = any(p.endswith(b"train.py") for p in cmdline) and not any(p.endswith(b"torchrun.py") for p in cmdline)
        if is_worker and _descends_from(int(entry.name), pid1):
            found.append(int(entry.name))
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False
