"""scripts/submit.py without a cluster or kubectl: bad flags stop with exit 64 and one line, and each
engine's manifests are job.yaml's pod template with only what the engine needs changed."""

from __future__ import annotations

import base64
import copy
import json
import re

import pytest
import yaml

import local_job
import local_pod
import submit
from podlab import ROOT

JOB = yaml.safe_load((ROOT / "job.yaml").read_text())
JOB_POD = JOB["spec"]["template"]["spec"]
JOB_ENV = {e["name"]: e["value"] for e in JOB_POD["containers"][0]["env"]}
GOOD = ["run-a", "--image", "registry/gpt:1", "--code", "s3://bkt/gpt/code/", "--data", "s3://bkt/gpt/data/",
        "--output", "s3://bkt/gpt/runs/a/"]


def args(*extra: str):
    return submit.parse_args([*GOOD, *extra])


def differences(a, b, path: str = "") -> set[str]:
    """Paths where a and b differ; lists of named items (env, containers, volumes) compare by name."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {d for key in a.keys() | b.keys() for d in differences(a.get(key), b.get(key), f"{path}.{key}")}
    if isinstance(a, list) and isinstance(b, list) and all(isinstance(x, dict) and "name" in x for x in a + b):
        return differences({x["name"]: x for x in a}, {x["name"]: x for x in b}, path)
    return set() if a == b else {path}


BAD_FLAGS = [
    # (flags replacing or added to GOOD, what the one line must say)
    (["Run_A"], "run name 'Run_A' must be lowercase letters"),
    (["a" * 41], "at most 40 characters"),
    (["--nodes", "two"], "argument --nodes: invalid int value: 'two'; see submit.py --help"),
    (["--nodes", "0"], "--nodes 0 must be at least 1"),
    (["--nodes", "2"], "--engine job runs one pod, not --nodes 2; use --engine indexed, jobset, trainjob or pytorchjob"),
    (["--engine", "mpi"], "argument --engine: invalid choice: 'mpi'"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0 must be at least 1"),
    (["--code", "https://bkt/code/"], "--code 'https://bkt/code/' is not an s3://bucket/prefix/ URI; e.g. --code s3://"),
    (["--code", "s3://ab/code/"], "--code 's3://ab/code/' is not an s3://bucket/prefix/ URI (a bucket name: 3 to 63 "
                                  "lowercase letters, digits, dots and hyphens); e.g. --code s3://"),
    (["--output", "s3://bkt/gpt/code/run/"],
     "--output s3://bkt/gpt/code/run/ and --code s3://bkt/gpt/code/ overlap; give --output its own prefix"),
    (["--output", "s3://bkt/gpt/"], "--output s3://bkt/gpt/ and --code s3://bkt/gpt/code/ overlap"),
    (["--config", "/etc/conf.yaml"],
     "--config '/etc/conf.yaml' must be a path relative to the code, e.g. --config config/conf.yaml"),
    (["--train-script", "../x.py"],
     "--train-script '../x.py' must be a path relative to the code, e.g. --train-script train.py"),
    (["--image", "two words"], "--image 'two words' is not an image reference"),
    (["--apply", "--dry-run"], "not allowed with argument"),
    (["--model", "s3://bkt/gpt/runs/a/model/"], "--output s3://bkt/gpt/runs/a/ and --model s3://bkt/gpt/runs/a/model/ overlap"),
    (["--model", "gs://bkt/m/"], "--model 'gs://bkt/m/' is not an s3://bucket/prefix/ URI"),
    (["--env", "SYNC_INTERVAL_SECONDS"], "--env 'SYNC_INTERVAL_SECONDS' is not KEY=VALUE"),
    (["--env", "1X=2"], "--env '1X=2' is not KEY=VALUE with KEY a variable name"),
    (["--env", "S3_OUTPUT_URI=s3://other/"], "--env S3_OUTPUT_URI: set it with --output"),
    (["--env", "TRAIN_ARGS=--x"], "--env TRAIN_ARGS: set it with --train-args"),
    (["--env", "NNODES=4"], "--env NNODES: set it with --nodes"),
    (["--env", "RDZV_ENDPOINT=h:1"], "--env RDZV_ENDPOINT: the engine sets it for every pod of the group"),
    (["--env", "GROUP_SECRET=k"], "--env GROUP_SECRET: the engine sets it"),
    (["--env", "PET_NNODES=2"], "--env PET_NNODES: the engine sets it"),
    (["--train-args", "--set 'run.name=a b"], "--train-args has an unbalanced quote: the pod would refuse it"),
    (["--train-args", "--lr 1 \\"], "--train-args ends in a lone backslash"),
    (["--namespace", "Team_A"], "--namespace 'Team_A' is not a namespace name"),
]


def replaced(flags: list[str]) -> list[str]:
    argv = list(GOOD)
    if flags and not flags[0].startswith("--"):
        argv[0], flags = flags[0], flags[1:]
    for i in range(0, len(flags) - 1, 2):
        if flags[i] in argv[1:]:
            argv[argv.index(flags[i], 1) + 1] = flags[i + 1]
        else:
            argv += flags[i:i + 2]
    return argv + (flags[-1:] if len(flags) % 2 else [])


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_exits_64_with_one_line(flags, message, capsys):
    assert submit.main(replaced(flags)) == 64
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("submit.py: error: "), err
    assert message in err


MORE_BAD_FLAGS = [
    # (flags added to GOOD as they are, what the one line must say)
    (["--env", "A=1", "--env", "A=2"], "--env A is given twice; give it once"),
    (["-o", "xml"], "argument -o: invalid choice: 'xml'"),
    (["-o", "json", "--apply"], "-o formats the printed stream; --apply and --check print none"),
    (["--check", "-o", "yaml"], "-o formats the printed stream"),
]


@pytest.mark.parametrize("flags, message", MORE_BAD_FLAGS, ids=[" ".join(f) for f, _ in MORE_BAD_FLAGS])
def test_a_bad_combination_exits_64_with_one_line(flags, message, capsys):
    assert submit.main([*GOOD, *flags]) == 64
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err, err


def test_a_missing_flag_names_it():
    with pytest.raises(submit.BadInput, match="required: --output; see submit.py --help"):
        submit.parse_args(GOOD[:-2])


def test_printing_is_the_default_and_apply_must_be_asked_for():
    # A store_false --dry-run first in the group made "apply" the default: caught by this test.
    assert args().apply is False and args("--dry-run").apply is False and args("--apply").apply is True


def test_the_default_job_is_job_yaml_itself():
    values = ["gpt-train", "--image", JOB_POD["containers"][0]["image"], "--code", JOB_ENV["S3_CODE_URI"],
              "--data", JOB_ENV["S3_DATA_URI"], "--output", JOB_ENV["S3_OUTPUT_URI"]]
    assert submit.render(submit.parse_args(values)) == [submit.network_policy("gpt-train"), JOB]
    explicit = submit.parse_args([*values, "--engine", "job", "--nodes", "1", "--gpus-per-node", "4"])
    assert submit.render(explicit) == [submit.network_policy("gpt-train"), JOB]


def test_the_job_differs_from_job_yaml_only_where_the_flags_say():
    [_, job] = submit.render(args("--gpus-per-node", "8", "--train-config", "config/big.yaml", "--train-script", "ft.py"))
    pod = ".spec.template.spec.containers.trainer"
    assert differences(job, JOB) == {
        ".metadata.name", ".metadata.labels.app.kubernetes.io/name", ".spec.template.metadata.labels.app.kubernetes.io/name",
        f"{pod}.image", f"{pod}.env.S3_CODE_URI.value", f"{pod}.env.S3_DATA_URI.value", f"{pod}.env.S3_OUTPUT_URI.value",
        f"{pod}.env.TRAIN_CONFIG", f"{pod}.env.TRAIN_SCRIPT", f"{pod}.resources.requests.nvidia.com/gpu",
        f"{pod}.resources.limits.nvidia.com/gpu"}
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TRAIN_SCRIPT"] == "ft.py" and env["S3_OUTPUT_URI"] == "s3://bkt/gpt/runs/a/"


def workload(engine: str, nodes: int = 3, *flags: str) -> tuple[list[dict], dict, dict]:
    """(documents, the workload's pod template, what replaces job.yaml's Job spec)."""
    docs = submit.render(args("--engine", engine, "--nodes", str(nodes), *flags))
    work = docs[-1]
    if engine in ("job", "indexed"):
        return docs, work["spec"]["template"], work["spec"]
    if engine == "jobset":
        child = work["spec"]["replicatedJobs"][0]["template"]["spec"]
        return docs, child["template"], child
    if engine == "trainjob":  # the pods are those of the JobSet the Trainer makes of the TrainJob and its runtime
        child = local_job.trainer_jobset(work, docs[-2])["spec"]["replicatedJobs"][0]["template"]["spec"]
        return docs, child["template"], child
    return docs, work["spec"]["pytorchReplicaSpecs"]["Master"]["template"], work["spec"]


GROUP_ENV = {"NNODES": "3", "NPROC_PER_NODE": "4"}
ENGINES = [
    # engine, kinds, RDZV_ENDPOINT, container name, subdomain
    ("indexed", ["Secret", "NetworkPolicy", "Service", "Job"], "run-a-0.run-a:29400", "trainer", "run-a"),
    ("jobset", ["Secret", "NetworkPolicy", "JobSet"], "run-a-node-0-0.run-a:29400", "trainer", None),
    ("pytorchjob", ["Secret", "NetworkPolicy", "PyTorchJob"], None, "pytorch", None),
    ("trainjob", ["Secret", "NetworkPolicy", "ClusterTrainingRuntime", "TrainJob"], "run-a-node-0-0.run-a:29400",
     "node", None),
]
PET_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


@pytest.mark.parametrize("engine, kinds, endpoint, container, subdomain", ENGINES, ids=[e[0] for e in ENGINES])
def test_each_engine_changes_only_what_it_needs_in_job_yamls_pod(engine, kinds, endpoint, container, subdomain):
    docs, template, _ = workload(engine)
    assert [d["kind"] for d in docs] == kinds
    pod = template["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert {k: env.get(k) for k in (*GROUP_ENV, "RDZV_ENDPOINT")} == {**GROUP_ENV, "RDZV_ENDPOINT": endpoint}
    assert pod["containers"][0]["name"] == container and pod.get("subdomain") == subdomain
    normalized = copy.deepcopy(template)
    normalized["spec"]["containers"][0]["name"] = "trainer"
    if engine in ("pytorchjob", "trainjob"):
        del normalized["spec"]["containers"][0]["ports"]
    c = ".spec.containers.trainer"
    expected = {".metadata.labels.app.kubernetes.io/name", f"{c}.image", f"{c}.env.S3_CODE_URI.value",
                f"{c}.env.S3_DATA_URI.value", f"{c}.env.S3_OUTPUT_URI.value", f"{c}.env.NNODES", f"{c}.env.NPROC_PER_NODE",
                f"{c}.env.GROUP_SECRET"}
    expected |= ({f"{c}.env.RDZV_ENDPOINT"} if endpoint else set()) | ({".spec.subdomain"} if subdomain else set())
    expected |= {f"{c}.env.{name}" for name in PET_ENV} if engine == "trainjob" else set()
    assert differences(normalized, JOB["spec"]["template"]) == expected


def test_indexed_job_runs_the_group_as_one_job_with_a_headless_service():
    [_, _, service, job], _, spec = workload("indexed")
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["backoffLimit"] == JOB["spec"]["backoffLimit"] and spec["podReplacementPolicy"] == "Failed"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[:2] == JOB["spec"]["podFailurePolicy"]["rules"], "preemption ignored, 64 fails the Job, as job.yaml"
    assert rules[2] == {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [138]}}
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["name"] == job["spec"]["template"]["spec"]["subdomain"] == "run-a"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    outside_pod = differences({**spec, "template": None}, {**JOB["spec"], "template": None})
    assert outside_pod == {".completionMode", ".completions", ".parallelism", ".podFailurePolicy.rules"}


def test_jobset_fails_the_child_job_on_any_failure_and_decides_by_its_message():
    [_, _, jobset], _, child = workload("jobset")
    spec = jobset["spec"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert (child["completionMode"], child["completions"], child["parallelism"], child["backoffLimit"]) == ("Indexed", 3, 3, 0)
    assert child["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [64]}}]
    policy = spec["failurePolicy"]
    assert policy["maxRestarts"] == JOB["spec"]["backoffLimit"]
    # The Job controller's messages (pkg/controller/job/pod_failure_policy.go) must match the patterns.
    bad = "Container trainer for pod ns/run-a-node-0-1-x7k2p failed with exit code 64 matching FailJob rule at index 1"
    preempted = "Pod ns/run-a-node-0-0-abcde has condition DisruptionTarget matching FailJob rule at index 0"
    crashed = "Job has reached the specified backoff limit"
    decide = [next((r["action"] for r in policy["rules"] if any(re.search(p, m) for p in r["onJobFailureMessagePatterns"])),
                   "RestartJobSet") for m in (bad, preempted, crashed)]
    assert decide == ["FailJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJobSet"]
    assert spec["ttlSecondsAfterFinished"] == JOB["spec"]["ttlSecondsAfterFinished"] and "ttlSecondsAfterFinished" not in child
    outside_pod = differences({**child, "template": None}, {**JOB["spec"], "template": None})
    assert outside_pod == {".completionMode", ".completions", ".parallelism", ".backoffLimit", ".podFailurePolicy.rules",
                           ".ttlSecondsAfterFinished"}


@pytest.mark.parametrize("nodes, workers", [(1, None), (2, 1), (8, 7)])
def test_pytorchjob_has_one_master_and_the_rest_workers(nodes, workers):
    [_, _, job], template, spec = workload("pytorchjob", nodes)
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and (replicas.get("Worker") or {}).get("replicas") == workers
    assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}
    assert spec["nprocPerNode"] == "4" and "backoffLimit" not in spec["runPolicy"], "ExitCode restarts are not counted"
    assert spec["runPolicy"]["ttlSecondsAfterFinished"] == JOB["spec"]["ttlSecondsAfterFinished"]
    assert template["spec"]["containers"][0]["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}]
    if workers:
        assert replicas["Worker"]["template"] == template, "every pod of the group is the same pod"


@pytest.mark.parametrize("engine", ["job", "indexed", "jobset", "pytorchjob", "trainjob"])
def test_a_change_to_job_yaml_reaches_every_engine(engine):
    job = copy.deepcopy(JOB)
    job["spec"]["template"]["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    job["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "NEW_SETTING", "value": "1"})
    nodes = "1" if engine == "job" else "2"
    docs = submit.render(submit.parse_args([*GOOD, "--engine", engine, "--nodes", nodes]), job)
    text = yaml.safe_dump_all(docs)
    assert "NoSchedule" in text and "NEW_SETTING" in text


def test_gpus_per_node_sets_requests_limits_and_processes():
    _, template, spec = workload("pytorchjob", 2)
    assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    docs = submit.render(args("--engine", "indexed", "--nodes", "2", "--gpus-per-node", "8"))
    container = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "NPROC_PER_NODE", "value": "8"} in container["env"]


def test_an_unreadable_job_yaml_is_bad_input(tmp_path):
    (tmp_path / "job.yaml").write_text("kind: Job\nspec: [not, a, job]\n")
    with pytest.raises(submit.BadInput, match="is not a readable Job manifest .* restore it from git"):
        submit.load_job(tmp_path / "job.yaml")


# -- the group's door: a Secret per run, a NetworkPolicy, literal env values ---------------------------

@pytest.mark.parametrize("engine", ["indexed", "jobset", "pytorchjob", "trainjob"])
def test_every_pod_of_a_group_takes_its_key_from_the_runs_own_secret(engine):
    docs, template, _ = workload(engine, 2)
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "run-a-group" and secret["type"] == "Opaque"
    key = base64.b64decode(secret["data"]["GROUP_SECRET"])
    assert len(key) >= 32 and re.fullmatch(rb"[0-9a-f]+", key)
    env = template["spec"]["containers"][0]["env"]
    assert {"name": "GROUP_SECRET", "valueFrom": {"secretKeyRef": {"name": "run-a-group", "key": "GROUP_SECRET"}}} in env
    again = [d for d in workload(engine, 2)[0] if d["kind"] == "Secret"][0]
    assert again["data"] != secret["data"], "a new key each render, never a fixed one"


def test_one_pod_needs_no_group_secret():
    docs = submit.render(args())
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "Job"]
    assert "GROUP_SECRET" not in yaml.safe_dump_all(docs)


@pytest.mark.parametrize("engine", ["job", "indexed", "jobset", "pytorchjob", "trainjob"])
def test_the_network_policy_admits_the_runs_pods_only_the_runs_pods(engine):
    docs, template, _ = workload(engine, 1 if engine == "job" else 2)
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = template["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "run-a"} and selector.items() <= labels.items(), "it covers the pods"
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress (S3, the package index) is left alone"
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}], \
        "every port (answer server, rendezvous store, collectives) from the run's pods, nothing from elsewhere"
    assert docs.index(policy) < len(docs) - 1, "before the workload: no pod is ever open"


def test_a_dollar_in_a_flags_value_reaches_the_pod_literally():
    # Kubernetes expands $(VAR) in env values: unescaped, this output URI would carry the secret key,
    # which the pod then prints in its first line.
    output = "s3://bkt/gpt/runs/$(AWS_SECRET_ACCESS_KEY)/"
    rendered = yaml.safe_load_all(submit.to_yaml(submit.render(submit.parse_args(
        [*GOOD[:-2], "--output", output, "--config", "config/$x.yaml", "--engine", "indexed", "--nodes", "2"]))))
    [job] = [d for d in rendered if d["kind"] == "Job"]
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["S3_OUTPUT_URI"] == "s3://bkt/gpt/runs/$$(AWS_SECRET_ACCESS_KEY)/"
    assert env["TRAIN_CONFIG"] == "config/$$x.yaml"
    defined = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI", "x": "y"}  # what envFrom: aws-credentials defines first
    assert local_pod.expand(env["S3_OUTPUT_URI"], defined) == output
    assert local_pod.expand(env["TRAIN_CONFIG"], defined) == "config/$x.yaml"
    assert env["NNODES"] == "2" and env["S3_CODE_URI"] == "s3://bkt/gpt/code/", "values without '$' unchanged"


# -- kubectl habits: --env, --train-args, --model, --config, --namespace, -o ---------------------------

ALL_ENGINES = ["job", "indexed", "jobset", "pytorchjob", "trainjob"]


def pod_env(engine: str, *flags: str) -> dict:
    docs, template, _ = workload(engine, 1 if engine == "job" else 2, *flags)
    return {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_the_settings_flags_reach_every_engines_pod_literally(engine):
    env = pod_env(engine, "--model", "s3://bkt/models/gpt2/", "--config", "config/ft.yaml",
                  "--train-args", "--set 'run.name=a b' --lr $LR", "--env", "SYNC_INTERVAL_SECONDS=30",
                  "--env", "MY_TOKEN_FILE=/var/$(x)", "--env", "EMPTY=")
    assert env["S3_MODEL_URI"] == "s3://bkt/models/gpt2/" and env["TRAIN_CONFIG"] == "config/ft.yaml"
    assert env["TRAIN_ARGS"] == "--set 'run.name=a b' --lr $$LR", "a '$' is Kubernetes' escape '$$'"
    assert env["SYNC_INTERVAL_SECONDS"] == "30", "--env replaces job.yaml's value"
    assert env["MY_TOKEN_FILE"] == "/var/$$(x)" and env["EMPTY"] == ""
    assert local_pod.expand(env["MY_TOKEN_FILE"], {"x": "secret"}) == "/var/$(x)"


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_without_the_new_flags_the_pod_has_none_of_their_settings(engine):
    env = pod_env(engine)
    assert not {"S3_MODEL_URI", "TRAIN_ARGS", "TRAIN_CONFIG", "TRAIN_SCRIPT"} & env.keys(), "the pod's defaults hold"
    assert env["SYNC_INTERVAL_SECONDS"] == "60"


def test_train_config_is_still_taken_for_config():
    assert args("--train-config", "config/a.yaml").train_config == args("--config", "config/a.yaml").train_config


def test_an_env_name_a_typo_away_from_a_setting_is_warned_about(capsys):
    env = submit.env_flags(["TRAIN_ARG=--lr 1", "SYNC_INTERVAL_SECOND=5", "MY_OWN=1"])
    assert env == {"TRAIN_ARG": "--lr 1", "SYNC_INTERVAL_SECOND": "5", "MY_OWN": "1"}
    err = capsys.readouterr().err.splitlines()
    assert err == ["submit.py: warning: --env SYNC_INTERVAL_SECOND is not a setting of the pod, so it is ignored; "
                   "did you mean SYNC_INTERVAL_SECONDS?",
                   "submit.py: warning: --env TRAIN_ARG is not a setting of the pod, so it is ignored; "
                   "did you mean TRAIN_ARGS?"]


@pytest.mark.parametrize("name", ["CHECKPOINT_HMAC_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"])
def test_a_secret_given_with_env_is_refused_and_never_shown(name):
    with pytest.raises(submit.BadInput) as refused:
        submit.env_flags([f"{name}=s3cr3t-value"])
    assert f"--env {name}: a secret does not belong" in str(refused.value) and "aws-credentials Secret" in str(refused.value)
    assert "s3cr3t-value" not in str(refused.value)


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_namespace_places_every_namespaced_object_and_only_those(engine):
    nodes = "1" if engine == "job" else "2"
    docs = submit.render(args("--engine", engine, "--nodes", nodes, "-n", "team-a"))
    placed = {d["kind"]: d["metadata"].get("namespace") for d in docs}
    assert placed == {kind: None if kind == "ClusterTrainingRuntime" else "team-a" for kind in placed}
    assert all("namespace" not in d["metadata"] for d in submit.render(args("--engine", engine, "--nodes", nodes))), \
        "without -n: kubectl's context decides"


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_every_workload_mounts_the_runs_own_configmap(engine):
    run = args("--engine", engine, "--nodes", "1" if engine == "job" else "2")
    run.script = "run-a-script-0123456789"
    docs = submit.render(run)
    workload = docs[-1]
    assert set(submit.script_names(workload, "run-a")) == {"run-a-script-0123456789"}
    if engine == "trainjob":
        [volume] = workload["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
            "template"]["spec"]["template"]["spec"]["volumes"]
        assert volume == {"name": "job", "configMap": {"name": "run-a-script-0123456789", "defaultMode": 0o555}}
        assert submit.script_names(docs[-2], "run-a") == [submit.CONFIGMAP], "the shared runtime names no run's map"
        pod = local_job.trainer_jobset(workload, docs[-2])["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        assert submit.script_names(pod, "run-a") == ["run-a-script-0123456789"], "the TrainJob's patch wins"


def test_json_is_one_v1_list_of_the_same_documents(monkeypatch, capsys):
    monkeypatch.setattr(submit, "render_configmap", lambda run: {"apiVersion": "v1", "kind": "ConfigMap",
                                                                 "metadata": {"name": f"{run}-script-x"}, "data": {}})
    monkeypatch.setattr(submit, "group_secret", lambda run: {"apiVersion": "v1", "kind": "Secret",
                                                             "metadata": {"name": f"{run}-group"}, "data": {}})
    assert submit.main([*GOOD, "--engine", "jobset", "--nodes", "2", "-o", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert submit.main([*GOOD, "--engine", "jobset", "--nodes", "2"]) == 0
    assert listed == {"apiVersion": "v1", "kind": "List", "items": list(yaml.safe_load_all(capsys.readouterr().out))}
    assert [d["kind"] for d in listed["items"]] == ["ConfigMap", "Secret", "NetworkPolicy", "JobSet"]
