"""lab/local_job.py runs an Indexed Job's pods side by side: each pod's identity, the peers' names,
and the Job controller's podFailurePolicy, with tiny bash pods (no trainer, no S3).

Manifests write $$ for the shell's $: Kubernetes turns $$ into $ in command and args.
"""

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

import local_job
from podlab import ROOT, Run, free_ports

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="local_pod needs root for namespaces and mounts"),
    pytest.mark.timeout(60),
]

# The rendered Job's rules (scripts/submit.py --engine indexed).
RENDERED_POLICY = {"rules": [
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [64]}},
    {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [138]}},
]}


@pytest.fixture(autouse=True)
def runner_env(tool_path):
    """kubectl on PATH for the runner."""


@pytest.fixture
def first_ip():
    """Addresses of their own in 127/8 for each test's pods: tests run beside other jobs here."""
    return f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.10"


@pytest.fixture
def shared():
    """A host folder the pods see (not under /tmp: each pod has its own /tmp)."""
    folder = tempfile.mkdtemp(prefix="local_job-test-", dir="/var/tmp")
    os.chmod(folder, 0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def jobs():
    started = []
    yield started
    for job in started:
        job.stop(grace=2)


def write_job(directory, script, env=(), policy=None, backoff_limit=6, pods=2):
    """An Indexed Job `demo` of `pods` pods, subdomain demo, whose container `trainer` runs bash -c script."""
    container = {"name": "trainer", "image": "unused", "command": ["bash", "-c", script],
                 "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                         *({"name": k, "value": v} for k, v in env)]}
    spec = {"completionMode": "Indexed", "completions": pods, "parallelism": pods, "backoffLimit": backoff_limit,
            "podReplacementPolicy": "Failed",
            "template": {"spec": {"restartPolicy": "Never", "subdomain": "demo", "containers": [container],
                                  "terminationGracePeriodSeconds": 2}}}
    if policy:
        spec["podFailurePolicy"] = policy
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "demo"}, "spec": spec}
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def start(jobs, path, first_ip, **kwargs):
    job = local_job.IndexedJob(path, first_ip=first_ip, folder=path.parent / "pods", **kwargs)
    jobs.append(job)
    return job.start()


SERVER = """
import os, socket
server = socket.create_server((os.environ["POD_IP"], int(os.environ["PORT"])))
print("listening", flush=True)
connection, _ = server.accept()
connection.sendall(f"hello from {socket.gethostname()}".encode())
"""
CLIENT = """
import os, socket, time
for _ in range(300):
    try:
        connection = socket.create_connection(("demo-0.demo", int(os.environ["PORT"])), timeout=5)
        break
    except OSError:
        time.sleep(0.1)
print("received", connection.recv(100).decode(), "from", connection.getpeername()[0], flush=True)
"""


IDENTITY = """
echo "hostname=$$(hostname) HOSTNAME=$$HOSTNAME index=$$JOB_COMPLETION_INDEX ip=$$POD_IP"
echo "peer $$(getent hosts demo-0.demo)"
if [ "$$JOB_COMPLETION_INDEX" = 0 ]; then exec python3 -c "$$SERVER"; else exec python3 -c "$$CLIENT"; fi
"""


def test_pods_know_their_index_and_reach_each_other_by_name(tmp_path, jobs, first_ip):
    path = write_job(tmp_path, IDENTITY, env=[("SERVER", SERVER), ("CLIENT", CLIENT), ("PORT", str(free_ports()))])
    job = start(jobs, path, first_ip)
    assert job.wait(40) == ("Complete", "CompletionsReached"), job.output(0) + job.output(1)
    ip0 = first_ip
    ip1 = first_ip.rsplit(".", 1)[0] + ".11"
    out0, out1 = job.pod(0).output, job.pod(1).output
    assert f"hostname=demo-0 HOSTNAME=demo-0 index=0 ip={ip0}\n" in out0
    assert f"hostname=demo-1 HOSTNAME=demo-1 index=1 ip={ip1}\n" in out1
    # glibc in the pod resolves the peer's name through the pod's /etc/hosts, to pod 0's address
    assert f"peer {ip0}" in out1 and "demo-0.demo" in out1
    # the rendezvous name works: pod 1 reached pod 0's server, listening on pod 0's own address
    assert f"received hello from demo-0 from {ip0}\n" in out1
    assert sorted(job.history) == [(0, 0, "succeeded"), (1, 0, "succeeded")]
    assert re.search(r"local_pod: pod demo-0-[a-z0-9]{5}: starting", out0)  # <job>-<index>-<suffix>


# Each pod counts its own attempts in a shared file and exits as plan-<index>-<attempt> says;
# with no plan it waits. SIGTERM: exit 143 (trapped first: PID 1 has no default action for it).
PLANNED = """
trap 'exit 143' TERM
echo "$$JOB_COMPLETION_INDEX" >> "$$SHARED/starts"
attempt=$$(grep -cx "$$JOB_COMPLETION_INDEX" "$$SHARED/starts")
echo "index $$JOB_COMPLETION_INDEX attempt $$attempt"
plan="$$SHARED/plan-$$JOB_COMPLETION_INDEX-$$attempt"
if [ -f "$$plan" ]; then exit "$$(cat "$$plan")"; fi
sleep 60 & wait
"""


def plan(shared, **codes):
    for name, code in codes.items():  # plan_0_1=138: index 0's first pod exits 138
        with open(os.path.join(shared, name.replace("_", "-")), "w") as file:
            file.write(str(code))


def test_rendered_policy_ignores_138_counts_1_and_fails_on_64(tmp_path, jobs, first_ip, shared):
    plan(shared, plan_0_1=138, plan_0_2=1, plan_0_3=64)
    path = write_job(tmp_path, PLANNED, env=[("SHARED", shared)], policy=RENDERED_POLICY)
    job = start(jobs, path, first_ip)
    assert job.wait(40) == ("Failed", "PodFailurePolicy")
    # 138 replaced, not counted; 1 replaced and counted; 64 fails the Job, and the other pod is deleted
    assert job.history == [(0, 138, "ignored"), (0, 1, "counted"), (0, 64, "failjob"), (1, 143, "terminated")]
    assert (job.attempts(0), job.attempts(1), job.failures) == (3, 1, 1)
    assert "index 0 attempt 2\n" in job.pods(0)[1].output and "index 0 attempt 3\n" in job.output(0)


def test_preemption_is_ignored_a_lost_node_counted_past_the_backoff_limit(tmp_path, jobs, first_ip, shared):
    plan(shared, plan_1_1=0)  # index 1 succeeds at once and is not run again
    path = write_job(tmp_path, PLANNED, env=[("SHARED", shared)], policy=RENDERED_POLICY, backoff_limit=1)
    job = start(jobs, path, first_ip)
    job.pod(0).wait_for("index 0 attempt 1", 20)
    job.delete(0)  # a preemption: DisruptionTarget, ignored
    job.wait_for_pod(0, 2).wait_for("index 0 attempt 2", 20)
    assert job.pods(0)[1].lose_node()  # SIGKILL: 137, counted (1 of backoffLimit 1)
    job.wait_for_pod(0, 3).wait_for("index 0 attempt 3", 20)
    assert job.pods(0)[2].lose_node()  # the second counted failure is past the limit
    assert job.wait(30) == ("Failed", "BackoffLimitExceeded")
    assert sorted(job.history) == [(0, 137, "counted"), (0, 137, "counted"), (0, 143, "ignored"), (1, 0, "succeeded")]
    assert (job.attempts(0), job.attempts(1), job.failures) == (3, 1, 2)


def test_rendered_indexed_manifest_runs_with_its_configmap_from_the_stream(tmp_path, jobs, first_ip):
    rendered = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "submit.py"), "r1", "--image", "img:1", "--code", "s3://bkt/c/",
         "--data", "s3://bkt/d/", "--output", "s3://bkt/o/", "--engine", "indexed", "--nodes", "2",
         "--gpus-per-node", "1"], capture_output=True, text=True, check=True)
    documents = list(yaml.safe_load_all(rendered.stdout))
    configmap = next(d for d in documents if d["kind"] == "ConfigMap")
    job_doc = next(d for d in documents if d["kind"] == "Job")
    assert set(configmap["data"]) >= {"script.sh", "contract.py"}
    configmap["data"]["marker"] = "from the stream\n"  # not in job/: only the stream has it
    pod_spec = job_doc["spec"]["template"]["spec"]
    pod_spec["terminationGracePeriodSeconds"] = 2
    # The rendered pod (user 1000, read-only root, the ConfigMap at /opt/job), running a check
    # instead of script.sh.
    pod_spec["containers"][0]["command"] = ["/bin/bash", "-c",
                                            'test -f /opt/job/script.sh && cat /opt/job/marker '
                                            '&& echo "id=$$(id -u) rdzv=$$RDZV_ENDPOINT nnodes=$$NNODES" '
                                            '&& echo "group key of $${#GROUP_SECRET} characters" '
                                            '&& getent hosts r1-0.r1 r1-1.r1.default.svc.cluster.local']
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    job = start(jobs, path, first_ip, configmaps={"script-configmap": ROOT / "job"})
    assert job.wait(40) == ("Complete", "CompletionsReached"), job.output(0) + job.output(1)
    prefix = first_ip.rsplit(".", 1)[0]
    for index in (0, 1):
        output = job.output(index)
        # Two lines, not one string: the runner's own lines (stderr) can come between the pod's.
        assert "from the stream\n" in output and "id=1000 rdzv=r1-0.r1:29400 nnodes=2\n" in output
        assert "group key of 64 characters\n" in output, "the stream's Secret, as a cluster gives it"
        assert f"{prefix}.10" in output and f"{prefix}.11" in output


def test_run_starts_an_indexed_job_with_the_runs_env(s3, s3_endpoint, tmp_path, first_ip, jobs, monkeypatch):
    """podlab.Run.start_indexed: the rendered stream, and every pod gets what Run.start gives one pod
    (the local S3 and its credentials, TRAIN_CONFIG) and reaches that S3 from its own address."""
    run = Run(s3, s3_endpoint, tmp_path / "run")
    path = run.render_indexed(nodes=2, name="r1")
    documents = list(yaml.safe_load_all(path.read_text()))
    job_doc = next(d for d in documents if d["kind"] == "Job")
    job_doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
    job_doc["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "/bin/bash", "-c", 'aws s3api head-bucket --bucket test-bucket '
                           '&& echo "output=$$S3_OUTPUT_URI config=$$TRAIN_CONFIG index=$$JOB_COMPLETION_INDEX"']
    path.write_text(yaml.safe_dump_all(documents))
    monkeypatch.setattr(local_job, "FIRST_IP", first_ip)
    job = run.start_indexed(path)
    jobs.append(job)
    assert job.wait(40) == ("Complete", "CompletionsReached"), job.output(0) + job.output(1)
    for index in (0, 1):
        assert f"output=s3://test-bucket/runs/run/ config=config/tiny.yaml index={index}\n" in job.output(index)


def test_active_deadline_deletes_every_pod(tmp_path, jobs, first_ip, shared):
    path = write_job(tmp_path, PLANNED, env=[("SHARED", shared)])
    job_doc = yaml.safe_load(path.read_text())
    job_doc["spec"]["activeDeadlineSeconds"] = 2
    path.write_text(yaml.safe_dump(job_doc))
    job = start(jobs, path, first_ip)
    assert job.wait(30) == ("Failed", "DeadlineExceeded")
    assert sorted(job.history) == [(0, 143, "terminated"), (1, 143, "terminated")]


def test_command_line_runs_the_job_and_refuses_a_job_that_is_not_indexed(tmp_path):
    path = write_job(tmp_path, 'echo "index $$JOB_COMPLETION_INDEX"', pods=3)
    result = subprocess.run([sys.executable, str(ROOT / "lab" / "local_job.py"), str(path)],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert sorted(line.split("] ")[1] for line in result.stdout.splitlines() if "] index" in line) == \
        ["index 0", "index 1", "index 2"]
    job_doc = yaml.safe_load(path.read_text())
    del job_doc["spec"]["completionMode"]
    path.write_text(yaml.safe_dump(job_doc))
    result = subprocess.run([sys.executable, str(ROOT / "lab" / "local_job.py"), str(path)],
                            capture_output=True, text=True, timeout=50)
    assert (result.returncode, result.stdout) == (64, "")
    assert result.stderr.count("\n") == 1 and "not Indexed" in result.stderr


# ---------------------------------------------------------------- JobSetRun and PyTorchJobRun

# Each pod prints who it is, then exits as plan-<index>-<attempt> says (attempt: the JobSet's
# restart-attempt, or the pod's own count), else waits for its deletion.
JOBSET_POD = """
trap 'exit 143' TERM
echo "index $$JOB_COMPLETION_INDEX attempt $$ATTEMPT host $$(hostname) peer $$(getent hosts demo-node-0-0.demo | awk '{print $$1}')"
plan="$$SHARED/plan-$$JOB_COMPLETION_INDEX-$$ATTEMPT"
if [ -f "$$plan" ]; then exit "$$(cat "$$plan")"; fi
sleep 60 & wait
"""
# submit.py --engine jobset's rules, the child Job's and the JobSet's.
JOBSET_CHILD_POLICY = {"rules": [
    {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [64]}},
]}
JOBSET_RULES = [
    {"name": "badInput", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
     "onJobFailureMessagePatterns": ["failed with exit code 64 matching FailJob rule"]},
    {"name": "disrupted", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"],
     "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching FailJob rule"]},
]


def write_jobset(directory, shared, max_restarts):
    attempt = "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
    container = {"name": "trainer", "image": "unused", "command": ["bash", "-c", JOBSET_POD],
                 "env": [{"name": "SHARED", "value": shared},
                         {"name": "ATTEMPT", "valueFrom": {"fieldRef": {"fieldPath": attempt}}}]}
    child = {"completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimit": 0,
             "podReplacementPolicy": "Failed", "podFailurePolicy": JOBSET_CHILD_POLICY,
             "template": {"spec": {"restartPolicy": "Never", "containers": [container],
                                   "terminationGracePeriodSeconds": 2}}}
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "demo"},
              "spec": {"network": {"enableDNSHostnames": True},
                       "failurePolicy": {"maxRestarts": max_restarts, "rules": JOBSET_RULES},
                       "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": child}}]}}
    path = directory / "jobset.yaml"
    path.write_text(yaml.safe_dump(jobset))
    return path


def start_jobset(jobs, path, first_ip):
    jobset = local_job.JobSetRun(path, first_ip=first_ip, folder=path.parent / "pods")
    jobs.append(jobset)
    return jobset.start()


def test_jobset_preemption_restarts_every_pod_uncounted_then_completes(tmp_path, jobs, first_ip, shared):
    plan(shared, plan_0_1=0, plan_1_1=0)  # restart-attempt 1: both succeed
    jobset = start_jobset(jobs, write_jobset(tmp_path, shared, max_restarts=0), first_ip)
    jobset.pod(1).wait_for("index 1 attempt 0", 20)
    jobset.delete(1)  # DisruptionTarget: the child Job fails by its FailJob rule
    assert jobset.wait(40) == ("Completed", "AllJobsCompleted"), jobset.output(0) + jobset.output(1)
    # The preempted pod and its peer (deleted by the failed child Job) both come back, restart-attempt 1,
    # not counted against maxRestarts 0.
    assert jobset.history[:2] == [(1, 143, "failjob"), (0, 143, "terminated")], jobset.history
    assert sorted(jobset.history[2:]) == [(0, 0, "succeeded"), (1, 0, "succeeded")], jobset.history
    assert (jobset.restarts, jobset.counted_restarts) == (1, 0)
    (attempt, reason, message, decision), = jobset.failures
    assert (attempt, reason, decision) == (0, "PodFailurePolicy", "restart (not counted)")
    assert re.fullmatch(r"Pod default/demo-node-0-1-[a-z0-9]{5} has condition DisruptionTarget matching FailJob "
                        r"rule at index 0", message)
    prefix = first_ip.rsplit(".", 1)[0]
    for index in (0, 1):
        assert [line for line in jobset.output(index).splitlines() if line.startswith("index")] == [
            f"index {index} attempt {n} host demo-node-0-{index} peer {prefix}.10" for n in (0, 1)]


def test_jobset_counts_crashes_up_to_max_restarts_and_fails_on_bad_input(tmp_path, jobs, first_ip, shared):
    plan(shared, plan_0_0=1, plan_1_1=137, plan_1_2=64)
    jobset = start_jobset(jobs, write_jobset(tmp_path, shared, max_restarts=3), first_ip)
    assert jobset.wait(60) == ("Failed", "FailJobSetFailurePolicyAction"), jobset.failures
    assert [(f[0], f[1], f[3]) for f in jobset.failures] == [
        (0, "BackoffLimitExceeded", "restart (counted)"), (1, "BackoffLimitExceeded", "restart (counted)"),
        (2, "PodFailurePolicy", "Failed (FailJobSetFailurePolicyAction)")]
    assert "failed with exit code 64 matching FailJob rule at index 1" in jobset.failures[2][2]
    assert (jobset.restarts, jobset.counted_restarts, jobset.attempts(0), jobset.attempts(1)) == (2, 2, 3, 3)


def test_jobset_fails_past_max_restarts(tmp_path, jobs, first_ip, shared):
    plan(shared, plan_0_0=1, plan_0_1=1)
    jobset = start_jobset(jobs, write_jobset(tmp_path, shared, max_restarts=1), first_ip)
    assert jobset.wait(40) == ("Failed", "ReachedMaxRestarts"), jobset.failures
    assert (jobset.restarts, jobset.attempts(0)) == (1, 2)


# The operator's env, then exit as plan-<rank>-<n> says (n: this pod's count) once it is there.
PYTORCH_POD = """
trap 'exit 143' TERM
echo "$$RANK" >> "$$SHARED/starts"
n=$$(grep -cx "$$RANK" "$$SHARED/starts")
echo "rank $$RANK pod $$n host $$(hostname) master $$MASTER_ADDR:$$MASTER_PORT at $$(getent hosts $$MASTER_ADDR | awk 'NR == 1 {print $$1}') world $$WORLD_SIZE nnodes $$PET_NNODES"
plan="$$SHARED/plan-$$RANK-$$n"
while [ ! -f "$$plan" ]; do sleep 0.2 & wait; done
exit "$$(cat "$$plan")"
"""


def plan_now(shared, rank, pod, code):
    """Tell pod number `pod` of `rank` to exit `code` now (renamed into place: never read half written)."""
    path = os.path.join(shared, f"plan-{rank}-{pod}")
    with open(path + ".tmp", "w") as file:
        file.write(str(code))
    os.replace(path + ".tmp", path)


def write_pytorchjob(directory, shared, clean_pod_policy=None):
    def replica():
        container = {"name": "pytorch", "image": "unused", "command": ["bash", "-c", PYTORCH_POD],
                     "env": [{"name": "SHARED", "value": shared}],
                     "ports": [{"name": "pytorchjob-port", "containerPort": 23456}]}
        return {"replicas": 1, "restartPolicy": "ExitCode",
                "template": {"spec": {"containers": [container], "terminationGracePeriodSeconds": 2}}}
    spec = {"pytorchReplicaSpecs": {"Master": replica(), "Worker": replica()},
            "runPolicy": {"cleanPodPolicy": clean_pod_policy} if clean_pod_policy else {}}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "demo"}, "spec": spec}
    path = directory / "pytorchjob.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def start_pytorchjob(jobs, path, first_ip):
    job = local_job.PyTorchJobRun(path, first_ip=first_ip, folder=path.parent / "pods")
    jobs.append(job)
    return job.start()


def test_pytorchjob_recreates_a_signalled_pod_alone_and_succeeds_with_its_master(tmp_path, jobs, first_ip, shared):
    job = start_pytorchjob(jobs, write_pytorchjob(tmp_path, shared), first_ip)
    job.pod(0).wait_for("rank 0 pod 1", 20)
    job.pod(1).wait_for("rank 1 pod 1", 20)
    job.pod(1).delete()  # 143: retryable, the worker alone is recreated
    job.wait_for_pod(1, 2).wait_for("rank 1 pod 2", 20)
    plan_now(shared, 1, 2, 0)
    assert local_job.wait_until(lambda: (1, 0, "succeeded") in job.history, 20), job.history
    assert job.condition is None and job.pod(0).exit_code() is None, "a Worker's success does not end the job"
    plan_now(shared, 0, 1, 0)
    assert job.wait(40) == ("Succeeded", "PyTorchJobSucceeded"), job.history
    assert job.history == [(1, 143, "restart"), (1, 0, "succeeded"), (0, 0, "succeeded")]
    assert (job.attempts(0), job.attempts(1), job.restarts) == (1, 2, 1)
    ip0 = first_ip
    assert f"rank 0 pod 1 host demo-master-0 master demo-master-0:23456 at {ip0} world 2 nnodes 2\n" in job.output(0)
    assert f"rank 1 pod 2 host demo-worker-0 master demo-master-0:23456 at {ip0} world 2 nnodes 2\n" in job.output(1)


def test_pytorchjob_fails_on_a_code_below_128_and_leaves_the_others_under_clean_pod_policy_none(
        tmp_path, jobs, first_ip, shared):
    job = start_pytorchjob(jobs, write_pytorchjob(tmp_path, shared), first_ip)
    job.pod(0).wait_for("rank 0 pod 1", 20)
    plan_now(shared, 1, 1, 75)  # "a retry may pass" is not retryable under ExitCode
    assert local_job.wait_until(lambda: (1, 75, "failed") in job.history, 20), job.history
    assert job.pod(0).exit_code() is None, "cleanPodPolicy None: the master is left running"
    plan_now(shared, 0, 1, 138)  # it ends by itself: nothing is recreated for a finished job
    assert job.wait(40) == ("Failed", "PyTorchJobFailed")
    assert job.history == [(1, 75, "failed"), (0, 138, "terminated")] and job.restarts == 0


def test_pytorchjob_clean_pod_policy_running_deletes_the_others(tmp_path, jobs, first_ip, shared):
    job = start_pytorchjob(jobs, write_pytorchjob(tmp_path, shared, "Running"), first_ip)
    job.pod(0).wait_for("rank 0 pod 1", 20)
    plan_now(shared, 1, 1, 64)
    assert job.wait(40) == ("Failed", "PyTorchJobFailed")
    assert job.history == [(1, 64, "failed"), (0, 143, "terminated")]


def test_command_line_runs_a_jobset_and_a_pytorchjob_by_their_kind(tmp_path, shared):
    plan(shared, plan_0_0=0, plan_1_0=0)
    result = subprocess.run([sys.executable, str(ROOT / "lab" / "local_job.py"),
                             str(write_jobset(tmp_path, shared, max_restarts=0))],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "JobSet demo Completed: AllJobsCompleted" in result.stderr
    started = sorted(line.split("] ")[1].split(" host")[0] for line in result.stdout.splitlines() if "] index" in line)
    assert started == ["index 0 attempt 0", "index 1 attempt 0"]
    plan_now(shared, 0, 1, 0)
    plan_now(shared, 1, 1, 0)
    result = subprocess.run([sys.executable, str(ROOT / "lab" / "local_job.py"),
                             str(write_pytorchjob(tmp_path, shared))], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "PyTorchJob demo Succeeded: PyTorchJobSucceeded" in result.stderr
