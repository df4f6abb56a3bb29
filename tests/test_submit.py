"""What scripts/submit.py prints, against what a cluster would check, as far as that exists here:

- Job, Service, ConfigMap (and the JobSet's child Job, the PyTorchJob's pod templates, wrapped as a
  batch/v1 Job and a v1 PodTemplate): `kubernetes-validate --strict`, every bundled version >= 1.29.
- JobSet: the CRD's openAPIV3Schema (tests/schemas/, JobSet v0.10.0 and v0.12.0) with jsonschema,
  made strict (additionalProperties: false wherever the schema lists properties). A cluster prunes
  unknown fields of a structural schema silently; here they are errors. CEL rules and the JobSet
  webhook are not run.
- TrainJob and ClusterTrainingRuntime: Kubeflow Trainer v2.3.0's CRD schemas, strict the same way;
  the JobSet the Trainer makes of them (lab/local_job.py's model) against JobSet v0.12.0's, the
  version Trainer v2.3.0 builds on, and its child Job through kubernetes-validate.
- PyTorchJob: the Kubeflow training SDK's models (kubeflow-training): deserialized and serialized
  back; any field that does not survive is unknown to the SDK. And the training operator's CRD
  schema (v1.9.4), made strict the same way.
- The CLI: the ConfigMap is kubectl's own rendering of job/, named after its content and immutable;
  --apply pipes exactly the printed stream to `kubectl apply -f -`, refuses (64) a run that the
  cluster runs with another script, and a failed apply exits 64 (the CRD is missing, a field is
  immutable) or 75 (no cluster).

No root and no S3; apart from kubectl and kubernetes-validate everything runs in this process.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import local_job
import submit as submit_py
from podlab import ROOT, VENV_BIN

SUBMIT = ROOT / "scripts" / "submit.py"
SCHEMAS = ROOT / "tests" / "schemas"
RUN = ["run-a", "--image", "registry/gpt:1", "--code", "s3://bkt/gpt/code/", "--data", "s3://bkt/gpt/data/",
       "--output", "s3://bkt/gpt/runs/a/"]
CASES = {"job": ["--engine", "job"], "indexed": ["--engine", "indexed", "--nodes", "3"],
         "jobset": ["--engine", "jobset", "--nodes", "3"], "pytorchjob": ["--engine", "pytorchjob", "--nodes", "3"],
         "pytorchjob-1": ["--engine", "pytorchjob", "--nodes", "1", "--gpus-per-node", "8"],
         "trainjob": ["--engine", "trainjob", "--nodes", "3"]}
BUILT_IN = {"ConfigMap", "Secret", "NetworkPolicy", "Service", "Job", "PodTemplate"}
SCRIPT_NAME = re.compile(r"run-a-script-[0-9a-f]{10}")


def submit(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", **(env or {})}
    return subprocess.run([sys.executable, str(SUBMIT), *argv], capture_output=True, text=True, env=full, timeout=60)


@pytest.fixture(scope="module")
def streams() -> dict[str, list[dict]]:
    rendered = {}
    for case, flags in CASES.items():
        result = submit(*RUN, *flags)
        assert result.returncode == 0, result.stderr
        rendered[case] = list(yaml.safe_load_all(result.stdout))
    return rendered


def built_in_parts(docs: list[dict]) -> list[dict]:
    """The documents kubernetes-validate knows, and the built-in objects inside custom ones."""
    parts = []
    for doc in docs:
        if doc["kind"] == "JobSet":
            for replicated in doc["spec"]["replicatedJobs"]:
                parts.append({"apiVersion": "batch/v1", "kind": "Job", **replicated["template"],
                              "metadata": {"name": f"{doc['metadata']['name']}-{replicated['name']}-0",
                                           **replicated["template"].get("metadata", {})}})
        elif doc["kind"] == "ClusterTrainingRuntime":
            [replicated] = doc["spec"]["template"]["spec"]["replicatedJobs"]
            parts.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": doc["metadata"]["name"]},
                          "spec": replicated["template"]["spec"]})
        elif doc["kind"] == "TrainJob":  # the pods the Trainer makes of it: its JobSet's child Job
            parts += built_in_parts([trainer_jobset(docs)])
        elif doc["kind"] == "PyTorchJob":
            for rtype, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                parts.append({"apiVersion": "v1", "kind": "PodTemplate",
                              "metadata": {"name": f"{doc['metadata']['name']}-{rtype.lower()}"},
                              "template": replica["template"]})
        else:
            parts.append(doc)
    return parts


def trainer_jobset(docs: list[dict]) -> dict:
    [trainjob] = [d for d in docs if d["kind"] == "TrainJob"]
    [runtime] = [d for d in docs if d["kind"] == "ClusterTrainingRuntime"]
    return local_job.trainer_jobset(trainjob, runtime)


def test_every_engine_renders_its_kinds(streams):
    kinds = {case: [d["kind"] for d in docs] for case, docs in streams.items()}
    door = ["Secret", "NetworkPolicy"]  # the group's key, and who may reach its pods
    assert kinds == {"job": ["ConfigMap", "NetworkPolicy", "Job"], "indexed": ["ConfigMap", *door, "Service", "Job"],
                     "jobset": ["ConfigMap", *door, "JobSet"], "pytorchjob": ["ConfigMap", *door, "PyTorchJob"],
                     "pytorchjob-1": ["ConfigMap", *door, "PyTorchJob"],
                     "trainjob": ["ConfigMap", *door, "ClusterTrainingRuntime", "TrainJob"]}
    assert all(d["kind"] in BUILT_IN for docs in streams.values() for d in built_in_parts(docs))


def kubernetes_versions() -> list[str]:
    from test_job_files import VERSIONS

    return VERSIONS


@pytest.mark.parametrize("version", kubernetes_versions())
def test_built_in_objects_pass_kubernetes_validate_strict(version, streams, tmp_path):
    files = []
    for case, docs in streams.items():
        for i, part in enumerate(built_in_parts(docs)):
            files.append(tmp_path / f"{case}-{i}-{part['kind']}.yaml")
            files[-1].write_text(yaml.safe_dump(part))
    result = subprocess.run([str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", version, *map(str, files)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in result.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == len(files) == 26, result.stdout + result.stderr


def test_kubernetes_validate_strict_would_catch_a_misplaced_field(streams, tmp_path):
    job = copy.deepcopy(streams["indexed"][-1])
    job["spec"]["template"]["spec"]["containers"][0]["podFailurePolicy"] = {"rules": []}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = subprocess.run([str(VENV_BIN / "kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True)
    assert result.returncode != 0 and "podFailurePolicy" in result.stdout + result.stderr


# -- JobSet: its CRD's schema ------------------------------------------------------------------------

def strict(schema):
    """The CRD's schema with every listed-properties object closed, as a pruning API server is not."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        closed.setdefault("additionalProperties", False)
    return closed


JOBSET_SCHEMAS = sorted(SCHEMAS.glob("jobset-*.json"))
PYTORCHJOB_SCHEMAS = sorted(SCHEMAS.glob("pytorchjob-*.json"))
TRAINJOB_SCHEMA = SCHEMAS / "trainjob-v2.3.0.json"
RUNTIME_SCHEMA = SCHEMAS / "clustertrainingruntime-v2.3.0.json"
TRAINER_JOBSET_SCHEMA = SCHEMAS / "jobset-v0.12.0.json"  # the JobSet Trainer v2.3.0 builds on (its go.mod)


def schema_errors(doc: dict, schema_file: Path) -> list[str]:
    import jsonschema

    vendored = json.loads(schema_file.read_text())
    validator = jsonschema.Draft7Validator(strict(vendored["openAPIV3Schema"]))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_the_vendored_crd_schemas_name_their_source():
    assert [p.name for p in JOBSET_SCHEMAS] == ["jobset-v0.10.0.json", "jobset-v0.12.0.json"]
    assert [p.name for p in PYTORCHJOB_SCHEMAS] == ["pytorchjob-v1.9.4.json"]
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(
        p.name for p in [*JOBSET_SCHEMAS, *PYTORCHJOB_SCHEMAS, TRAINJOB_SCHEMA, RUNTIME_SCHEMA])
    for path in SCHEMAS.glob("*.json"):
        vendored = json.loads(path.read_text())
        assert len(vendored["commit"]) == 40 and vendored["commit"] in vendored["source"]
        assert vendored["tag"] in path.name
    for path in JOBSET_SCHEMAS:
        assert "onJobFailureMessagePatterns" in path.read_text(), "the rules need JobSet >= v0.10.0"


@pytest.mark.parametrize("schema_file", JOBSET_SCHEMAS, ids=lambda p: p.stem)
def test_jobset_passes_its_crd_schema_strictly(schema_file, streams):
    [jobset] = [d for d in streams["jobset"] if d["kind"] == "JobSet"]
    assert schema_errors(jobset, schema_file) == []


@pytest.mark.parametrize("case", ["pytorchjob", "pytorchjob-1"])
def test_pytorchjob_passes_its_crd_schema_strictly(case, streams):
    [job] = [d for d in streams[case] if d["kind"] == "PyTorchJob"]
    for schema_file in PYTORCHJOB_SCHEMAS:
        assert schema_errors(job, schema_file) == []


# -- TrainJob: Kubeflow Trainer v2.3.0's CRDs, and the JobSet the Trainer makes ------------------------

def test_trainjob_and_its_runtime_pass_the_trainer_crd_schemas_strictly(streams):
    [runtime] = [d for d in streams["trainjob"] if d["kind"] == "ClusterTrainingRuntime"]
    [trainjob] = [d for d in streams["trainjob"] if d["kind"] == "TrainJob"]
    assert schema_errors(runtime, RUNTIME_SCHEMA) == []
    assert schema_errors(trainjob, TRAINJOB_SCHEMA) == []


def test_the_jobset_the_trainer_makes_passes_jobset_v0_12_strictly(streams):
    jobset = trainer_jobset(streams["trainjob"])
    assert schema_errors(jobset, TRAINER_JOBSET_SCHEMA) == []
    assert jobset["spec"]["failurePolicy"] == next(d for d in streams["jobset"] if d["kind"] == "JobSet")["spec"][
        "failurePolicy"], "the same failure rules as --engine jobset"


BROKEN_TRAINJOBS = [
    # (which document, change, what the error names)
    ("TrainJob", lambda d: d["spec"]["trainer"].update(numNode=2), "'numNode' was unexpected"),
    ("TrainJob", lambda d: d["spec"]["trainer"].update(numProcPerNode="4"), "'4' is not of type 'integer'"),
    ("TrainJob", lambda d: d["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
     ["template"]["spec"].update(backoffLimit=3), "'backoffLimit' was unexpected"),  # not a field a patch may set
    ("TrainJob", lambda d: d["spec"].update(podTemplateOverrides=[]), "'podTemplateOverrides' was unexpected"),
    ("ClusterTrainingRuntime", lambda d: d["spec"]["mlPolicy"].update(torch={"numProcPerNode": 4}),
     "'numProcPerNode' was unexpected"),
    ("ClusterTrainingRuntime", lambda d: d["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
     ["template"]["spec"]["containers"][0].update(gpus=4), "'gpus' was unexpected"),
]


@pytest.mark.parametrize("kind, change, message", BROKEN_TRAINJOBS, ids=[m for _, _, m in BROKEN_TRAINJOBS])
def test_the_strict_trainer_check_rejects(kind, change, message, streams):
    [doc] = [copy.deepcopy(d) for d in streams["trainjob"] if d["kind"] == kind]
    change(doc)
    errors = schema_errors(doc, TRAINJOB_SCHEMA if kind == "TrainJob" else RUNTIME_SCHEMA)
    assert any(message in e for e in errors), errors


BROKEN_JOBSETS = [
    # (where, change, what the error names)
    ("an unknown field deep in the pod", lambda s: s["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
     ["containers"][0].update(gpus=4), "'gpus' was unexpected"),
    ("a misspelt rule field", lambda s: s["failurePolicy"]["rules"][0].update(onJobFailureMessages=["x"]),
     "'onJobFailureMessages' was unexpected"),
    ("an action JobSet does not have", lambda s: s["failurePolicy"]["rules"][1].update(action="Restart"),
     "'Restart' is not one of"),
    ("a rule without a name", lambda s: s["failurePolicy"]["rules"][0].pop("name"), "'name' is a required property"),
]


@pytest.mark.parametrize("where, change, message", BROKEN_JOBSETS, ids=[b[0] for b in BROKEN_JOBSETS])
def test_the_strict_jobset_check_rejects(where, change, message, streams):
    jobset = copy.deepcopy(streams["jobset"][-1])
    change(jobset["spec"])
    for schema_file in JOBSET_SCHEMAS:
        errors = schema_errors(jobset, schema_file)
        assert any(message in e for e in errors), errors


# -- PyTorchJob: the Kubeflow training SDK's models -------------------------------------------------

def lost_in_sdk(doc: dict) -> list[str]:
    """Paths of what KubeflowOrgV1PyTorchJob does not carry back: unknown, misplaced or mistyped."""
    from kubeflow.training.api_client import ApiClient

    class Response:
        data = json.dumps(doc)

    client = ApiClient()
    back = client.sanitize_for_serialization(client.deserialize(Response(), "KubeflowOrgV1PyTorchJob"))
    return differences(doc, back)


def differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(a.keys() | b.keys()) for d in differences(a.get(key), b.get(key), f"{path}.{key}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


@pytest.mark.parametrize("case", ["pytorchjob", "pytorchjob-1"])
def test_pytorchjob_survives_the_kubeflow_sdk_whole(case, streams):
    [job] = [d for d in streams[case] if d["kind"] == "PyTorchJob"]
    assert lost_in_sdk(job) == []


def test_the_pytorchjob_checks_report_unknown_and_mistyped_fields(streams):
    job = copy.deepcopy(streams["pytorchjob"][-1])
    job["spec"]["runPolicy"]["backofLimit"] = 3
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "2"
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["gpus"] = 4
    assert lost_in_sdk(job) == [".spec.pytorchReplicaSpecs.Master.template.spec.containers[0].gpus",
                                ".spec.pytorchReplicaSpecs.Worker.replicas", ".spec.runPolicy.backofLimit"]
    errors = schema_errors(job, PYTORCHJOB_SCHEMAS[0])
    for message in ("'gpus' was unexpected", "'2' is not of type 'integer'", "'backofLimit' was unexpected"):
        assert any(message in e for e in errors), errors
    del job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="`name`, must not be `None`"):
        lost_in_sdk(job)


# -- the command ----------------------------------------------------------------------------------

def kubectl_configmap(job_dir: Path) -> dict:
    result = subprocess.run([str(VENV_BIN / "kubectl"), "create", "configmap", "script-configmap",
                             f"--from-file={job_dir}", "--dry-run=client", "-o", "yaml"],
                            capture_output=True, text=True, check=True)
    return yaml.safe_load(result.stdout)


def test_the_configmap_is_kubectls_rendering_of_job_named_after_its_content(streams):
    expected = kubectl_configmap(ROOT / "job")
    assert expected["data"]["script.sh"] == (ROOT / "job" / "script.sh").read_text()
    names = set()
    for docs in streams.values():
        configmap = docs[0]
        assert configmap["data"] == expected["data"] and configmap["immutable"] is True
        assert SCRIPT_NAME.fullmatch(configmap["metadata"]["name"]), configmap["metadata"]
        assert configmap["metadata"]["labels"] == {"app.kubernetes.io/name": "run-a", "app.kubernetes.io/component": "script"}
        names.add(configmap["metadata"]["name"])
        assert set(submit_py.script_names(docs[-1], "run-a")) == names, "the workload mounts this one"
    assert len(names) == 1, "the same job/ is the same ConfigMap, whatever the engine"


def test_a_changed_job_folder_is_a_new_configmap_and_the_same_one_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{VENV_BIN}:{os.environ['PATH']}")
    submit = submit_py
    copied = tmp_path / "job"
    shutil.copytree(ROOT / "job", copied)
    same = submit.render_configmap("run-a", copied)["metadata"]["name"]
    assert same == submit.render_configmap("run-a", ROOT / "job")["metadata"]["name"]
    (copied / "script.sh").write_text((copied / "script.sh").read_text() + "\n# changed\n")
    changed = submit.render_configmap("run-a", copied)["metadata"]["name"]
    assert changed != same and SCRIPT_NAME.fullmatch(changed)
    assert submit.render_configmap("run-b", ROOT / "job")["metadata"]["name"] == "run-b" + same[len("run-a"):], \
        "another run's map has another name: two runs never share one"


def fake_kubectl(tmp_path: Path, apply_says: str = "", apply_exit: int = 0) -> tuple[dict, Path]:
    """A kubectl whose `apply` records its stdin (there is no cluster here); the rest is the real one."""
    bin_dir, record = tmp_path / "bin", tmp_path / "applied.yaml"
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = apply ]; then cat > '{record}'; echo \"$*\" > '{record}.args'; "
                      f"printf '%s\\n' '{apply_says}' >&2; "
                      f"exit {apply_exit}; fi\nexec '{VENV_BIN / 'kubectl'}' \"$@\"\n")
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{VENV_BIN}:/usr/bin:/bin"}, record


def without_the_key(stream: str) -> list[dict]:
    docs = list(yaml.safe_load_all(stream))
    for doc in docs:
        if doc["kind"] == "Secret":
            doc["data"] = {key: "(a new key each render)" for key in doc["data"]}
    return docs


def test_apply_pipes_exactly_the_printed_stream(tmp_path):
    env, record = fake_kubectl(tmp_path)
    printed = submit(*RUN, *CASES["jobset"], env=env)
    applied = submit(*RUN, *CASES["jobset"], "--apply", env=env)
    assert printed.returncode == applied.returncode == 0, printed.stderr + applied.stderr
    assert without_the_key(record.read_text()) == without_the_key(printed.stdout) and "kind: JobSet" in printed.stdout
    # server-side: a client-side apply would copy the ConfigMap into an annotation, over its 256 KiB
    assert Path(f"{record}.args").read_text().split() == ["apply", "--server-side", "-f", "-"]
    assert "kind: Secret" in record.read_text(), "no cluster to ask: the new key goes up"


def test_apply_keeps_the_groups_secret_the_cluster_has(tmp_path):
    # A second apply while the run's pods run must not change their key: a replaced pod would ask
    # node 0 with another one and be refused.
    env, record = fake_kubectl(tmp_path)
    script = tmp_path / "bin" / "kubectl"
    script.write_text(script.read_text().replace(
        "\nexec", '\nif [ "$1 $2 $3" = "get secret run-a-group" ]; then echo secret/run-a-group; exit 0; fi\nexec'))
    applied = submit(*RUN, *CASES["indexed"], "--apply", env=env)
    assert applied.returncode == 0, applied.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(record.read_text())]
    assert kinds == ["ConfigMap", "NetworkPolicy", "Service", "Job"]
    assert "keeping the cluster's Secret run-a-group" in applied.stderr


def test_apply_without_the_engines_crd_is_bad_input(tmp_path):
    env, _ = fake_kubectl(tmp_path, 'error: resource mapping not found for name: "run-a" namespace: "" from "STDIN": '
                                    'no matches for kind "JobSet" in version "jobset.x-k8s.io/v1alpha2"', 1)
    result = submit(*RUN, *CASES["jobset"], "--apply", env=env)
    assert result.returncode == 64
    assert len(result.stderr.splitlines()) == 1 and "install its controller or pick another --engine" in result.stderr


def test_apply_without_a_reachable_cluster_exits_75(tmp_path):
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "not-a-secret"}}]}))
    result = submit(*RUN, "--apply", env={"KUBECONFIG": str(config)})
    assert result.returncode == 75, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "check the cluster access and run again" in result.stderr


def kubectl_answering(tmp_path: Path, get_line: str, answer: dict, apply_says: str = "", apply_exit: int = 0):
    """fake_kubectl whose `get` of `get_line` (its first words) prints `answer` as JSON, and which
    records every command it is given."""
    env, record = fake_kubectl(tmp_path, apply_says, apply_exit)
    script, calls = tmp_path / "bin" / "kubectl", tmp_path / "calls"
    (tmp_path / "answer.json").write_text(json.dumps(answer))
    words = len(get_line.split())
    matched = " ".join(f"${i}" for i in range(1, words + 1))
    script.write_text(script.read_text().replace(
        "\nif", f"\necho \"$*\" >> '{calls}'\nif [ \"{matched}\" = \"{get_line}\" ]; then cat '{tmp_path / 'answer.json'}'; "
                "exit 0; fi\nif", 1))
    return env, record, calls


def printed(*flags: str, env: dict) -> list[dict]:
    result = submit(*RUN, *flags, env=env)
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))


def running_with(script: str) -> dict:
    """A JobSet as `kubectl get -o json` shows it, whose pods mount `script`."""
    return {"kind": "JobSet", "spec": {"replicatedJobs": [{"template": {"spec": {"template": {"spec": {
        "volumes": [{"name": "job", "configMap": {"name": script, "defaultMode": 365}}]}}}}}]}}


def test_apply_refuses_a_run_the_cluster_runs_with_another_script(tmp_path):
    env, record, calls = kubectl_answering(tmp_path, "get jobset.jobset.x-k8s.io run-a",
                                           running_with("run-a-script-0123456789"))
    result = submit(*RUN, *CASES["jobset"], "-n", "team", "--apply", env=env)
    assert result.returncode == 64 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "JobSet run-a already runs with the ConfigMap run-a-script-0123456789, and job/ has changed since" in result.stderr
    assert "kubectl delete jobset.jobset.x-k8s.io run-a -n team; the run resumes from S3" in result.stderr
    assert not record.exists(), "nothing applied"
    assert "get jobset.jobset.x-k8s.io run-a -o json --request-timeout=20s --namespace team" in calls.read_text()


def test_apply_goes_on_when_the_cluster_runs_the_same_script(tmp_path):
    ours = printed(*CASES["jobset"], env={})[0]["metadata"]["name"]
    env, record, _ = kubectl_answering(tmp_path, "get jobset.jobset.x-k8s.io run-a", running_with(ours))
    result = submit(*RUN, *CASES["jobset"], "--apply", env=env)
    assert result.returncode == 0, result.stderr
    assert [d["kind"] for d in yaml.safe_load_all(record.read_text())] == ["ConfigMap", "Secret", "NetworkPolicy", "JobSet"]


def test_apply_names_an_immutable_field_as_bad_input(tmp_path):
    env, _ = fake_kubectl(tmp_path, 'The Job "run-a" is invalid: spec.template: Invalid value: "...": field is immutable', 1)
    result = submit(*RUN, *CASES["indexed"], "--apply", env=env)
    assert result.returncode == 64 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "field is immutable; a running workload keeps its spec: delete it first" in result.stderr


def test_apply_names_another_managers_fields_as_bad_input(tmp_path):
    says = ('error: Apply failed with 1 conflict: conflict with "kubectl-edit" using batch/v1: .spec.parallelism\n'
            "Please review the fields above--they currently have other managers.")
    env, _ = fake_kubectl(tmp_path, says, 1)
    result = submit(*RUN, *CASES["indexed"], "--apply", env=env)
    assert result.returncode == 64 and len(result.stderr.splitlines()) == 1, result.stderr
    # not --force-conflicts on a re-render: that would replace the group's Secret under running pods
    assert ('kubectl apply: Apply failed with 1 conflict: conflict with "kubectl-edit" using batch/v1: .spec.parallelism; '
            "another manager (kubectl edit?) changed this run's objects: delete the workload first (the run resumes "
            "from S3) or submit a new run name") in result.stderr


def test_apply_in_a_namespace_asks_for_the_secret_there_and_applies_there(tmp_path):
    env, record, calls = kubectl_answering(tmp_path, "get nothing", {})
    result = submit(*RUN, *CASES["trainjob"], "--namespace", "team", "--apply", env=env)
    assert result.returncode == 0, result.stderr
    applied = list(yaml.safe_load_all(record.read_text()))
    assert {d["kind"]: d["metadata"].get("namespace") for d in applied} == {
        "ConfigMap": "team", "Secret": "team", "NetworkPolicy": "team", "ClusterTrainingRuntime": None, "TrainJob": "team"}
    assert "get secret run-a-group -o name --request-timeout=20s --namespace team" in calls.read_text()
