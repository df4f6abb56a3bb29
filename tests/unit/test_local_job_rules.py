"""The local Job controller's podFailurePolicy decision (lab/local_job.py), and what local_pod.py
gives a pod of an Indexed Job (its name, hostname, index, address, /etc/hosts). No root."""

import pytest
import yaml

import local_job
import local_pod
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
