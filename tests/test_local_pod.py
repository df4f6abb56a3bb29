"""lab/local_pod.py runs a Job's pod for real: namespaces, volumes, env, probes, deletion.

Each test writes a tiny Job to tmp_path and runs the runner as a subprocess (it needs root).
The manifests write $$$$ for the shell's $$: Kubernetes turns $$ into $ in command and args.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from podlab import ROOT, wait_until

RUNNER = ROOT / "lab" / "local_pod.py"
POD_NAME = re.compile(r"local_pod: pod (demo-[a-z0-9]{5}): starting")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="local_pod needs root for namespaces and mounts"),
    pytest.mark.timeout(60),
]


@pytest.fixture(autouse=True)
def runner_env(monkeypatch, tool_path):
    """kubectl (for configMap volumes) on PATH, and a host variable that must not leak into pods."""
    monkeypatch.setenv("FOO", "host-only")


def write_job(directory, script, pod=None, **container):
    """A Job named demo whose container runs `sh -c script`; keyword arguments extend the container."""
    container = {"name": "main", "image": "unused", "command": ["sh", "-c", script], **container}
    spec = {"restartPolicy": "Never", "containers": [container], **(pod or {})}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "demo"},
           "spec": {"template": {"spec": spec}}}
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run_pod(job, *args):
    command = [sys.executable, str(RUNNER), *args, str(job)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def start_pod(job, *args):
    """Start the runner and wait until the container prints its first line, `ready`."""
    proc = subprocess.Popen([sys.executable, str(RUNNER), *args, str(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def pod_name(stderr):
    return POD_NAME.search(stderr).group(1)


def scratch(path="/tmp/scratch", **empty_dir):
    """An emptyDir named scratch mounted at path, as (volumes, volumeMounts)."""
    return [{"name": "scratch", "emptyDir": empty_dir}], [{"name": "scratch", "mountPath": path}]


# ---------------------------------------------------------------- process and exit code


def test_command_is_pid_1_and_sees_only_its_own_processes(tmp_path):
    # Only shell builtins after hostname, so the one process left to see is PID 1 itself.
    job = write_job(tmp_path, 'echo "pid=$$$$"; hostname; for p in /proc/[0-9]*; do echo "${p#/proc/}"; done')
    result = run_pod(job)
    assert result.returncode == 0, result.stderr
    # hostname: the pod has its own UTS namespace, named like the pod
    assert result.stdout.splitlines() == ["pid=1", pod_name(result.stderr), "1"]


def test_exit_code_is_passed_through(tmp_path):
    result = run_pod(write_job(tmp_path, "echo out; echo err >&2; exit 7"))
    assert result.returncode == 7
    assert result.stdout == "out\n"
    assert "err\n" in result.stderr
    assert result.stderr.rstrip().endswith("local_pod: exit code 7")


def test_missing_executable_fails_to_start_with_128(tmp_path):
    result = run_pod(write_job(tmp_path, "", command=["no-such-binary-here"]))
    assert result.returncode == 128
    assert "executable file not found in $PATH: no-such-binary-here" in result.stderr


# ---------------------------------------------------------------- volumes


def test_empty_dir_is_fresh_and_writable_in_every_pod(tmp_path):
    volumes, mounts = scratch()
    script = 'ls -A /tmp/scratch; stat -c %a /tmp/scratch; touch /tmp/scratch/marker && echo "wrote $$HOSTNAME"'
    job = write_job(tmp_path, script, pod={"volumes": volumes}, volumeMounts=mounts)
    first, second = run_pod(job), run_pod(job)
    assert first.stdout == f"777\nwrote {pod_name(first.stderr)}\n"
    assert second.stdout == f"777\nwrote {pod_name(second.stderr)}\n"  # no marker from the first pod
    assert pod_name(first.stderr) != pod_name(second.stderr)


def test_keep_volumes_keeps_the_pods_volumes_for_debugging(tmp_path):
    volumes, mounts = scratch()
    job = write_job(tmp_path, "echo kept > /tmp/scratch/marker", pod={"volumes": volumes}, volumeMounts=mounts)
    result = run_pod(job, "--keep-volumes", str(tmp_path / "kept"))
    assert result.returncode == 0, result.stderr
    marker = tmp_path / "kept" / pod_name(result.stderr) / "volumes" / "scratch" / "marker"
    assert marker.read_text() == "kept\n"


def test_disk_empty_dir_over_its_size_limit_gets_the_pod_evicted(tmp_path):
    # The kubelet's way: writes past sizeLimit succeed (the node's disk has room), then its
    # eviction manager sees the usage and kills the pod with a 1 s grace period.
    volumes, mounts = scratch(sizeLimit="1Mi")
    script = "dd if=/dev/zero of=/tmp/scratch/big bs=1M count=3 2>/dev/null && echo wrote; sleep 60"
    job = write_job(tmp_path, script, pod={"volumes": volumes, "terminationGracePeriodSeconds": 300},
                    volumeMounts=mounts)
    result = run_pod(job)
    assert result.stdout == "wrote\n"
    assert result.returncode == 137  # sh as PID 1 ignores SIGTERM: SIGKILL after the 1 s grace
    name = pod_name(result.stderr)
    assert (f'pod {name} evicted: Usage of EmptyDir volume "scratch" exceeds the limit "1Mi"'
            in result.stderr), result.stderr
    assert "SIGKILL after 1s" in result.stderr  # not the pod's 300 s
    assert f"pod {name} failed: reason Evicted, no DisruptionTarget condition" in result.stderr


def test_disk_empty_dir_within_its_size_limit_is_left_alone(tmp_path):
    volumes, mounts = scratch(sizeLimit="8Mi")
    script = "dd if=/dev/zero of=/tmp/scratch/big bs=1M count=2 2>/dev/null && sleep 3 && echo done"
    job = write_job(tmp_path, script, pod={"volumes": volumes}, volumeMounts=mounts)
    result = run_pod(job)
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr
    assert "evicted" not in result.stderr


def test_memory_empty_dir_is_a_tmpfs_honouring_size_limit(tmp_path):
    volumes, mounts = scratch("/dev/shm", medium="Memory", sizeLimit="1Mi")
    script = "stat -f -c %T /dev/shm; dd if=/dev/zero of=/dev/shm/big bs=1M count=2 2>/dev/null || echo full"
    job = write_job(tmp_path, script, pod={"volumes": volumes}, volumeMounts=mounts)
    assert run_pod(job).stdout == "tmpfs\nfull\n"


def test_config_map_is_rendered_read_only_with_default_mode_and_sub_path(tmp_path):
    (tmp_path / "job").mkdir()  # the default home of ConfigMaps: job/ next to job.yaml
    (tmp_path / "job" / "hello.sh").write_text("#!/bin/sh\necho hello from configmap\n")
    (tmp_path / "job" / "settings.txt").write_text("lr=0.1\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.txt").write_text("A\n")
    volumes = [
        {"name": "scripts", "configMap": {"name": "demo-scripts", "defaultMode": 0o555}},
        {"name": "other", "configMap": {"name": "other", "items": [{"key": "a.txt", "path": "sub/b.txt"}]}},
        {"name": "scratch", "emptyDir": {}},
    ]
    mounts = [
        {"name": "scripts", "mountPath": "/tmp/scripts"},
        {"name": "scratch", "mountPath": "/tmp/scratch"},
        {"name": "scripts", "mountPath": "/tmp/scratch/settings.txt", "subPath": "settings.txt"},
        {"name": "other", "mountPath": "/tmp/other"},
    ]
    script = ("/tmp/scripts/hello.sh; stat -c %a /tmp/scripts/hello.sh; "
              "touch /tmp/scripts/new 2>/dev/null && echo writable || echo read-only; "
              "cat /tmp/scratch/settings.txt /tmp/other/sub/b.txt")
    job = write_job(tmp_path, script, pod={"volumes": volumes}, volumeMounts=mounts)
    result = run_pod(job, "--configmap", f"other={elsewhere}")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from configmap\n555\nread-only\nlr=0.1\nA\n"


# ---------------------------------------------------------------- environment


def test_env_is_only_what_a_container_gets_with_overrides(tmp_path):
    env = [
        {"name": "GREETING", "value": "hello"},
        {"name": "COMBINED", "value": "$(GREETING)-world"},
        {"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "JOB", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['job-name']"}}},
        {"name": "MODE", "value": "manifest"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token", "optional": True}}},
        {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "level"}}},
    ]
    settings = tmp_path / "settings"
    settings.mkdir()
    (settings / "level").write_text("debug")
    job = write_job(tmp_path, "", command=["env"], env=env,
                    envFrom=[{"configMapRef": {"name": "settings"}, "prefix": "CM_"}])
    result = run_pod(job, "--env", "MODE=first", "--env", "EXTRA=1", "--env", "MODE=cli",
                     "--configmap", f"settings={settings}")
    assert result.returncode == 0, result.stderr
    seen = dict(line.split("=", 1) for line in result.stdout.splitlines())
    name = pod_name(result.stderr)
    assert seen == {
        "PATH": os.environ["PATH"], "HOSTNAME": name,  # and no FOO from the runner's environment
        "GREETING": "hello", "COMBINED": "hello-world", "MY_POD": name, "JOB": "demo",
        "MODE": "cli", "EXTRA": "1", "LEVEL": "debug", "CM_level": "debug",
    }


def test_working_dir_is_honoured(tmp_path):
    volumes, mounts = scratch()
    job = write_job(tmp_path, "pwd", pod={"volumes": volumes}, volumeMounts=mounts, workingDir="/tmp/scratch/run")
    assert run_pod(job).stdout == "/tmp/scratch/run\n"


# ---------------------------------------------------------------- security and isolation


def test_run_as_user_with_no_new_privs_and_no_capabilities(tmp_path):
    volumes, mounts = scratch()
    context = {"runAsUser": 1000, "runAsGroup": 1000, "allowPrivilegeEscalation": False,
               "capabilities": {"drop": ["ALL"]}}
    script = ("id -u; id -g; grep -E '^(NoNewPrivs|CapEff|CapBnd)' /proc/self/status | tr -s '\\t' ' '; "
              "touch /tmp/scratch/x && echo wrote")
    job = write_job(tmp_path, script, pod={"volumes": volumes}, volumeMounts=mounts, securityContext=context)
    result = run_pod(job)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "1000", "1000", "CapEff: 0000000000000000", "CapBnd: 0000000000000000", "NoNewPrivs: 1", "wrote",
    ]


def test_tmp_is_private_to_the_pod(tmp_path):
    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="host-only-") as host_file:
        name = os.path.basename(host_file.name)
        result = run_pod(write_job(tmp_path, f"ls -A /tmp; touch /tmp/from-pod-{name} && echo wrote"))
    # /tmp starts empty but for image paths bound back on top (a checkout under /tmp, its .venv).
    image_tops = {p.split("/")[2] for p in os.environ["PATH"].split(os.pathsep) if p.startswith("/tmp/")}
    listed = result.stdout.split()
    assert listed[-1] == "wrote" and set(listed[:-1]) <= image_tops and name not in listed
    assert not os.path.exists(f"/tmp/from-pod-{name}")


def test_read_only_root_filesystem_leaves_volumes_and_the_host_writable(tmp_path):
    volumes, mounts = scratch()
    script = ("touch /opt/local-pod-probe 2>/dev/null && echo opt-writable || echo opt-read-only; "
              "touch /tmp/x 2>/dev/null && echo tmp-writable || echo tmp-read-only; "
              "touch /tmp/scratch/x && echo volume-writable")
    job = write_job(tmp_path, script, pod={"volumes": volumes}, volumeMounts=mounts,
                    securityContext={"readOnlyRootFilesystem": True})
    result = run_pod(job)
    # /tmp is part of a real container's root filesystem, so it is read-only too.
    assert result.stdout == "opt-read-only\ntmp-read-only\nvolume-writable\n", result.stderr
    assert not os.statvfs("/").f_flag & os.ST_RDONLY
    with tempfile.NamedTemporaryFile(dir="/opt"):  # the host's root is still writable
        pass


def test_read_only_root_filesystem_covers_every_mount_of_the_image(tmp_path):
    # Another filesystem mounted under / of the "image" (a separate /usr, /opt, /work on a real
    # host) is part of the root filesystem too. The runner runs in a private mount namespace of
    # its own here, so the extra mount never shows on the host.
    other = Path(tempfile.mkdtemp(dir="/opt", prefix="local-pod-other-fs-"))
    try:
        other.chmod(0o755)
        volumes, mounts = scratch()
        script = (f"touch {other}/x 2>&1 | grep -o 'Read-only file system' || echo other-fs-writable; "
                  "touch /tmp/scratch/x && echo volume-writable; "
                  "touch /dev/shm/x && echo shm-writable")
        job = write_job(tmp_path, script, pod={"volumes": volumes}, volumeMounts=mounts,
                        securityContext={"readOnlyRootFilesystem": True, "runAsUser": 1000})
        setup = f'mount -t tmpfs -o mode=1777 tmpfs "{other}" && exec "$0" "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", setup,
                   sys.executable, str(RUNNER), str(job)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "Read-only file system\nvolume-writable\nshm-writable\n", result.stderr
    finally:
        other.rmdir()


def test_pod_sees_an_images_user_database_without_its_uid(tmp_path):
    # A pytorch/pytorch image has no passwd entry for runAsUser 1000; this host has one (cloudsdk).
    script = ("id -u; getent passwd root | cut -d: -f1; getent passwd 1000 || echo no-passwd-entry; "
              "getent group 1000 || echo no-group-entry")
    job = write_job(tmp_path, script, securityContext={"runAsUser": 1000, "runAsGroup": 1000})
    result = run_pod(job)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1000\nroot\nno-passwd-entry\nno-group-entry\n"


# ---------------------------------------------------------------- probes


def exec_probe(command, **settings):
    return {"exec": {"command": ["sh", "-c", command]}, "periodSeconds": 1, **settings}


def test_failing_liveness_probe_kills_the_container(tmp_path):
    job = write_job(tmp_path, "touch /tmp/healthy; sleep 2; rm /tmp/healthy; sleep 60",
                    pod={"terminationGracePeriodSeconds": 1},
                    livenessProbe=exec_probe("cat /tmp/healthy", failureThreshold=2))
    started = time.monotonic()
    result = run_pod(job)
    elapsed = time.monotonic() - started
    assert result.returncode == 137  # PID 1 ignores SIGTERM, so the grace period ends in SIGKILL
    assert "Liveness probe failed (1/2): cat: /tmp/healthy: No such file or directory\n" in result.stderr
    assert "Liveness probe failed (2/2): cat: /tmp/healthy: No such file or directory; " \
           "killing container with grace 1s" in result.stderr
    assert elapsed >= 3  # healthy for 2 s, then two failed probes a second apart


def test_startup_probe_that_never_succeeds_kills_the_container_before_liveness_runs(tmp_path):
    job = write_job(tmp_path, "sleep 60",
                    startupProbe=exec_probe("exit 1", failureThreshold=2, terminationGracePeriodSeconds=1),
                    livenessProbe=exec_probe("echo liveness ran; exit 1"))
    result = run_pod(job)
    assert result.returncode == 137
    # The probe's grace (1 s), not the pod's default 30 s.
    assert "Startup probe failed (2/2): exit code 1; killing container with grace 1s" in result.stderr
    assert "Startup probe failed (1/2)" not in result.stderr  # a starting pod fails it: said when it kills
    assert "Liveness" not in result.stderr  # it waits for the startup probe


def test_probe_that_times_out_counts_as_failed(tmp_path):
    job = write_job(tmp_path, "sleep 60", pod={"terminationGracePeriodSeconds": 0},
                    livenessProbe=exec_probe("sleep 5", failureThreshold=1, timeoutSeconds=1))
    result = run_pod(job)
    assert result.returncode == 137
    assert "Liveness probe failed (1/1): command timed out after 1s" in result.stderr


def test_readiness_probe_only_logs_transitions(tmp_path):
    # It exits between two probes: a probe cut off by the container's end would log a failure.
    job = write_job(tmp_path, "sleep 1; touch /tmp/ready; sleep 2.5",
                    readinessProbe=exec_probe("test -e /tmp/ready", failureThreshold=1))
    result = run_pod(job)
    assert result.returncode == 0
    assert f"Readiness probe succeeded: pod {pod_name(result.stderr)} is Ready" in result.stderr
    assert "failed" not in result.stderr  # not ready at first: no transition, no line


# ---------------------------------------------------------------- deletion, deadlines, lost nodes


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_deleting_the_pod_sends_sigterm_to_pid_1_and_returns_its_exit_code(tmp_path, signum):
    script = 'trap "echo got-term; exit 42" TERM; echo ready; while :; do sleep 0.1; done'
    proc = start_pod(write_job(tmp_path, script))
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 42
    assert out == "got-term\n"
    assert f"{signum.name} received: deleting pod" in err


def test_container_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    job = write_job(tmp_path, 'trap "" TERM; echo ready; while :; do sleep 0.1; done',
                    pod={"terminationGracePeriodSeconds": 1})
    proc = start_pod(job)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 137
    assert time.monotonic() - started >= 1, "the grace period was given"
    assert "grace period of 1s is over: SIGKILL to PID 1" in err


def test_active_deadline_kills_the_pod(tmp_path):
    job = write_job(tmp_path, "sleep 60", pod={"activeDeadlineSeconds": 1, "terminationGracePeriodSeconds": 0})
    result = run_pod(job)
    assert result.returncode == 137
    assert "activeDeadlineSeconds (1s) exceeded" in result.stderr


def test_sigkill_on_the_pidfile_pid_is_a_lost_node(tmp_path):
    pidfile = tmp_path / "pid"
    proc = start_pod(write_job(tmp_path, "echo ready; sleep 60"), "--pidfile", str(pidfile))
    assert wait_until(pidfile.exists, 5, interval=0.05)  # written just after the exec
    pid = int(pidfile.read_text())
    namespaced_pids = Path(f"/proc/{pid}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
    assert namespaced_pids == [str(pid), "1"]  # the host pid of the pod's PID 1
    os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=20)
    assert proc.returncode == 137


# ---------------------------------------------------------------- bad input


def not_a_job(directory):
    path = directory / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    return path


def job_with(**container_or_pod):
    pod = {"volumes": container_or_pod.pop("volumes")} if "volumes" in container_or_pod else None
    return lambda directory: write_job(directory, "true", pod=pod, **container_or_pod)


BAD_INPUTS = {
    "no such file": (lambda directory: directory / "missing.yaml", [], "no such file"),
    "not a job": (not_a_job, [], "expected one batch/v1 Job, found v1/ConfigMap"),
    "unsupported volume": (job_with(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "c"}}]), [],
                           "type persistentVolumeClaim is not supported"),
    "missing configmap dir": (job_with(volumes=[{"name": "c", "configMap": {"name": "cfg"}}]), [],
                              "ConfigMap 'cfg': directory"),
    "required secret": (job_with(env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
                        [], "pass --env T=VALUE"),
    "http probe": (job_with(livenessProbe={"httpGet": {"port": 80}}), [],
                   "Liveness probe: httpGet probes are not supported, only exec"),
    "bad --env": (job_with(), ["--env", "NOEQUALS"], "--env 'NOEQUALS' is not KEY=VALUE"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_64_with_one_line(tmp_path, case):
    make_job, args, message = BAD_INPUTS[case]
    result = run_pod(make_job(tmp_path), *args)
    assert result.returncode == 64
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("local_pod: ")
    assert message in result.stderr


def test_not_root_exits_64():
    with tempfile.TemporaryDirectory() as readable:  # pytest's tmp_path is private to root
        os.chmod(readable, 0o755)
        job = write_job(Path(readable), "true")
        nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        result = subprocess.run([*nobody, sys.executable, str(RUNNER), str(job)],
                                capture_output=True, text=True, timeout=30)
    if "Permission denied" in result.stderr:
        pytest.skip("the checkout is not readable by nobody")
    assert result.returncode == 64
    assert result.stderr == "local_pod: must run as root (namespaces and mounts); run it with sudo or as root\n"


def test_image_paths_under_tmp_stay_visible_over_the_private_tmp(tmp_path, monkeypatch):
    # A checkout (and its .venv) under /tmp is the "image" here; a real image's files are never
    # hidden by the container's own /tmp, so neither are these.
    tools = Path(tempfile.mkdtemp(dir="/tmp")) / "bin"
    tools.mkdir()
    tool = tools / "image-tool"
    tool.write_text("#!/bin/sh\necho from-the-image\n")
    tool.chmod(0o755)
    tools.parent.chmod(0o755)
    (Path("/tmp") / "host-only-file").write_text("x")
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    result = run_pod(write_job(tmp_path, "image-tool; ls /tmp/host-only-file 2>&1 || echo private-tmp"))
    assert result.returncode == 0, result.stderr
    assert "from-the-image" in result.stdout and "private-tmp" in result.stdout
