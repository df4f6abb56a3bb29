"""The real job.yaml in what a cluster gives it rather than what this host gives it: an image with
no passwd entry for the pod's uid (torch.compile on, as in config/conf.yaml), and a workspace
emptyDir that outgrows its sizeLimit on a node disk with room (the kubelet evicts the pod)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from podlab import JOB_YAML, ROOT, Pod, scaled_job_yaml, tool_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]

# A few steps of the tiny model through inductor on the CPU (g++), eval included: both graphs compile.
# One layer and no dropout (as config/conf.yaml): fewer kernels for g++ to build, the same paths.
COMPILED = ("--set system.compile=true --set train.max_steps=4 --set checkpoint.interval=2 "
            "--set eval.interval=2 --set eval.steps=1 --set model.n_layer=1 --set model.dropout=0.0")


def start(run, job_yaml, *runner_args: str, **env: str) -> Pod:
    """Run.start with extra arguments for the runner (--keep-volumes)."""
    run.folder.mkdir(parents=True, exist_ok=True)
    run.pods += 1
    pidfile = run.folder / f"pod-{run.pods}.pid"
    command = [sys.executable, str(ROOT / "lab" / "local_pod.py"), "--pidfile", str(pidfile),
               "--configmap", f"script-configmap={ROOT / 'job'}", *runner_args]
    for key, value in run.env(**env).items():
        command += ["--env", f"{key}={value}"]
    return Pod(command + [str(job_yaml)], pidfile, tool_env())


def test_getpass_names_the_pods_user_though_the_image_has_no_passwd_entry(tmp_path):
    # What torch < 2.13 does first in torch.compile (pytorch issue 140765): getpass.getuser(), unguarded.
    job = yaml.safe_load(JOB_YAML.read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["command"] = [sys.executable, "-c", "import getpass; print(getpass.getuser())"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        container.pop(probe)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    runner = [sys.executable, str(ROOT / "lab" / "local_pod.py"), "--configmap", f"script-configmap={ROOT / 'job'}"]
    result = subprocess.run(runner + [str(path)], capture_output=True, text=True, timeout=60, env=tool_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == "eai_role\n"


@pytest.mark.timeout(900)
def test_compiled_training_completes_as_a_uid_the_image_does_not_know(run, tmp_path):
    # The runner shows the pod an image's /etc/passwd: uid 1000 has no entry (tests/test_local_pod.py).
    kept = tmp_path / "kept"
    pod = start(run, JOB_YAML, "--keep-volumes", str(kept), TRAIN_ARGS=COMPILED)
    code = pod.wait(timeout=840)
    assert code == 0, pod.output
    assert run.json("COMPLETE")["steps"] == 4
    assert "getpwuid" not in pod.output and "torch._dynamo" not in pod.output, pod.output
    volumes = next(kept.iterdir()) / "volumes"
    inductor = volumes / "home" / ".cache" / "torchinductor"
    assert inductor.is_dir() and any(inductor.iterdir()), "inductor's cache is on the workspace volume"
    # torch's precompiled headers (150 MB here) ignore TORCHINDUCTOR_CACHE_DIR: /tmp or $TMPDIR.
    in_tmp = {p.name for folder in (volumes / "tmp").glob("torchinductor_*") for p in folder.iterdir()}
    assert in_tmp <= {"precompiled_headers"}, f"inductor's cache is in the 1Gi /tmp: {in_tmp}"


def test_workspace_over_its_size_limit_gets_the_pod_evicted_without_a_final_upload(run, tmp_path):
    # Code, data and two checkpoints of this model take a few MiB: 4Mi is outgrown while training.
    job = yaml.safe_load(scaled_job_yaml(tmp_path).read_text())
    for volume in job["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "home":
            volume["emptyDir"]["sizeLimit"] = "4Mi"
    small = tmp_path / "job-small-home.yaml"
    small.write_text(yaml.safe_dump(job))
    pod = run.start(small, TRAIN_ARGS="--set train.max_steps=100000 --set log.interval=1")
    code = pod.wait(timeout=300)
    assert 'evicted: Usage of EmptyDir volume "home" exceeds the limit "4Mi"; SIGTERM to PID 1, ' \
           "SIGKILL after 1s" in pod.output, pod.output
    assert "failed: reason Evicted, no DisruptionTarget condition" in pod.output
    # Not the trainer's own "no space left" (exit 64): the node's disk had room, the kubelet said no.
    assert code in (137, 143), pod.output
    assert "no space left" not in pod.output
    assert "COMPLETE" not in run.keys()
