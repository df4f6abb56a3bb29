"""lab/local_job.py's model of Kubeflow Trainer v2.3: the JobSet its controller makes of a TrainJob and
its ClusterTrainingRuntime (runtimePatches merged, the trainer's image, env, GPUs and node count,
PET_*), what its webhooks refuse, and TrainJobRun reading submit.py's stream. No pods run here."""

from __future__ import annotations

import copy

import pytest
import yaml

import local_job
import local_pod
import submit
from local_job import strategic_merge

RUN = ["r1", "--image", "img:1", "--code", "s3://bkt/c/", "--data", "s3://bkt/d/", "--output", "s3://bkt/o/",
       "--engine", "trainjob"]


def rendered(*flags: str) -> tuple[dict, dict]:
    """(runtime, TrainJob) as submit.py renders them, its pods mounting the ConfigMap r1-script-x."""
    args = submit.parse_args([*RUN, *flags])
    args.script = "r1-script-x"
    *_, runtime, trainjob = submit.render(args)
    return runtime, trainjob


def node_container(jobset: dict) -> dict:
    [replicated] = jobset["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]["template"]["spec"]["containers"][0]


# -- the strategic merge of runtimePatches ----------------------------------------------------------------

def test_maps_merge_key_by_key_and_other_values_are_replaced():
    base = {"a": {"x": 1, "y": 2}, "tolerations": [{"key": "k"}], "n": 1}
    assert strategic_merge(base, {"a": {"y": 3}, "tolerations": [{"key": "j"}], "n": 2}) == {
        "a": {"x": 1, "y": 3}, "tolerations": [{"key": "j"}], "n": 2}, "tolerations are atomic"
    assert base["a"] == {"x": 1, "y": 2}, "the base is not changed"


def test_named_lists_merge_item_by_item_and_new_items_are_appended():
    base = {"containers": [{"name": "node", "image": "a", "env": [{"name": "A", "value": "1"}]},
                           {"name": "side", "image": "s"}]}
    patch = {"containers": [{"name": "node", "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]},
                            {"name": "extra", "image": "e"}]}
    assert strategic_merge(base, patch)["containers"] == [
        {"name": "node", "image": "a", "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]},
        {"name": "side", "image": "s"}, {"name": "extra", "image": "e"}]


def test_a_patched_volume_keeps_only_the_patches_source():
    base = {"volumes": [{"name": "job", "configMap": {"name": "script-configmap", "defaultMode": 365}},
                        {"name": "home", "emptyDir": {}}]}
    merged = strategic_merge(base, {"volumes": [{"name": "job", "persistentVolumeClaim": {"claimName": "c"}}]})
    assert merged["volumes"][0] == {"name": "job", "persistentVolumeClaim": {"claimName": "c"}}, "retainKeys"
    merged = strategic_merge(base, {"volumes": [{"name": "job", "configMap": {"name": "r1-script-x"}}]})
    assert merged["volumes"][0] == {"name": "job", "configMap": {"name": "r1-script-x", "defaultMode": 365}}


# -- the JobSet the Trainer makes ---------------------------------------------------------------------------

def test_the_trainer_jobset_is_the_runtimes_with_the_trainjobs_run_in_it():
    runtime, trainjob = rendered("--nodes", "3", "--gpus-per-node", "2", "-n", "team")
    jobset = local_job.trainer_jobset(trainjob, runtime)
    assert (jobset["metadata"]["name"], jobset["metadata"]["namespace"]) == ("r1", "team")
    assert jobset["metadata"]["labels"] == {"app.kubernetes.io/name": "r1"}, "the patch's JobSet labels"
    [replicated] = jobset["spec"]["replicatedJobs"]
    child = replicated["template"]["spec"]
    assert (replicated["replicas"], child["parallelism"], child["completions"]) == (1, 3, 3), "numNodes"
    assert child["template"]["metadata"]["labels"] == {"app.kubernetes.io/name": "r1"}
    assert child["template"]["spec"]["volumes"][0]["configMap"]["name"] == "r1-script-x"
    container = node_container(jobset)
    assert container["image"] == "img:1"
    assert container["resources"]["limits"] == {"cpu": "16", "memory": "96Gi", "nvidia.com/gpu": "2"}, \
        "resourcesPerNode merged into the runtime's resources"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert {k: env[k] for k in ("S3_OUTPUT_URI", "NNODES", "NPROC_PER_NODE", "RDZV_ENDPOINT")} == {
        "S3_OUTPUT_URI": "s3://bkt/o/", "NNODES": "3", "NPROC_PER_NODE": "2", "RDZV_ENDPOINT": "r1-node-0-0.r1:29400"}
    assert {k: env[k] for k in env if k.startswith("PET_")} == {
        "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}},
        "PET_MASTER_ADDR": "r1-node-0-0.r1", "PET_MASTER_PORT": "29500"}
    assert [e["name"] for e in container["env"]][-5:] == ["PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK",
                                                          "PET_MASTER_ADDR", "PET_MASTER_PORT"], "upserted last"
    assert container["ports"] == [{"containerPort": 29500}]
    assert runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "volumes"][0]["configMap"]["name"] == "script-configmap", "the runtime itself is not changed"


def test_the_trainjob_env_replaces_the_runtimes_in_place():
    runtime, trainjob = rendered("--config", "config/ft.yaml", "--env", "SYNC_INTERVAL_SECONDS=5")
    names = [e["name"] for e in node_container(runtime["spec"]["template"])["env"]]
    env = node_container(local_job.trainer_jobset(trainjob, runtime))["env"]
    assert [e["name"] for e in env][:len(names)] == names, "the runtime's order kept"
    values = {e["name"]: e.get("value") for e in env}
    assert (values["TRAIN_CONFIG"], values["SYNC_INTERVAL_SECONDS"]) == ("config/ft.yaml", "5")


@pytest.mark.parametrize("resources, expected", [
    ({"limits": {"nvidia.com/gpu": "4"}}, "auto"), ({"requests": {"cpu": "6"}}, "6"), ({}, "1")])
def test_proc_per_node_without_num_proc_per_node_is_auto_on_gpus_else_the_cpus(resources, expected):
    [_, per_node, *_] = local_job.pet_env({}, {"resources": resources}, "r1", 2)
    assert per_node == {"name": "PET_NPROC_PER_NODE", "value": expected}


def test_without_num_nodes_the_runtimes_ml_policy_decides():
    runtime, trainjob = rendered("--nodes", "2")
    del trainjob["spec"]["trainer"]["numNodes"]
    runtime["spec"]["mlPolicy"]["numNodes"] = 4
    child = local_job.trainer_jobset(trainjob, runtime)["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert child["parallelism"] == child["completions"] == 4


# -- what the webhooks refuse, what is not modelled ------------------------------------------------------------

REFUSED = [
    ("a PET_ setting in trainer.env", lambda r, t: t["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"}),
     "trainer.env must not set PET_NNODES"),
    ("no container named node", lambda r, t: r["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
     ["template"]["spec"]["containers"][0].update(name="trainer"), "no container named 'node'"),
    ("another mlPolicy", lambda r, t: r["spec"].update(mlPolicy={"mpi": {}}), "only mlPolicy.torch is modelled"),
    ("no trainer label", lambda r, t: r["spec"]["template"]["spec"]["replicatedJobs"][0]["template"].update(metadata={}),
     "labelled trainer.kubeflow.org/trainjob-ancestor-step: trainer"),
    ("a $patch directive", lambda r, t: t["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"].update(
        {"$patch": "replace"}), "$patch directives are not modelled"),
]


@pytest.mark.parametrize("what, change, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_trainjobs(what, change, message):
    runtime, trainjob = rendered("--nodes", "2")
    change(runtime, trainjob)
    with pytest.raises(local_job.BadInput, match=message.replace("$", r"\$")):
        local_job.check_trainjob(trainjob, runtime)


def test_a_trainjob_whose_runtime_is_not_in_the_stream_is_bad_input(tmp_path):
    runtime, trainjob = rendered("--nodes", "2")
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump_all([trainjob]))
    with pytest.raises(local_job.BadInput, match=f"names ClusterTrainingRuntime '{runtime['metadata']['name']}'"):
        local_job.TrainJobRun(path, folder=tmp_path / "pods")


# -- TrainJobRun ------------------------------------------------------------------------------------------------

def test_trainjob_run_reads_the_rendered_stream_as_the_jobset_of_its_pods(tmp_path):
    args = submit.parse_args([*RUN, "--nodes", "2", "--gpus-per-node", "1"])
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump_all(submit.render(args)))
    run = local_job.controller_for(path, folder=tmp_path / "pods")
    assert isinstance(run, local_job.TrainJobRun) and (run.name, run.size) == ("r1", 2)
    child = run.children[0]
    assert child.name == "r1-node-0" and child.hosts[0] == ("r1-node-0-0.r1", "127.0.0.10"), \
        "the RDZV_ENDPOINT submit.py sets resolves to node 0"
    pod = local_pod.load_pod(child.manifest, {}, {"script-configmap": local_job.podlab.ROOT / "job"}, 1,
                             child.ips[1], child.hosts)
    assert pod.hostname == "r1-node-0-1"
    assert (pod.env["PET_NODE_RANK"], pod.env["JOB_COMPLETION_INDEX"], pod.env["NNODES"]) == ("1", "1", "2")
    assert pod.env["GROUP_SECRET"] == submit_secret(path), "from the stream's Secret"


def submit_secret(path) -> str:
    import base64
    secret = next(d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "Secret")
    return base64.b64decode(secret["data"]["GROUP_SECRET"]).decode()


def test_the_trainjobs_condition_is_the_jobsets_renamed(tmp_path):
    args = submit.parse_args([*RUN, "--nodes", "2"])
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump_all(submit.render(args)))
    run = local_job.TrainJobRun(path, folder=tmp_path / "pods")
    run._end("Completed", "AllJobsCompleted")
    assert run.condition == ("Complete", "AllJobsCompleted")
    failed = local_job.TrainJobRun(path, folder=tmp_path / "pods2")
    failed._end("Failed", "ReachedMaxRestarts")
    assert failed.condition == ("Failed", "ReachedMaxRestarts")


def test_the_runtime_is_named_after_its_spec():
    runtime, _ = rendered()
    again, _ = rendered("--nodes", "3", "--gpus-per-node", "8", "-n", "other", "--env", "X=1")
    assert runtime == again, "nothing of a run is in the runtime: every run shares it"
    job = copy.deepcopy(submit.load_job())
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 600
    changed = submit.training_runtime(job)
    assert changed["metadata"]["name"] != runtime["metadata"]["name"], "a new job.yaml is a new runtime"
    assert changed["metadata"]["name"].startswith("resumable-torch-") and len(changed["metadata"]["name"]) == 26
