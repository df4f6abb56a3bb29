"""The local Job controller's podFailurePolicy decision (lab/local_job.py), and what local_pod.py
gives a pod of an Indexed Job (its name, hostname, index, address, /etc/hosts). No root."""

import socket

import pytest
import yaml

import local_job
import local_pod
import podlab
from local_job import PodFailure, decide

# submit.py --engine indexed's rules: preemption ignored, bad input fails the Job, a peer's loss ignored.
RENDERED = [
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [64]}},
    {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [138]}},
]
DISRUPTED = frozenset({"DisruptionTarget"})


@pytest.mark.parametrize("exit_code, conditions, failures, expected", [
    (0, frozenset(), 0, ("succeeded", None)),
    (0, DISRUPTED, 0, ("succeeded", None)),          # a pod that exits 0 succeeded, whatever its conditions
    (138, frozenset(), 0, ("ignored", None)),        # a peer lost: the group restarts, not counted
    (143, DISRUPTED, 6, ("ignored", None)),          # a preemption never counts, even at the limit
    (64, frozenset(), 0, ("failjob", "PodFailurePolicy")),
    (64, DISRUPTED, 0, ("ignored", None)),           # rules in order: the condition rule comes first
    (1, frozenset(), 0, ("counted", None)),
    (137, frozenset(), 0, ("counted", None)),        # a lost node: SIGKILL, no condition
    (1, frozenset(), 5, ("counted", None)),          # the 6th failure: backoffLimit 6 allows it
    (1, frozenset(), 6, ("counted", "BackoffLimitExceeded")),  # the 7th fails the Job
])
def test_rendered_policy(exit_code, conditions, failures, expected):
    assert decide(RENDERED, PodFailure("trainer", exit_code, conditions), failures, 6) == expected


@pytest.mark.parametrize("rule, container, exit_code, matches", [
    ({"operator": "In", "values": [3, 4]}, "main", 4, True),
    ({"operator": "In", "values": [3, 4]}, "main", 5, False),
    ({"operator": "NotIn", "values": [3, 4]}, "main", 5, True),
    ({"operator": "NotIn", "values": [3, 4]}, "main", 3, False),
    ({"operator": "NotIn", "values": [3]}, "main", 0, False),  # exit 0 never matches an exit-code rule
    ({"operator": "In", "values": [3], "containerName": "main"}, "main", 3, True),
    ({"operator": "In", "values": [3], "containerName": "sidecar"}, "main", 3, False),
])
def test_on_exit_codes(rule, container, exit_code, matches):
    assert local_job.rule_matches({"action": "Count", "onExitCodes": rule},
                                  PodFailure(container, exit_code)) is matches


@pytest.mark.parametrize("pattern, conditions, matches", [
    ({"type": "DisruptionTarget"}, DISRUPTED, True),    # status defaults to True
    ({"type": "DisruptionTarget", "status": "True"}, frozenset(), False),
    ({"type": "DisruptionTarget", "status": "False"}, DISRUPTED, False),
    ({"type": "ConfigIssue"}, DISRUPTED, False),
])
def test_on_pod_conditions(pattern, conditions, matches):
    assert local_job.rule_matches({"action": "Ignore", "onPodConditions": [pattern]},
                                  PodFailure("main", 143, conditions)) is matches


@pytest.mark.parametrize("rules, failures, limit, expected", [
    ([], 0, 0, ("counted", "BackoffLimitExceeded")),  # backoffLimit 0: the first failure fails the Job
    ([], 2, 3, ("counted", None)),
    ([{"action": "Count", "onExitCodes": {"operator": "In", "values": [1]}},
      {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [1]}}], 0, 6, ("counted", None)),
])
def test_count_and_backoff_limit(rules, failures, limit, expected):
    assert decide(rules, PodFailure("main", 1), failures, limit) == expected


@pytest.mark.parametrize("spec, message", [
    ({"completions": 2, "parallelism": 2}, "not Indexed"),
    ({"completionMode": "Indexed", "completions": 3, "parallelism": 2}, "must equal parallelism"),
    ({"completionMode": "Indexed", "completions": 2, "parallelism": 2,
      "podFailurePolicy": {"rules": [{"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [1]}}]}},
     "FailIndex"),
    ({"completionMode": "Indexed", "completions": 2, "parallelism": 2,
      "podFailurePolicy": {"rules": [{"action": "Ignore", "onExitCodes": {"operator": "Is", "values": [1]}}]}},
     "operator"),
])
def test_refused_jobs(tmp_path, spec, message):
    path = write_job(tmp_path, spec)
    with pytest.raises(local_pod.BadInput, match=message):
        local_job.IndexedJob(path)


def test_peer_hosts_only_with_a_subdomain():
    ips = ["127.0.0.10", "127.0.0.11"]
    assert local_job.peer_hosts("r1", None, "default", ips) == []
    assert local_job.peer_hosts("r1", "r1", "default", ips) == [
        ("r1-0.r1", "127.0.0.10"), ("r1-0.r1.default.svc.cluster.local", "127.0.0.10"),
        ("r1-1.r1", "127.0.0.11"), ("r1-1.r1.default.svc.cluster.local", "127.0.0.11")]


# ---------------------------------------------------------------- a pod of an Indexed Job


def write_job(directory, spec, pod_spec=None):
    container = {"name": "main", "image": "unused", "command": ["true"],
                 "env": [{"name": "IDX", "valueFrom": {"fieldRef": {
                     "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]}
    template = {"spec": {"restartPolicy": "Never", "containers": [container], **(pod_spec or {})}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "r1"}, "spec": {**spec, "template": template}}
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


INDEXED = {"completionMode": "Indexed", "completions": 2, "parallelism": 2}


def test_indexed_pod_identity(tmp_path):
    path = write_job(tmp_path, INDEXED, {"subdomain": "r1"})
    pod = local_pod.load_pod(path, {}, {}, 1, "127.0.0.11", [("r1-0.r1", "127.0.0.10")])
    assert pod.name.startswith("r1-1-") and len(pod.name) == len("r1-1-") + 5
    assert local_pod.pod_hostname(pod) == "r1-1"
    assert (pod.env["HOSTNAME"], pod.env["JOB_COMPLETION_INDEX"], pod.env["IDX"]) == ("r1-1", "1", "1")
    assert local_pod.hosts_file(pod).splitlines()[3:] == [
        "127.0.0.11\tr1-1.r1.default.svc.cluster.local\tr1-1", "",
        "# What the cluster DNS would answer (local_pod.py --host).", "127.0.0.10\tr1-0.r1"]


def test_plain_pod_keeps_its_name_and_address(tmp_path):
    pod = local_pod.load_pod(write_job(tmp_path, {}), {}, {})
    assert local_pod.pod_hostname(pod) == pod.name and pod.env["HOSTNAME"] == pod.name
    assert "JOB_COMPLETION_INDEX" not in pod.env
    assert local_pod.hosts_file(pod).splitlines()[-1] == f"127.0.0.1\t{pod.name}"


def test_a_container_defined_index_variable_wins(tmp_path):
    path = write_job(tmp_path, INDEXED)
    job = yaml.safe_load(path.read_text())
    job["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "JOB_COMPLETION_INDEX", "value": "7"})
    path.write_text(yaml.safe_dump(job))
    assert local_pod.load_pod(path, {}, {}, 0).env["JOB_COMPLETION_INDEX"] == "7"


@pytest.mark.parametrize("spec, args, message", [
    ({}, {"index": 0}, "not Indexed"),
    (INDEXED, {"index": 2}, r"outside \[0, 2\)"),
    (INDEXED, {"index": -1}, r"outside \[0, 2\)"),
    (INDEXED, {"index": 0, "pod_ip": "10.0.0.5"}, "not a loopback address"),
    (INDEXED, {"index": 0, "pod_ip": "localhost"}, "not a loopback address"),
])
def test_refused_pods(tmp_path, spec, args, message):
    with pytest.raises(local_pod.BadInput, match=message):
        local_pod.load_pod(write_job(tmp_path, spec), {}, {}, **args)


@pytest.mark.parametrize("text", ["r1-0.r1=192.168.1.2", "r1-0.r1", "bad name=127.0.0.2", "=127.0.0.2"])
def test_refused_host_entries(text):
    with pytest.raises(local_pod.BadInput):
        local_pod.host_alias(text)


def test_configmap_from_the_stream_fills_the_volume(tmp_path):
    path = write_job(tmp_path, INDEXED, {"volumes": [{"name": "job", "configMap": {"name": "script-configmap"}}]})
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "script-configmap"},
                 "data": {"script.sh": "echo from-the-stream\n"}, "binaryData": {"blob": "AAE="}}
    path.write_text(yaml.safe_dump(configmap) + "---\n" + path.read_text())
    pod = local_pod.load_pod(path, {}, {"script-configmap": tmp_path / "absent"}, 0)
    assert pod.volumes["job"].files == {"blob": (b"\x00\x01", 0o644), "script.sh": (b"echo from-the-stream\n", 0o644)}


@pytest.mark.parametrize("args, message", [
    (["--index", "2"], r"outside [0, 2)"),
    (["--index", "0", "--pod-ip", "10.0.0.1"], "not a loopback address"),
    (["--index", "0", "--host", "r1-0.r1=8.8.8.8"], "not a loopback address"),
])
def test_command_line_refuses_with_one_line(tmp_path, capfd, args, message):
    assert local_pod.main([*args, str(write_job(tmp_path, INDEXED))]) == local_pod.EXIT_BAD_INPUT
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and message in err


# ---------------------------------------------------------------- the JobSet controller (JobSetRun)

# submit.py --engine jobset: the child Job's rules (backoffLimit 0) and the JobSet's failurePolicy.
CHILD_RULES = [
    {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [64]}},
]
JOBSET_POLICY = {"maxRestarts": 6, "rules": [
    {"name": "badInput", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
     "onJobFailureMessagePatterns": ["failed with exit code 64 matching FailJob rule"]},
    {"name": "disrupted", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"],
     "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching FailJob rule"]},
]}
POD = "default/r1-node-0-1-abcde"


@pytest.mark.parametrize("exit_code, conditions, expected", [
    (0, frozenset(), None),
    (64, frozenset(), ("PodFailurePolicy", "Container trainer for pod default/r1-node-0-1-abcde failed with exit "
                                           "code 64 matching FailJob rule at index 1")),
    (143, DISRUPTED, ("PodFailurePolicy", "Pod default/r1-node-0-1-abcde has condition DisruptionTarget matching "
                                          "FailJob rule at index 0")),
    (64, DISRUPTED, ("PodFailurePolicy", "Pod default/r1-node-0-1-abcde has condition DisruptionTarget matching "
                                         "FailJob rule at index 0")),  # rules in order
    (137, frozenset(), ("BackoffLimitExceeded", "Job has reached the specified backoff limit")),  # lost node
    (138, frozenset(), ("BackoffLimitExceeded", "Job has reached the specified backoff limit")),  # its peer
    (1, frozenset(), ("BackoffLimitExceeded", "Job has reached the specified backoff limit")),
])
def test_child_job_failure_as_the_job_controller_words_it(exit_code, conditions, expected):
    assert local_job.job_failure(CHILD_RULES, PodFailure("trainer", exit_code, conditions), POD, 0, 0) == expected


def test_child_job_with_a_backoff_limit_goes_on():
    assert local_job.job_failure([], PodFailure("trainer", 1), POD, 0, 1) is None
    assert local_job.job_failure([], PodFailure("trainer", 1), POD, 1, 1)[0] == "BackoffLimitExceeded"


def child_failure_of(exit_code, conditions=frozenset()):
    return local_job.job_failure(CHILD_RULES, PodFailure("trainer", exit_code, conditions), POD, 0, 0)


@pytest.mark.parametrize("failure, counted, expected", [
    (child_failure_of(64), 0, ("Failed", "FailJobSetFailurePolicyAction")),       # bad input: no restart
    (child_failure_of(143, DISRUPTED), 6, ("restart", "not counted")),             # preemption, even at the max
    (child_failure_of(137), 0, ("restart", "counted")),                            # no rule: RestartJobSet
    (child_failure_of(138), 5, ("restart", "counted")),                            # the 6th of maxRestarts 6
    (child_failure_of(137), 6, ("Failed", "ReachedMaxRestarts")),                  # the 7th
    (child_failure_of(1), 0, ("restart", "counted")),
    (("PodFailurePolicy", "Container trainer for pod p failed with exit code 65 matching FailJob rule at index 1"),
     0, ("restart", "counted")),                                                   # 65 is not 64: no match
])
def test_jobset_failure_policy_of_the_rendered_jobset(failure, counted, expected):
    reason, message = failure
    assert local_job.jobset_decision(JOBSET_POLICY, reason, message, "node", counted) == expected


@pytest.mark.parametrize("rule, reason, message, replicated_job, applies", [
    ({}, "BackoffLimitExceeded", "m", "node", True),                           # no criteria: any failure
    ({"onJobFailureReasons": ["PodFailurePolicy"]}, "BackoffLimitExceeded", "m", "node", False),
    ({"onJobFailureMessagePatterns": ["exit code 6[0-9] "]}, "PodFailurePolicy", "failed with exit code 64 m",
     "node", True),                                                            # a regular expression, anywhere
    ({"onJobFailureMessagePatterns": ["^exit"]}, "PodFailurePolicy", "failed with exit code 64", "node", False),
    ({"targetReplicatedJobs": ["driver"]}, "BackoffLimitExceeded", "m", "node", False),
    ({"targetReplicatedJobs": ["node"], "onJobFailureReasons": ["BackoffLimitExceeded"]},
     "BackoffLimitExceeded", "m", "node", True),
])
def test_jobset_rule_applies(rule, reason, message, replicated_job, applies):
    assert local_job.jobset_rule_applies(rule, reason, message, replicated_job) is applies


def test_jobset_without_failure_policy_fails_on_the_first_failed_job():
    assert local_job.jobset_decision(None, "BackoffLimitExceeded", "m", "node", 0) == ("Failed", "FailedJobs")


def test_jobset_first_applicable_rule_wins_and_max_restarts_defaults_to_zero():
    policy = {"rules": [{"action": "RestartJobSet"}, {"action": "FailJobSet"}]}
    assert local_job.jobset_decision(policy, "BackoffLimitExceeded", "m", "node", 0) == ("Failed", "ReachedMaxRestarts")
    policy = {"maxRestarts": 1, "rules": [{"action": "RestartJobSet"}, {"action": "FailJobSet"}]}
    assert local_job.jobset_decision(policy, "BackoffLimitExceeded", "m", "node", 0) == ("restart", "counted")


JOB_CONFIGMAP = {"script-configmap": local_job.podlab.ROOT / "job"}  # what the stream's ConfigMap holds


def render(engine, nodes=2):
    import submit  # scripts/: the renderer the user runs
    args = submit.parse_args(["r1", "--image", "img:1", "--code", "s3://bkt/c/", "--data", "s3://bkt/d/",
                              "--output", "s3://bkt/o/", "--engine", engine, "--nodes", str(nodes),
                              "--gpus-per-node", "1"])
    return submit.render(args)


def group_key_of(documents: list[dict]) -> str:
    import base64
    secret = next(d for d in documents if d["kind"] == "Secret")
    return base64.b64decode(secret["data"]["GROUP_SECRET"]).decode()


def test_jobset_child_job_is_named_labelled_and_placed_as_the_jobset_controller_does():
    jobset = render("jobset")[-1]
    child = local_job.jobset_child(jobset, restarts=2)
    assert child["metadata"]["name"] == "r1-node-0"
    pod = child["spec"]["template"]
    assert pod["spec"]["subdomain"] == "r1"  # enableDNSHostnames: the JobSet's name
    for meta in (child["metadata"], pod["metadata"]):
        for marks in (meta["labels"], meta["annotations"]):
            assert marks["jobset.sigs.k8s.io/restart-attempt"] == "2"
            assert marks["jobset.sigs.k8s.io/jobset-name"] == "r1"
            assert marks["jobset.sigs.k8s.io/replicatedjob-name"] == "node"
            assert marks["jobset.sigs.k8s.io/job-index"] == "0"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "r1"  # the template's own labels kept
    assert child["spec"]["backoffLimit"] == 0 and child["spec"]["completions"] == 2
    assert "restart-attempt" not in str(jobset)  # the JobSet itself is not changed


def test_jobset_run_reads_the_rendered_stream(tmp_path):
    path, documents = tmp_path / "r1.yaml", render("jobset")
    path.write_text(yaml.safe_dump_all(documents))
    jobset = local_job.JobSetRun(path, folder=tmp_path / "pods")
    child = jobset.children[0]
    assert (jobset.name, jobset.size, child.name, child.backoff_limit) == ("r1", 2, "r1-node-0", 0)
    assert child.hosts[0] == ("r1-node-0-0.r1", "127.0.0.10")  # the RDZV_ENDPOINT submit.py sets resolves
    pod = local_pod.load_pod(child.manifest, {}, JOB_CONFIGMAP, 1, child.ips[1], child.hosts)
    assert local_pod.pod_hostname(pod) == "r1-node-0-1" and pod.env["JOB_COMPLETION_INDEX"] == "1"
    assert pod.env["RDZV_ENDPOINT"].split(":")[0] == child.hosts[0][0]
    assert pod.env["GROUP_SECRET"] == group_key_of(documents), "the stream's Secret reaches the child Job's pods"


@pytest.mark.parametrize("change, message", [
    (lambda js: js["spec"]["replicatedJobs"][0].update(replicas=2), "one replicatedJob with replicas 1"),
    (lambda js: js["spec"]["failurePolicy"]["rules"][0].update(action="Ignore"), "not one of"),
    (lambda js: js["spec"]["failurePolicy"]["rules"][0].update(onJobFailureMessagePatterns=["("]), "regular"),
    (lambda js: js["spec"].update(successPolicy={"operator": "Any"}), "successPolicy"),
])
def test_refused_jobsets(tmp_path, change, message):
    jobset = render("jobset")[-1]
    change(jobset)
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump(jobset))
    with pytest.raises(local_pod.BadInput, match=message):
        local_job.JobSetRun(path, folder=tmp_path / "pods")


# ---------------------------------------------------------------- the training operator (PyTorchJobRun)


@pytest.mark.parametrize("policy, exit_code, verdict", [
    ("ExitCode", 0, "succeeded"),
    ("ExitCode", 137, "restart"),   # lost node, OOM kill
    ("ExitCode", 143, "restart"),   # deleted, preempted
    ("ExitCode", 130, "restart"),
    ("ExitCode", 138, "restart"),   # a peer lost
    ("ExitCode", 128, "restart"),   # >= 128, whatever the signal: a container that could not start too
    ("ExitCode", 139, "restart"),   # a segfault is retried as well
    ("ExitCode", 127, "failed"),
    ("ExitCode", 75, "failed"),     # "retry may pass" is not retried under ExitCode
    ("ExitCode", 64, "failed"),
    ("ExitCode", 1, "failed"),
    ("Never", 143, "failed"),
])
def test_pytorch_restart_policy(policy, exit_code, verdict):
    assert local_job.pytorch_pod_verdict(policy, exit_code) == verdict


@pytest.mark.parametrize("replicas, succeeded, done", [
    ({"Master": 1, "Worker": 1}, {"Master": 1}, True),     # the Master's success is the job's
    ({"Master": 1, "Worker": 1}, {"Worker": 1}, False),
    ({"Worker": 2}, {"Worker": 1}, False),                 # no Master: every Worker
    ({"Worker": 2}, {"Worker": 2}, True),
])
def test_pytorch_success(replicas, succeeded, done):
    assert local_job.pytorch_succeeded(replicas, succeeded) is done


def test_operator_env_for_master_and_worker():
    replicas = {"Master": 1, "Worker": 2}
    master = dict(local_job.operator_env("r1", replicas, "Master", 0, 23456, "2"))
    worker = dict(local_job.operator_env("r1", replicas, "Worker", 1, 23456, "2"))
    assert master == {"PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456",
                      "MASTER_ADDR": "r1-master-0", "PET_MASTER_ADDR": "r1-master-0", "WORLD_SIZE": "6",
                      "RANK": "0", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "2", "PET_NNODES": "3"}
    assert (worker["RANK"], worker["PET_NODE_RANK"], worker["MASTER_ADDR"]) == ("2", "2", "r1-master-0")
    # nprocPerNode unset: no PET_NPROC_PER_NODE, WORLD_SIZE counts 1 a pod; "auto" counts 1 too
    assert "PET_NPROC_PER_NODE" not in dict(local_job.operator_env("r1", replicas, "Master", 0, 23456, None))
    assert dict(local_job.operator_env("r1", replicas, "Master", 0, 23456, "auto"))["WORLD_SIZE"] == "3"
    # no Master: no MASTER_ADDR, RANK or WORLD_SIZE at all
    assert dict(local_job.operator_env("r1", {"Worker": 2}, "Worker", 0, None, None)) == {
        "PYTHONUNBUFFERED": "1", "PET_NNODES": "2"}


def test_pytorchjob_run_pods_as_the_operator_makes_them(tmp_path):
    path, documents = tmp_path / "r1.yaml", render("pytorchjob", nodes=3)
    path.write_text(yaml.safe_dump_all(documents))
    job = local_job.PyTorchJobRun(path, folder=tmp_path / "pods")
    assert job.slots == [("Master", 0), ("Worker", 0), ("Worker", 1)] and job.master_port == 23456
    assert ("r1-master-0", "127.0.0.10") in job.hosts
    assert ("r1-worker-1.default.svc.cluster.local", "127.0.0.12") in job.hosts
    pods = [local_pod.load_pod(m, {}, JOB_CONFIGMAP, None, ip, job.hosts) for m, ip in zip(job.manifests, job.ips)]
    assert [local_pod.pod_hostname(p) for p in pods] == ["r1-master-0", "r1-worker-0", "r1-worker-1"]
    assert [p.env["RANK"] for p in pods] == ["0", "1", "2"]
    assert {p.env["MASTER_ADDR"] + ":" + p.env["MASTER_PORT"] for p in pods} == {"r1-master-0:23456"}
    assert {p.env["WORLD_SIZE"] for p in pods} == {"3"} and {p.env["PET_NNODES"] for p in pods} == {"3"}
    assert {p.env["GROUP_SECRET"] for p in pods} == {group_key_of(documents)}
    assert all("JOB_COMPLETION_INDEX" not in p.env and "RDZV_ENDPOINT" not in p.env for p in pods)
    assert "127.0.0.10\tr1-master-0\tr1-master-0.default.svc.cluster.local" in local_pod.hosts_file(pods[2])
    assert job.clean_pod_policy == "Running" and job.grace == 300


@pytest.mark.parametrize("change, message", [
    (lambda spec: spec["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Always"), "not modelled"),
    (lambda spec: spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(name="x"),
     "pytorch"),
    (lambda spec: spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(ports=[]),
     "pytorchjob-port"),
    (lambda spec: spec.update(elasticPolicy={"minReplicas": 1}), "elasticPolicy"),
    (lambda spec: spec["pytorchReplicaSpecs"].update(Chief={}), "Master and/or Worker"),
])
def test_refused_pytorchjobs(tmp_path, change, message):
    job = render("pytorchjob")[-1]
    change(job["spec"])
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(local_pod.BadInput, match=message):
        local_job.PyTorchJobRun(path, folder=tmp_path / "pods")


def test_free_ports_are_below_the_ephemeral_range_and_free():
    """A port from the ephemeral range can be an S3 client's by the time a pod binds it (a PyTorchJob
    run failed in CI with the master's store unable to start): the lab hands out only lower ones."""
    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(50):
        port = podlab.free_ports(2)
        assert 10000 <= port and port + 1 < ephemeral_low
        for candidate in (port, port + 1):
            with socket.create_server(("0.0.0.0", candidate)):
                pass
