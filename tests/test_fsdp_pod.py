"""train.parallelism: fsdp through the real job.yaml: a group of 2 pods x 1 process (the Indexed Job
submit.py renders) loses a node, every node restores only its ranks' shard files and the group goes
on; then 1 pod x 2 processes takes the run over from S3 and ends bitwise equal to an uninterrupted
run."""

from __future__ import annotations

import os
import subprocess

import pytest

import checkpoint
from helpers import train_command, train_env
from podlab import Run, wait_until, write_config, write_corpus
from test_multinode import STARTED, start_group

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]

STEPS, GROUP_STEPS = 60, 40
# lr_decay_steps: the schedule does not depend on max_steps, so the group's 40 steps are the first
# 40 of the pod's 60.
FSDP_CONFIG = {"train__parallelism": "fsdp", "train__max_steps": STEPS, "train__lr_decay_steps": STEPS,
               "checkpoint__interval": 5, "log__interval": 1}
SHARDS = ("__0_0.distcp", "__1_0.distcp")


@pytest.fixture
def fsdp_run(s3, s3_endpoint, tmp_path, tool_path):
    yield Run(s3, s3_endpoint, tmp_path, name="fsdp", **FSDP_CONFIG).stage()
    while STARTED:
        STARTED.pop().stop(grace=30)


def uninterrupted(run: Run, folder) -> dict[str, bytes]:
    """The shard files of step STEPS of 1 process pair trained in one go (torchrun, no pod)."""
    data, cfg, out = write_corpus(folder / "data"), folder / "cfg.yaml", folder / "out"
    write_config(cfg, **run.config)
    subprocess.run(train_command(cfg, data, out, nproc=2), check=True, capture_output=True,
                   env=train_env(OMP_NUM_THREADS="1"), timeout=600)
    return {name: (out / "checkpoints" / checkpoint.step_dir_name(STEPS) / name).read_bytes() for name in SHARDS}


def test_fsdp_group_restores_per_node_then_one_pod_of_two_takes_over_and_ends_bitwise(fsdp_run, tmp_path):
    reference = uninterrupted(fsdp_run, tmp_path / "reference")

    # 2 nodes x 1 process: node 1 lost once a step is in S3; the group comes back and each node
    # fetches the shared files and its own rank's shard only.
    job = start_group(fsdp_run, "g1", TRAIN_ARGS=f"--set train.max_steps={GROUP_STEPS}")
    node0 = job.pod(0)
    assert wait_until(lambda: any(e["event"] == "uploaded" and (e["step"] or 0) >= 10 for e in node0.events), 300), \
        node0.output[-3000:]
    assert job.pod(1).lose_node()
    restored = [job.wait_for_pod(i, 2, timeout=180).wait_for_event("restore", timeout=300) for i in (0, 1)]
    assert restored[0]["name"] == restored[1]["name"] and restored[0]["step"] >= 10
    assert [r["absent"] for r in restored] == [[SHARDS[1]], [SHARDS[0]]], restored
    manifest = fsdp_run.json(f"checkpoints/{restored[0]['name']}/manifest.json")
    total = sum(e["size"] for e in manifest["files"].values())
    assert all(r["bytes"] == total - manifest["files"][r["absent"][0]]["size"] for r in restored)
    state, reason = job.wait(timeout=600)
    assert state == "Complete", (reason, job.history, job.output(0)[-3000:], job.output(1)[-3000:])
    assert fsdp_run.json("COMPLETE")["steps"] == GROUP_STEPS
    assert fsdp_run.committed_steps()[0] == GROUP_STEPS
    assert fsdp_run.verify_in_s3(checkpoint.step_dir_name(GROUP_STEPS)) is None

    # 1 node x 2 processes goes on from the group's step in S3 (restoring it whole) to the end.
    # (A SIGKILLed FSDP run's resume is test_fsdp.py's; a SIGKILLed pod's restore, test_pod.py's.)
    fsdp_run.s3.delete_object(Bucket="test-bucket", Key=f"{fsdp_run.prefix}COMPLETE")
    code, pod = fsdp_run.run(NPROC_PER_NODE="2")
    assert code == 0, pod.output[-5000:]
    assert [e["absent"] for e in pod.events if e["event"] == "restore"] == [[]], "one pod restores it whole"
    assert [e["step"] for e in pod.events if e["event"] == "resumed"][0] == GROUP_STEPS
    assert min(e["step"] for e in pod.events if e["event"] == "step") == GROUP_STEPS + 1, "no step redone"
    assert fsdp_run.json("COMPLETE")["steps"] == STEPS
    for name in SHARDS:
        assert fsdp_run.read(f"checkpoints/{checkpoint.step_dir_name(STEPS)}/{name}") == reference[name], \
            f"{name}: bitwise equal to 1 x 2 processes uninterrupted"
