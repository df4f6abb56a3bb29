"""A group of pods: the Indexed Job that scripts/submit.py renders, its 2 pods run side by side by
the local runner (lab/local_job.py), each its own hostname and 127.0.0.x address, the real
torchrun (c10d rendezvous, gloo) with 1 process each, one lease, one writer, one resume."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import train_command, train_env
from podlab import ROOT, Run, free_ports, wait_until, write_config, write_corpus

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]
local_job = pytest.importorskip("local_job")

STEPS = 120  # ~50 ms a step here: long enough that a kill lands while the group trains
GROUP_CONFIG = {"train__max_steps": STEPS, "checkpoint__interval": 5, "log__interval": 1}


def render(folder: Path, name: str, port: int) -> Path:
    """The manifests a user would apply (submit.py --engine indexed --nodes 2)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "submit.py"), name, "--image", "local",
                          "--code", "s3://bucket/code/", "--data", "s3://bucket/data/",
                          "--output", f"s3://bucket/runs/{name}/", "--engine", "indexed", "--nodes", "2",
                          "--gpus-per-node", "1"], check=True, capture_output=True, text=True).stdout
    path = folder / f"{name}.yaml"
    path.write_text(out.replace(":29400", f":{port}"))
    return path


STARTED: list = []


def start_group(run: Run, name: str, **env: str):
    job = local_job.IndexedJob(render(run.folder, name, free_ports(2)), env=run.env(**env))
    STARTED.append(job)
    job.start()
    return job


@pytest.fixture
def group_run(s3, s3_endpoint, tmp_path, tool_path):
    yield Run(s3, s3_endpoint, tmp_path, name="g1", **GROUP_CONFIG).stage()
    while STARTED:  # a failed test leaves no pod behind
        STARTED.pop().stop(grace=30)


REFERENCES: dict[str, bytes] = {}


def one_pod_two_processes(run: Run, folder: Path) -> bytes:
    """The same config and world size in one place: the model every group run must end with
    (trained once per config for all the tests: the corpus is the same, seeded)."""
    key = repr(sorted(run.config.items()))
    if key not in REFERENCES:
        REFERENCES[key] = _train_reference(run, folder)
    return REFERENCES[key]


def _train_reference(run: Run, folder: Path) -> bytes:
    data, cfg, out = write_corpus(folder / "data"), folder / "cfg.yaml", folder / "out"
    write_config(cfg, **run.config)
    subprocess.run(train_command(cfg, data, out, nproc=2), check=True, capture_output=True,
                   env=train_env(OMP_NUM_THREADS="1"), timeout=300)
    return (out / "checkpoints" / f"step-{STEPS:08d}" / "model.pt").read_bytes()


def assert_complete_and_equal(run: Run, job, reference: bytes) -> None:
    state, reason = job.wait(timeout=600)
    assert state == "Complete", (reason, job.history, job.pod(0).output[-3000:], job.pod(1).output[-3000:])
    assert run.json("COMPLETE")["steps"] == STEPS
    assert run.read(f"checkpoints/step-{STEPS:08d}/model.pt") == reference, "bitwise equal to 1 pod x 2 processes"


def kill_and_time(job, index: int, at_step: int) -> float:
    """SIGKILL pod INDEX once node 0 has put step AT_STEP or a later one in S3; seconds until the
    group trains again. (The uploader may skip a step the trainer already pruned: hence "or later".)"""
    node0 = job.pod(0)
    assert wait_until(lambda: any(e["event"] == "uploaded" and (e["step"] or 0) >= at_step
                                      for e in node0.events), 300), node0.output[-3000:]
    attempts = job.attempts(0)
    assert job.pod(index).lose_node()
    killed = time.monotonic()
    assert wait_until(lambda: job.attempts(0) > attempts, 120), "node 0 was not replaced"
    job.pod(0).wait_for_event("step", timeout=300)
    return time.monotonic() - killed


def test_a_killed_pod_restarts_the_whole_group_which_ends_bitwise_equal(group_run, tmp_path):
    reference = one_pod_two_processes(group_run, tmp_path / "reference")
    job = start_group(group_run, "g1")
    lost_1 = kill_and_time(job, index=1, at_step=30)
    # The survivor saw its peer go and exited 138: ignored by the Job, so it is not a failure.
    assert (0, 138, "ignored") in job.history, job.history
    resumed = job.pod(0).wait_for_event("resumed", timeout=60)
    assert resumed["step"] > 0, "the group went on from S3, not from step 0"
    lost_0 = kill_and_time(job, index=0, at_step=70)
    # On failure, node 1's pods that ended say why in their last lines (node 1 exited 75 twice in
    # clean-clone runs, before job/torchrun.py gave a lost rendezvous store's survivors 60 s).
    assert (1, 138, "ignored") in job.history, (job.history, [pod.output[-4000:] for pod in job.pods(1)[:-1]])
    assert_complete_and_equal(group_run, job, reference)
    counted = [h for h in job.history if h[2] == "counted"]
    assert len(counted) == 2, f"each SIGKILL counts once against backoffLimit, its peer's 138 not: {job.history}"
    print(f"\nkill-to-training, 2 pods: pod 1 SIGKILLed {lost_1:.1f} s, pod 0 SIGKILLed {lost_0:.1f} s")


def test_sigterm_to_one_pod_commits_the_step_once_and_the_group_resumes_there(group_run):
    job = start_group(group_run, "g1", TRAIN_ARGS="--set train.max_steps=5000")
    node0 = job.pod(0)
    node0.wait_for_event("uploaded", timeout=300)
    job.pod(1).delete()  # a preemption of the node of pod 1: SIGTERM, DisruptionTarget
    stopped = node0.wait_for_event("stopped", timeout=120)
    assert node0.wait() == 138, ("stopped for its peer's preemption, not its own", node0.output[-5000:])
    assert wait_until(lambda: len(job.history) >= 2, 30), job.history
    # Pod 1 was preempted (143, DisruptionTarget); pod 0 stopped with it (138): neither is counted.
    assert sorted(job.history[:2]) == [(0, 138, "ignored"), (1, 143, "ignored")], job.history
    assert job.failures == 0
    assert group_run.committed_steps()[0] == stopped["step"], "node 0 committed the stopped step in S3"
    resumed = job.wait_for_pod(0, 2).wait_for_event("resumed", timeout=300)
    job.stop(grace=60)
    assert resumed["step"] == stopped["step"], ("no step redone", job.output(0)[-4000:])


def test_two_groups_on_one_prefix_one_trains_the_other_waits(group_run):
    first = start_group(group_run, "g1", TRAIN_ARGS="--set train.max_steps=5000")
    first.pod(0).wait_for_event("step", timeout=300)
    second = start_group(group_run, "g1b", S3_OUTPUT_URI=group_run.output_uri)
    try:
        second.pod(0).wait_for_event("phase", name="take the run's lease", state="start", timeout=300)
        second.pod(1).wait_for_event("phase", name="wait for node 0", state="start", timeout=300)
        time.sleep(10)
        assert not [e for e in second.pod(0).events if e["event"] in ("lease", "restore", "ready")]
        assert not [e for e in second.pod(1).events if e["event"] in ("restore", "ready")]
        assert "waiting for" in second.pod(0).output or "lease" in second.pod(0).output
    finally:
        second.stop(grace=60)
        first.stop(grace=60)
    print(f"\nfirst group: {first.history}; second group: {second.history}")
    assert [code for _, code, _ in second.history] == [143, 143], "a deleted pod says it was stopped"


def test_a_group_trains_once_to_the_end_and_node_0_lost_in_its_final_upload_brings_back_the_finished_node(
        group_run, tmp_path):
    # The first group trains the whole run as a clean run does: one lease, one writer, every step.
    # Node 1 trained to the end before node 0's final upload: were it to exit 0 then, the Job would
    # replace node 0 alone, and a group of one never meets again.
    reference = one_pod_two_processes(group_run, tmp_path / "reference")
    job = start_group(group_run, "g1")
    node0 = job.pod(0)
    node0.wait_for_event("phase", timeout=300, name="final upload", state="start", trainer_exit=0)
    assert job.pod(0).lose_node()
    assert_complete_and_equal(group_run, job, reference)
    assert [e["step"] for e in node0.events if e["event"] == "step"] == list(range(1, STEPS + 1)), "trained once"
    assert [e["state"] for e in node0.events if e["event"] == "lease"] == ["held"]
    for node in job.pods(1):
        assert not [e for e in node.events if e["event"] in ("lease", "uploaded", "complete")], "one writer"
        assert node.wait_for_event("phase", name="wait for node 0", state="done", timeout=5)
    assert job.history[:2] in ([(0, 137, "counted"), (1, 138, "ignored")],
                               [(1, 138, "ignored"), (0, 137, "counted")]), job.history
    assert job.history[-2:] in ([(0, 0, "succeeded"), (1, 0, "succeeded")],
                                [(1, 0, "succeeded"), (0, 0, "succeeded")]), job.history


def test_a_node_lost_between_node_0s_answer_and_the_rendezvous_restarts_the_group_at_once(group_run, tmp_path):
    # Node 0 waits in the rendezvous for a pod that died after taking its answer; the pod's
    # replacement, asking again, tells node 0 its group is gone (else: RDZV_TIMEOUT_SECONDS, 900 s).
    reference = one_pod_two_processes(group_run, tmp_path / "reference")
    job = start_group(group_run, "g1")
    job.pod(1).wait_for_event("phase", timeout=300, name="restore checkpoint", state="start")
    assert job.pod(1).lose_node()
    lost = time.monotonic()
    assert job.wait_for_pod(0, 2, timeout=120), "node 0 stopped and was replaced"
    print(f"\nnode 1 lost before the rendezvous: node 0 replaced after {time.monotonic() - lost:.1f} s")
    assert_complete_and_equal(group_run, job, reference)
    assert job.history[:2] in ([(1, 137, "counted"), (0, 138, "ignored")],
                               [(0, 138, "ignored"), (1, 137, "counted")]), job.history
