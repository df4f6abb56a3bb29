#!/usr/bin/env python3
"""Run an Indexed Job's pods side by side, locally, under the Job controller's rules (and a
JobSet's or a PyTorchJob's, under their controllers').

Usage:
    python lab/local_job.py [--env KEY=VALUE]... [--keep-volumes DIR] [--configmap NAME=DIR]... MANIFEST

MANIFEST is a batch/v1 Job with completionMode Indexed and completions = parallelism = N (or a YAML
stream holding one, e.g. `scripts/submit.py RUN ... --engine indexed --nodes N`; a ConfigMap in the
stream fills the configMap volume of that name). Each pod is lab/local_pod.py in a process of its
own: pod i runs with --index i, the address 127.0.0.(10+i), and one --host line per pod j of the
Job for <job>-<j>.<subdomain> and <job>-<j>.<subdomain>.<namespace>.svc.cluster.local (what the
headless Service's DNS answers; with no spec.subdomain no peer name resolves, as in a cluster).

What the Job controller does, and so this:
- a pod that exits 0: its index has succeeded and gets no new pod. The Job is Complete (reason
  CompletionsReached) once every index has succeeded.
- a pod that fails is judged by spec.podFailurePolicy (decide(), first matching rule): onExitCodes
  (In/NotIn, containerName; a container that exits 0 matches no rule) and onPodConditions, where a
  pod deleted through JobPod.delete() or IndexedJob.delete(i) carries DisruptionTarget, as a
  preemption or an eviction through the API does; a pod whose PID 1 gets SIGKILL (lose_node(), a
  lost node) exits 137 with no condition, and so does a kubelet eviction for emptyDir sizeLimit.
    Ignore   a new pod for the index; not counted against backoffLimit
    FailJob  the Job fails (reason PodFailurePolicy): every other pod is deleted
    Count, or no rule: failures + 1; more than backoffLimit (default 6) fails the Job (reason
             BackoffLimitExceeded, others deleted), else a new pod for the index
- podReplacementPolicy Failed: a new pod only once the old one has terminated (its runner exited).
  The replacement waits `replacement_delay` seconds (1 s), not the controller's backoff of 10 s
  doubling per counted failure (up to 6 min).
- spec.activeDeadlineSeconds, counted from start(): every pod is deleted, reason DeadlineExceeded.
- the Job's Failed or Complete condition is set once every pod has terminated (as Kubernetes >= 1.31
  does), so when wait() returns no pod runs.

Not modelled: parallelism < completions, backoffLimitPerIndex and FailIndex, successPolicy,
suspend, podReplacementPolicy TerminatingOrFailed, pod-level scheduling (every pod starts at once),
a replacement's new IP (index i keeps 127.0.0.(10+i); in a cluster the new pod gets a new address
and DNS follows it), ttlSecondsAfterFinished. The pods share the host's network: see local_pod.py.

A JobSet or a PyTorchJob in the stream (`submit.py ... --engine jobset|pytorchjob`) is run by its
own controller, modelled from the sources named at each (JobSet v0.10.1, training-operator v1.9.0):

- JobSet (JobSetRun): its one replicatedJob's child Job <jobset>-<replicatedJob>-0, run as above
  (pods <jobset>-<replicatedJob>-0-<i>, subdomain the JobSet's name as enableDNSHostnames gives
  it, the JobSet's labels and annotations on the pods, jobset.sigs.k8s.io/restart-attempt among
  them). When the child Job fails (its reason and message as the Job controller words them:
  PodFailurePolicy "... failed with exit code 64 matching FailJob rule at index 1" / "... has
  condition DisruptionTarget matching FailJob rule at index 0", or BackoffLimitExceeded), the
  failurePolicy rules are matched in order (onJobFailureReasons, onJobFailureMessagePatterns as
  regular expressions, targetReplicatedJobs); FailJobSet fails the JobSet, RestartJobSet (the
  default) and RestartJobSetAndIgnoreMaxRestarts create the child Job again, restart-attempt + 1,
  the first counted: past maxRestarts the JobSet fails (ReachedMaxRestarts). The JobSet is
  Completed when its child Job is. Not modelled: more replicatedJobs or replicas, successPolicy
  other than All, startupPolicy, coordinator, dependsOn, suspend, ttlSecondsAfterFinished.
- PyTorchJob (PyTorchJobRun): pods <job>-master-0 and <job>-worker-<k> (hostnames; each name
  resolves, as the operator's headless Service per pod makes it), the env the operator appends
  (PYTHONUNBUFFERED, MASTER_ADDR/PORT and PET_MASTER_ADDR/PORT, WORLD_SIZE = pods x nprocPerNode,
  RANK = PET_NODE_RANK, PET_NPROC_PER_NODE, PET_NNODES), restartPolicy ExitCode (a pod exiting
  128 or more is recreated alone, without limit; any other non-zero code fails the job) or Never,
  success when the Master succeeds, cleanPodPolicy (None, the default, leaves the other pods to
  end by themselves). Not modelled: the Worker's init container (nslookup of the Master until it
  resolves) and that the per-pod Service publishes a pod's name only once it is Ready (no
  publishNotReadyAddresses): here every name resolves from the start; OnFailure/Always,
  runPolicy.backoffLimit and activeDeadlineSeconds, elasticPolicy, gang scheduling; the pod's
  metadata.name carries the runner's 5-character suffix (its hostname is exact).

Exit status of the command: 0 when the Job is Complete (a JobSet Completed, a PyTorchJob
Succeeded), 1 when it Failed, 64 for bad input. Needs root, as local_pod.py does. Python API:
IndexedJob, JobSetRun, PyTorchJobRun (see their docstrings); controller_for() picks by the stream.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import ipaddress
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

import local_pod
import podlab
from contract import EXIT_BAD_INPUT  # the exit codes' one definition (podlab puts job/ on the path)

RUNNER = Path(__file__).resolve().parent / "local_pod.py"
FIRST_IP = "127.0.0.10"  # pod i gets FIRST_IP + i
REPLACEMENT_DELAY_SECONDS = 1.0
DEFAULT_BACKOFF_LIMIT = 6
DISRUPTION_TARGET = "DisruptionTarget"
ACTIONS = ("Ignore", "FailJob", "Count")
VERDICTS = ("succeeded", "ignored", "counted", "failjob", "terminated")


class BadInput(local_pod.BadInput):
    """Bad input: the message names the cause and the fix."""


def log(message: str) -> None:
    os.write(2, f"local_job: {message}\n".encode(errors="replace"))


# ---------------------------------------------------------------- the Job controller's rules


@dataclass(frozen=True)
class PodFailure:
    """What the Job controller knows of a pod that ended: its container's exit code, and the
    pod's conditions whose status is True (e.g. DisruptionTarget)."""
    container: str
    exit_code: int
    conditions: frozenset[str] = frozenset()


def rule_matches(rule: dict, failure: PodFailure) -> bool:
    on_exit = rule.get("onExitCodes")
    if on_exit is not None:
        if on_exit.get("containerName") not in (None, failure.container):
            return False
        if failure.exit_code == 0:  # only containers that terminated with a non-zero code count
            return False
        listed = failure.exit_code in (on_exit.get("values") or [])
        return listed if on_exit.get("operator") == "In" else not listed
    return any(pattern.get("type") in failure.conditions and pattern.get("status", "True") == "True"
               for pattern in rule.get("onPodConditions") or [])


def policy_action(rules: list[dict], failure: PodFailure) -> str | None:
    """The action of the first podFailurePolicy rule the failed pod matches; None when none does."""
    return next((rule["action"] for rule in rules if rule_matches(rule, failure)), None)


def decide(rules: list[dict], failure: PodFailure, failures: int, backoff_limit: int) -> tuple[str, str | None]:
    """The Job controller's verdict on a pod that ended, given the failures counted before it:
    (verdict, reason the Job fails on it or None). Verdicts: succeeded, ignored, counted, failjob."""
    if failure.exit_code == 0:
        return "succeeded", None
    action = policy_action(rules, failure)
    if action == "Ignore":
        return "ignored", None
    if action == "FailJob":
        return "failjob", "PodFailurePolicy"
    if failures + 1 > backoff_limit:  # Count, or no rule matched
        return "counted", "BackoffLimitExceeded"
    return "counted", None


def check_policy(spec: dict, template_spec: dict) -> list[dict]:
    policy = spec.get("podFailurePolicy")
    if policy is None:
        return []
    if template_spec.get("restartPolicy") != "Never":
        raise BadInput("podFailurePolicy needs spec.template.spec.restartPolicy: Never; set it")
    rules = policy.get("rules") or []
    for number, rule in enumerate(rules):
        if rule.get("action") not in ACTIONS:
            raise BadInput(f"podFailurePolicy rule {number}: action {rule.get('action')!r} is not supported "
                           f"here ({', '.join(ACTIONS)} are); change the rule")
        on_exit = rule.get("onExitCodes")
        if (on_exit is None) == (rule.get("onPodConditions") is None):
            raise BadInput(f"podFailurePolicy rule {number}: give exactly one of onExitCodes and "
                           "onPodConditions")
        if on_exit is not None and on_exit.get("operator") not in ("In", "NotIn"):
            raise BadInput(f"podFailurePolicy rule {number}: operator {on_exit.get('operator')!r} is not "
                           "In or NotIn; fix the rule")
    return rules


# ---------------------------------------------------------------- the pods


class JobPod(podlab.Pod):
    """A pod of the Job (a podlab.Pod: output, events, wait_for_event, pid1, lose_node, wait),
    with its index and attempt (1 for the index's first pod), and the DisruptionTarget condition
    that delete() sets before the deletion, as a preemption does."""

    def __init__(self, command: list[str], pidfile: Path, env: dict, index: int, attempt: int,
                 echo: bool = False):
        self.index, self.attempt, self.echo = index, attempt, echo
        self.conditions: set[str] = set()
        super().__init__(command, pidfile, env)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)
            if self.echo and not line.startswith(podlab.contract.EVENT_PREFIX):  # for people, as kubectl logs
                sys.stdout.write(f"[{self.index}.{self.attempt}] {line}")
                sys.stdout.flush()
        self._new.put(None)

    def delete(self, disruption: bool = True) -> None:
        """Delete the pod: SIGTERM to PID 1, SIGKILL after its grace period. With `disruption`
        (a preemption, a drain, an eviction) the pod carries DisruptionTarget when it fails."""
        if disruption:
            self.conditions.add(DISRUPTION_TARGET)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def exit_code(self) -> int | None:
        code = self.proc.poll()
        return None if code is None else (code if code >= 0 else 128 - code)


class PodController:
    """What the local Job and PyTorchJob controllers share: pods by index (every attempt kept), the
    API the tests drive, and a loop that judges each pod as it ends, starts due replacements and
    finishes once nothing runs after the end. A subclass sets `kind` (for messages), `size`,
    `folder`, `ips`, `hosts`, `env`, `configmaps`, `keep_volumes`, `echo`, calls _init_controller(),
    and provides _start_pod(index) (through _launch), _judge(index, pod) and _delete_on_end()."""

    kind = "Job"

    def _init_controller(self) -> None:
        self.history: list[tuple[int, int, str]] = []
        self.condition: tuple[str, str] | None = None
        self._pods: dict[int, list[JobPod]] = {i: [] for i in range(self.size)}
        self._due: dict[int, float] = {}  # index -> when its replacement starts
        self._ending: tuple[str, str] | None = None
        self._lock = threading.RLock()
        self._new_pod = threading.Condition(self._lock)
        self._finished = threading.Event()
        self._stopping = threading.Event()
        self._controller: threading.Thread | None = None

    # ------------------------------------------------------------ the API

    def pod(self, index: int) -> JobPod:
        return self.pods(index)[-1]

    def pods(self, index: int) -> list[JobPod]:
        with self._lock:
            return list(self._pods[index])

    def attempts(self, index: int) -> int:
        return len(self.pods(index))

    def output(self, index: int) -> str:
        return "".join(pod.output for pod in self.pods(index))

    def wait_for_pod(self, index: int, attempt: int, timeout: float = 60) -> JobPod:
        """The attempt-th pod (1 = the first) of an index, waiting until it has started."""
        with self._new_pod:
            if not self._new_pod.wait_for(lambda: len(self._pods[index]) >= attempt or self._finished.is_set(),
                                          timeout) or len(self._pods[index]) < attempt:
                raise AssertionError(f"index {index} has had {len(self._pods[index])} pods, not {attempt}; "
                                     f"history {self.history}; condition {self.condition}")
            return self._pods[index][attempt - 1]

    def delete(self, index: int) -> None:
        """Preempt index's current pod: DisruptionTarget, then SIGTERM (SIGKILL after its grace)."""
        self.pod(index).delete(disruption=True)

    def wait(self, timeout: float = 300) -> tuple[str, str]:
        """(condition, reason) once the run has finished and every pod has terminated."""
        if not self._finished.wait(timeout) or self.condition is None:
            tails = "\n".join(f"--- index {i}, pod {self.attempts(i)}:\n{self.pod(i).output[-2000:]}"
                              for i in range(self.size) if self.attempts(i))
            raise AssertionError(f"{self.kind} {self.name} not finished after {timeout}s; history {self.history}\n{tails}")
        return self.condition

    def stop(self, grace: float = 10) -> None:
        """Cleanup: delete every pod (SIGTERM) and stop the controller; a runner still there after
        `grace` seconds is killed, and its PID 1 with it (not the pods' terminationGracePeriodSeconds,
        300 s in job.yaml: a modelled deletion is delete(i)). Safe to call twice."""
        self._stopping.set()
        with self._lock:
            self._due.clear()
            running = [p for pods in self._pods.values() for p in pods if p.proc.poll() is None]
        for pod in running:
            pod.delete(disruption=False)
        deadline = time.monotonic() + grace
        for pod in running:
            try:
                pod.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # past the grace: the runner's death kills PID 1 (its pdeathsig)
                os.killpg(pod.proc.pid, signal.SIGKILL)
                pod.proc.wait()
        if self._controller:
            self._controller.join(timeout=10)

    # ------------------------------------------------------------ the controller

    def _start_controller(self) -> None:
        self._controller = threading.Thread(target=self._control, daemon=True)
        self._controller.start()

    def _launch(self, index: int, pidfile: Path, manifest: Path, extra: list[str]) -> None:
        """Start index's next pod: local_pod.py with this run's addresses, ConfigMaps and env."""
        command = [sys.executable, str(RUNNER), "--pidfile", str(pidfile), *extra, "--pod-ip", self.ips[index]]
        command += [arg for name, ip in self.hosts for arg in ("--host", f"{name}={ip}")]
        command += [arg for name, path in self.configmaps.items() for arg in ("--configmap", f"{name}={path}")]
        if self.keep_volumes:
            command += ["--keep-volumes", str(self.keep_volumes)]
        command += [arg for key, value in self.env.items() for arg in ("--env", f"{key}={value}")]
        attempt = len(self._pods[index]) + 1
        self._pods[index].append(JobPod(command + [str(manifest)], pidfile, podlab.tool_env(), index, attempt,
                                        self.echo))
        self._new_pod.notify_all()

    def _control(self) -> None:
        while not self._finished.is_set():
            with self._lock:
                self._step()
            time.sleep(0.1)

    def _step(self) -> None:
        for index, pods in self._pods.items():
            pod = pods[-1] if pods else None
            if pod is not None and not getattr(pod, "judged", False) and pod.exit_code() is not None:
                pod.judged = True
                pod._reader.join(timeout=5)  # its last lines are read before anyone hears of its end
                self._judge(index, pod)
        now = time.monotonic()
        for index, due in list(self._due.items()):
            if now >= due and not self._ending and not self._stopping.is_set():
                del self._due[index]
                self._replace(index)
        self._check_deadline(now)
        running = any(p.exit_code() is None for pods in self._pods.values() for p in pods)
        if not running and not self._due and (self._ending or self._stopping.is_set()):
            self.condition = self._ending
            self._finished.set()
            self._new_pod.notify_all()
            if self._ending:
                log(f"{self.kind} {self.name} {self._ending[0]}: {self._ending[1]}")

    def _replace(self, index: int) -> None:
        self._start_pod(index)

    def _check_deadline(self, now: float) -> None:
        """A run with a deadline ends itself here."""

    def _judged_while_ending(self, index: int, code: int) -> bool:
        """A pod that ends after the run's end (or the cleanup) is only recorded."""
        if self._ending or self._stopping.is_set():
            self.history.append((index, code, "terminated"))
            return True
        return False

    def _end(self, condition: str, reason: str) -> None:
        """The run has finished: no new pods, and the running ones are deleted where it says so."""
        self._ending = (condition, reason)
        self._due.clear()
        if self._delete_on_end():
            for pods in self._pods.values():
                if pods and pods[-1].exit_code() is None:
                    pods[-1].delete(disruption=False)

    def _delete_on_end(self) -> bool:
        return True


class IndexedJob(PodController):
    """An Indexed Job run locally: N pods of lab/local_pod.py and the controller's rules.

        job = IndexedJob(manifest, env={"K": "V"}, keep_volumes=None, configmaps={"name": dir})
        job.start()
        job.pod(i)          # the current (newest) pod of index i: a JobPod
        job.pods(i)         # every pod index i has had, oldest first
        job.attempts(i)     # how many pods index i has had
        job.wait_for_pod(i, attempt, timeout)  # the attempt-th pod of index i, once started
        job.output(i)       # the output of every pod of index i, in order
        job.delete(i)       # a preemption of index i's pod (DisruptionTarget)
        job.history         # [(index, exit_code, verdict)], verdict in VERDICTS
        job.failures        # failures counted against backoffLimit
        job.wait(timeout)   # -> ("Complete" | "Failed", reason), once every pod has terminated
        job.stop(grace=10)  # cleanup: delete every pod, SIGKILL what is left after grace s

    env: --env values for every container; configmaps: --configmap NAME=DIR; keep_volumes: each
    pod's volumes kept in DIR/<pod name>. folder holds the pidfiles (a temporary one by default).
    first_ip: pod i's address is first_ip + i (default FIRST_IP, 127.0.0.10; tests beside other
    jobs pick their own in 127/8). replacement_delay: seconds before a failed index's new pod.
    echo: copy each pod's output to stdout, prefixed [index.attempt], its EVENT lines left out (the
    command line does).
    """

    def __init__(self, manifest: Path | str, env: dict[str, str] | None = None, keep_volumes: Path | str | None = None,
                 configmaps: dict[str, Path | str] | None = None, *, folder: Path | str | None = None,
                 first_ip: str | None = None, replacement_delay: float = REPLACEMENT_DELAY_SECONDS,
                 echo: bool = False):
        self.manifest = Path(manifest).resolve()
        self.env = dict(env or {})
        self.keep_volumes, self.echo = keep_volumes, echo
        self.configmaps = {name: Path(path) for name, path in (configmaps or {}).items()}
        self.replacement_delay = replacement_delay
        job, _ = local_pod.load_stream(self.manifest)
        self.name = (job.get("metadata") or {}).get("name") or ""
        if not self.name:
            raise BadInput(f"{self.manifest}: the Job has no metadata.name; give it one")
        spec = job.get("spec") or {}
        template_spec = (spec.get("template") or {}).get("spec") or {}
        self.size = check_indexed(spec)
        self.rules = check_policy(spec, template_spec)
        self.backoff_limit = spec.get("backoffLimit", DEFAULT_BACKOFF_LIMIT)
        self.deadline = spec.get("activeDeadlineSeconds")
        self.grace = template_spec.get("terminationGracePeriodSeconds", 30)
        self.container = ((template_spec.get("containers") or [{}])[0]).get("name", "")
        self.ips = pod_ips(first_ip or FIRST_IP, self.size)
        namespace = (job.get("metadata") or {}).get("namespace", "default")
        self.hosts = peer_hosts(self.name, template_spec.get("subdomain"), namespace, self.ips)
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix=f"local_job-{self.name}-"))
        self.failures = 0
        self._succeeded: set[int] = set()
        self._init_controller()

    # ------------------------------------------------------------ the API

    def start(self) -> "IndexedJob":
        """Check what every pod would get (bad input raises BadInput), then start all N pods."""
        for index in range(self.size):
            local_pod.load_pod(self.manifest, self.env, self.configmaps, index, self.ips[index], self.hosts)
        local_pod.check_host()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with self._lock:
            for index in range(self.size):
                self._start_pod(index)
        self._start_controller()
        return self

    # ------------------------------------------------------------ the controller

    def _start_pod(self, index: int) -> None:
        pidfile = self.folder / f"{self.name}-{index}-attempt{len(self._pods[index]) + 1}.pid"
        self._launch(index, pidfile, self.manifest, ["--index", str(index)])

    def _check_deadline(self, now: float) -> None:
        if self.deadline is not None and not self._ending and now - self.started_at > self.deadline:
            self._end("Failed", "DeadlineExceeded")

    def _judge(self, index: int, pod: JobPod) -> None:
        code = pod.exit_code()
        if self._judged_while_ending(index, code):
            return
        failure = PodFailure(self.container, code, frozenset(pod.conditions))
        verdict, reason = decide(self.rules, failure, self.failures, self.backoff_limit)
        self.history.append((index, code, verdict))
        log(f"index {index} pod {pod.attempt} exited {code}: {verdict}")
        if verdict == "counted":
            self.failures += 1
        if verdict == "succeeded":
            self._succeeded.add(index)
            if len(self._succeeded) == self.size:
                self._end("Complete", "CompletionsReached")
        elif reason:
            self._end("Failed", reason)
        else:
            self._due[index] = time.monotonic() + self.replacement_delay


def check_indexed(spec: dict) -> int:
    if spec.get("completionMode") != "Indexed":
        raise BadInput("the Job is not Indexed (spec.completionMode); local_job.py runs Indexed Jobs, "
                       "local_pod.py runs any Job's single pod")
    completions, parallelism = spec.get("completions"), spec.get("parallelism", 1)
    if type(completions) is not int or completions < 1 or completions != parallelism:
        raise BadInput(f"completions ({completions}) must equal parallelism ({parallelism}), at least 1: "
                       "local_job.py runs every index at once; set both to the number of pods")
    return completions


def pod_ips(first_ip: str, size: int) -> list[str]:
    first = ipaddress.ip_address(local_pod.loopback_ip(first_ip, "first_ip"))
    ips = [str(first + i) for i in range(size)]
    local_pod.loopback_ip(ips[-1], "the last pod's address")
    return ips


def peer_hosts(job_name: str, subdomain: str | None, namespace: str, ips: list[str]) -> list[tuple[str, str]]:
    """The names a headless Service named `subdomain` gives the pods in the cluster DNS."""
    if not subdomain:
        return []
    hosts = []
    for index, ip in enumerate(ips):
        hosts.append((f"{job_name}-{index}.{subdomain}", ip))
        hosts.append((f"{job_name}-{index}.{subdomain}.{namespace}.svc.cluster.local", ip))
    return hosts


# ---------------------------------------------------------------- the JobSet controller's rules
#
# Read from kubernetes-sigs/jobset v0.10.1: pkg/controllers/failure_policy.go (rules in order, the
# first applicable one wins; no rule: RestartJobSet; no failurePolicy: the JobSet fails),
# jobset_controller.go (constructJob, labelAndAnnotateObject), pkg/constants/constants.go.
# The child Job's failure message: kubernetes pkg/controller/job/pod_failure_policy.go and
# job_controller.go.

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_ACTIONS = ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts")
JOBSET_KEY = "jobset.sigs.k8s.io/"
RESTART_ATTEMPT = JOBSET_KEY + "restart-attempt"
BACKOFF_LIMIT_MESSAGE = "Job has reached the specified backoff limit"
DEADLINE_MESSAGE = "Job was active longer than specified deadline"


def matching_rule(rules: list[dict], failure: PodFailure) -> tuple[int, dict] | None:
    """The first podFailurePolicy rule the failed pod matches, with its index."""
    return next(((number, rule) for number, rule in enumerate(rules) if rule_matches(rule, failure)), None)


def job_failure(rules: list[dict], failure: PodFailure, pod: str, failures: int,
                backoff_limit: int) -> tuple[str, str] | None:
    """The Job's Failed condition (reason, message) that this pod's failure causes, worded as the
    Job controller words it; None when the Job goes on. `pod` is namespace/name."""
    verdict, reason = decide(rules, failure, failures, backoff_limit)
    if reason == "PodFailurePolicy":
        number, rule = matching_rule(rules, failure)
        if "onExitCodes" in rule:
            return reason, (f"Container {failure.container} for pod {pod} failed with exit code "
                            f"{failure.exit_code} matching FailJob rule at index {number}")
        condition = next(p["type"] for p in rule["onPodConditions"] if p.get("type") in failure.conditions)
        return reason, f"Pod {pod} has condition {condition} matching FailJob rule at index {number}"
    if reason == "BackoffLimitExceeded":
        return reason, BACKOFF_LIMIT_MESSAGE
    return None


def jobset_rule_applies(rule: dict, reason: str, message: str, replicated_job: str) -> bool:
    """onJobFailureReasons, onJobFailureMessagePatterns (Go regexp.MatchString: a match anywhere)
    and targetReplicatedJobs; an empty or absent list matches anything."""
    reasons, patterns = rule.get("onJobFailureReasons") or [], rule.get("onJobFailureMessagePatterns") or []
    targets = rule.get("targetReplicatedJobs") or []
    return ((not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns))
            and (not targets or replicated_job in targets))


def jobset_decision(policy: dict | None, reason: str, message: str, replicated_job: str,
                    counted_restarts: int) -> tuple[str, str]:
    """What the JobSet controller does when a child Job failed with (reason, message), given the
    restarts counted towards maxRestarts so far:
        ("restart", "counted")       RestartJobSet (the default when no rule applies)
        ("restart", "not counted")   RestartJobSetAndIgnoreMaxRestarts
        ("Failed", JobSet reason)    FailJobSet, maxRestarts reached, or no failurePolicy"""
    if policy is None:
        return "Failed", "FailedJobs"
    rule = next((r for r in policy.get("rules") or [] if jobset_rule_applies(r, reason, message, replicated_job)), None)
    action = rule["action"] if rule else "RestartJobSet"
    if action == "FailJobSet":
        return "Failed", "FailJobSetFailurePolicyAction"
    if action == "RestartJobSetAndIgnoreMaxRestarts":
        return "restart", "not counted"
    if counted_restarts >= policy.get("maxRestarts", 0):
        return "Failed", "ReachedMaxRestarts"
    return "restart", "counted"


def jobset_child(jobset: dict, restarts: int) -> dict:
    """The child Job the JobSet controller makes of its one replicatedJob (job index 0): named
    <jobset>-<replicatedJob>-0, the JobSet's labels and annotations on the Job and its pod
    template, subdomain the JobSet's name (network.subdomain) when enableDNSHostnames is set."""
    name, spec = jobset["metadata"]["name"], jobset.get("spec") or {}
    replicated = spec["replicatedJobs"][0]
    child_name = f"{name}-{replicated['name']}-0"
    namespace = jobset["metadata"].get("namespace", "default")
    uid = f"local-{name}"
    marks = {"jobset-name": name, "jobset-uid": uid, "replicatedjob-name": replicated["name"],
             "restart-attempt": str(restarts), "replicatedjob-replicas": str(replicated.get("replicas", 1)),
             "global-replicas": str(replicated.get("replicas", 1)), "job-index": "0",
             "job-global-index": "0", "job-key": hashlib.sha256(f"{namespace}/{child_name}".encode()).hexdigest()}
    marks = {JOBSET_KEY + key: value for key, value in marks.items()}
    template = copy.deepcopy(replicated.get("template") or {})
    job_spec = template.get("spec") or {}
    pod_template = job_spec.setdefault("template", {})
    for meta in (template.setdefault("metadata", {}), pod_template.setdefault("metadata", {})):
        meta["labels"] = {**(meta.get("labels") or {}), **marks}
        meta["annotations"] = {**(meta.get("annotations") or {}), **marks}
    network = spec.get("network") or {}
    if network.get("enableDNSHostnames"):
        pod_template.setdefault("spec", {})["subdomain"] = network.get("subdomain") or name
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {**template["metadata"], "name": child_name, "namespace": namespace},
            "spec": job_spec}


def check_jobset(jobset: dict) -> None:
    spec = jobset.get("spec") or {}
    if not (jobset.get("metadata") or {}).get("name"):
        raise BadInput("the JobSet has no metadata.name; give it one")
    replicated = spec.get("replicatedJobs") or []
    if len(replicated) != 1 or replicated[0].get("replicas", 1) != 1:
        raise BadInput("local_job.py runs a JobSet of one replicatedJob with replicas 1 (what submit.py "
                       "--engine jobset renders); more child Jobs are not modelled")
    if spec.get("successPolicy") not in (None, {"operator": "All"}) or spec.get("startupPolicy"):
        raise BadInput("successPolicy other than operator All, and startupPolicy, are not modelled; drop them")
    for number, rule in enumerate((spec.get("failurePolicy") or {}).get("rules") or []):
        if rule.get("action") not in JOBSET_ACTIONS:
            raise BadInput(f"failurePolicy rule {number}: action {rule.get('action')!r} is not one of "
                           f"{', '.join(JOBSET_ACTIONS)}; fix the rule")
        for pattern in rule.get("onJobFailureMessagePatterns") or []:
            try:
                re.compile(pattern)
            except re.error:
                raise BadInput(f"failurePolicy rule {number}: {pattern!r} is not a regular expression") from None


def load_documents(path: Path) -> list[dict]:
    if not path.is_file():
        raise BadInput(f"{path}: no such file; pass the manifest's path")
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except yaml.YAMLError as error:
        raise BadInput(f"{path}: not valid YAML ({' '.join(str(error).split())}); fix the file")


def one_of_kind(documents: list[dict], api: str, kind: str, path: Path) -> dict:
    found = [d for d in documents if (d.get("apiVersion"), d.get("kind")) == (api, kind)]
    if len(found) != 1:
        kinds = ", ".join(f"{d.get('apiVersion')}/{d.get('kind')}" for d in documents) or "nothing"
        raise BadInput(f"{path}: expected one {api} {kind}, found {kinds}")
    return found[0]


def configmaps_of(documents: list[dict]) -> list[dict]:
    """The ConfigMaps and Secrets of a stream: what the pods' volumes and env read from it."""
    return [d for d in documents if (d.get("apiVersion"), d.get("kind")) in (("v1", "ConfigMap"), ("v1", "Secret"))]


def write_stream(path: Path, documents: list[dict]) -> Path:
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return path


def runner_pod_name(pod: podlab.Pod) -> str:
    """The pod name local_pod.py gave it (its "pod NAME: starting" line), else "?"."""
    match = next((m for m in map(POD_STARTING.search, list(pod.lines)) if m), None)
    return match.group(1) if match else "?"


POD_STARTING = re.compile(r"^local_pod: pod (\S+): starting")


class JobSetRun:
    """A JobSet (jobset.x-k8s.io/v1alpha2) run locally: its one child Job is an IndexedJob (the
    Job controller's rules above), and the JobSet controller's failurePolicy on top.

        jobset = JobSetRun(manifest, env=..., configmaps=..., first_ip=...)   # as IndexedJob
        jobset.start()
        jobset.pod(i), pods(i), attempts(i), output(i), delete(i), wait_for_pod(i, attempt)
                            # index i across every restart: pods(i)[k] is restart-attempt k's
        jobset.restarts     # status.restarts: the restart-attempt of the running child Job
        jobset.counted_restarts  # status.restartsCountTowardsMax
        jobset.history      # [(index, exit_code, verdict)] of every child Job, in order
        jobset.failures     # [(restart_attempt, job reason, job message, decision)]
        jobset.wait(timeout)  # ("Completed", "AllJobsCompleted") | ("Failed", reason)
        jobset.stop(grace)

    A child Job's failure (reason and message as the Job controller sets them, once every pod of it
    has terminated, as Kubernetes >= 1.31 does) goes through failurePolicy.rules: FailJobSet fails
    the JobSet; RestartJobSet (also when no rule applies) and RestartJobSetAndIgnoreMaxRestarts
    recreate the child Job with restart-attempt + 1 (its pods were already deleted by the Job
    controller when it failed: SIGTERM, their grace period), the first counted against
    maxRestarts: a restart past it fails the JobSet (ReachedMaxRestarts)."""

    kind = "JobSet"

    def __init__(self, manifest: Path | str, env: dict[str, str] | None = None, keep_volumes: Path | str | None = None,
                 configmaps: dict[str, Path | str] | None = None, *, folder: Path | str | None = None,
                 first_ip: str | None = None, replacement_delay: float = REPLACEMENT_DELAY_SECONDS,
                 echo: bool = False):
        self.manifest = Path(manifest).resolve()
        documents = load_documents(self.manifest)
        self.jobset = one_of_kind(documents, JOBSET_API, "JobSet", self.manifest)
        check_jobset(self.jobset)
        self.configmap_documents = configmaps_of(documents)
        self.name = self.jobset["metadata"]["name"]
        self.replicated_job = self.jobset["spec"]["replicatedJobs"][0]["name"]
        self.policy = self.jobset["spec"].get("failurePolicy")
        self.child_args = dict(env=env, keep_volumes=keep_volumes, configmaps=configmaps, first_ip=first_ip,
                               replacement_delay=replacement_delay, echo=echo)
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix=f"local_jobset-{self.name}-"))
        self.restart_delay = replacement_delay
        self.restarts = self.counted_restarts = 0
        self.failures: list[tuple[int, str, str, str]] = []
        self.condition: tuple[str, str] | None = None
        self.children: list[IndexedJob] = [self._child(0)]  # checks the child Job now: bad input raises here
        self.size, self.grace = self.children[0].size, self.children[0].grace
        self._lock = threading.RLock()
        self._finished = threading.Event()
        self._stopping = threading.Event()
        self._controller: threading.Thread | None = None

    def _child(self, restarts: int) -> IndexedJob:
        child = jobset_child(self.jobset, restarts)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = write_stream(self.folder / f"{child['metadata']['name']}-attempt{restarts}.yaml",
                            [*self.configmap_documents, child])
        return IndexedJob(path, folder=self.folder / f"attempt{restarts}", **self.child_args)

    # ------------------------------------------------------------ the API

    def start(self) -> "JobSetRun":
        self.children[0].start()
        self._controller = threading.Thread(target=self._control, daemon=True)
        self._controller.start()
        return self

    @property
    def child(self) -> IndexedJob:
        with self._lock:
            return self.children[-1]

    def pods(self, index: int) -> list[JobPod]:
        with self._lock:
            children = list(self.children)
        return [pod for child in children for pod in child.pods(index)]

    def pod(self, index: int) -> JobPod:
        return self.pods(index)[-1]

    def attempts(self, index: int) -> int:
        return len(self.pods(index))

    def output(self, index: int) -> str:
        return "".join(pod.output for pod in self.pods(index))

    @property
    def history(self) -> list[tuple[int, int, str]]:
        with self._lock:
            return [entry for child in self.children for entry in child.history]

    def wait_for_pod(self, index: int, attempt: int, timeout: float = 60) -> JobPod:
        if not wait_until(lambda: self.attempts(index) >= attempt or self._finished.is_set(), timeout) \
                or self.attempts(index) < attempt:
            raise AssertionError(f"index {index} has had {self.attempts(index)} pods, not {attempt}; "
                                 f"failures {self.failures}; condition {self.condition}")
        return self.pods(index)[attempt - 1]

    def delete(self, index: int) -> None:
        """Preempt index's current pod: DisruptionTarget, then SIGTERM (SIGKILL after its grace)."""
        self.pod(index).delete(disruption=True)

    def wait(self, timeout: float = 300) -> tuple[str, str]:
        """The JobSet's terminal condition, once it has one and no pod of it runs."""
        if not self._finished.wait(timeout) or self.condition is None:
            tails = "\n".join(f"--- index {i}, pod {self.attempts(i)}:\n{self.pod(i).output[-2000:]}"
                              for i in range(self.size) if self.attempts(i))
            raise AssertionError(f"{self.kind} {self.name} not finished after {timeout}s; failures {self.failures}; "
                                 f"history {self.history}\n{tails}")
        return self.condition

    def stop(self, grace: float = 10) -> None:
        self._stopping.set()
        if self._controller:
            self._controller.join(timeout=10)
        self.child.stop(grace)
        self._finished.set()

    # ------------------------------------------------------------ the controller

    def _control(self) -> None:
        while not self._stopping.is_set():
            child = self.child
            if not child._finished.wait(0.1):
                continue
            if child.condition is None:  # stopped
                return
            if child.condition[0] == "Complete":
                self._end("Completed", "AllJobsCompleted")
                return
            reason, message = child_failure(child, self.jobset["metadata"].get("namespace", "default"))
            decision, detail = jobset_decision(self.policy, reason, message, self.replicated_job,
                                               self.counted_restarts)
            self.failures.append((self.restarts, reason, message, f"{decision} ({detail})"))
            log(f"JobSet {self.name}: child Job {child.name} failed ({reason}: {message}): {decision} ({detail})")
            if decision == "Failed":
                self._end("Failed", detail)
                return
            time.sleep(self.restart_delay)  # the old Job is deleted (foreground), then the new one made
            with self._lock:
                if self._stopping.is_set():
                    return
                self.restarts += 1
                self.counted_restarts += detail == "counted"
                self.children.append(self._child(self.restarts))
                self.children[-1].start()

    def _end(self, condition: str, reason: str) -> None:
        self.condition = (condition, reason)
        log(f"{self.kind} {self.name} {condition}: {reason}")
        self._finished.set()


def child_failure(child: IndexedJob, namespace: str = "default") -> tuple[str, str]:
    """The failed child Job's (reason, message): the pod whose failure failed it, replayed."""
    if child.condition and child.condition[1] == "DeadlineExceeded":
        return "DeadlineExceeded", DEADLINE_MESSAGE
    seen: dict[int, int] = {}
    failures = 0
    for index, code, verdict in child.history:
        pod = child.pods(index)[seen.get(index, 0)]
        seen[index] = seen.get(index, 0) + 1
        if verdict not in ("counted", "failjob"):
            continue
        failure = PodFailure(child.container, code, frozenset(pod.conditions))
        found = job_failure(child.rules, failure, f"{namespace}/{runner_pod_name(pod)}", failures, child.backoff_limit)
        failures += verdict == "counted"
        if found:
            return found
    return child.condition[1] if child.condition else "Unknown", ""


wait_until = podlab.wait_until  # one polling helper for the lab and the tests


# ---------------------------------------------------------------- the training operator's rules
#
# Read from kubeflow/training-operator v1.9.0: pkg/controller.v1/pytorch/envvar.go and master.go
# (the env), initcontainer.go (a Worker's init container), pytorchjob_controller.go
# (UpdateJobStatus: the Master's success is the job's), pkg/controller.v1/common/pod.go
# (ReconcilePods: ExitCode recreates a pod on a retryable code, fails the job on any other),
# common/service.go (a headless Service per pod, named as the pod), common/job.go
# (DeletePodsAndServices, cleanPodPolicy), pkg/util/train/train_util.go (IsRetryableExitCode:
# >= 128), pkg/apis/kubeflow.org/v1/pytorch_defaults.go (cleanPodPolicy None, the port).

PYTORCHJOB_API = "kubeflow.org/v1"
PYTORCH_CONTAINER = "pytorch"
PYTORCH_PORT_NAME = "pytorchjob-port"
PYTORCH_DEFAULT_PORT = 23456
PYTORCH_POLICIES = ("ExitCode", "Never")
REPLICA_ORDER = ("Master", "Worker")
KUBEFLOW_KEY = "training.kubeflow.org/"


def retryable(exit_code: int) -> bool:
    """train_util.IsRetryableExitCode: every code from 128 up (a signal, 138, and 128 itself)."""
    return exit_code >= 128


def pytorch_pod_verdict(restart_policy: str, exit_code: int) -> str:
    """ReconcilePods on a pod that ended: succeeded, restart (deleted and created anew, alone,
    without limit) or failed (the PyTorchJob fails)."""
    if exit_code == 0:
        return "succeeded"
    if restart_policy == "ExitCode" and retryable(exit_code):
        return "restart"
    return "failed"


def pytorch_succeeded(replicas: dict[str, int], succeeded: dict[str, int]) -> bool:
    """UpdateJobStatus: with a Master, the job succeeds when the Master has; without one, when
    every Worker has."""
    if "Master" in replicas:
        return succeeded.get("Master", 0) >= replicas["Master"]
    return succeeded.get("Worker", 0) >= replicas.get("Worker", 0)


def operator_env(job_name: str, replicas: dict[str, int], replica_type: str, index: int,
                 master_port: int | None, nproc_per_node: str | None) -> list[tuple[str, str]]:
    """setPodEnv: what the operator appends to the env of the pod's containers, in its order (a
    later entry of the same name wins over the manifest's)."""
    env = [("PYTHONUNBUFFERED", "1")]
    total = sum(replicas.values())
    try:
        nproc = int(nproc_per_node) if nproc_per_node is not None else 1
    except ValueError:  # "auto": the operator counts 1
        nproc = 1
    if "Master" in replicas:
        master = f"{job_name}-master-0"
        rank = index + 1 if replica_type == "Worker" else index
        env += [("MASTER_PORT", str(master_port)), ("PET_MASTER_PORT", str(master_port)),
                ("MASTER_ADDR", master), ("PET_MASTER_ADDR", master),
                ("WORLD_SIZE", str(total * nproc)), ("RANK", str(rank)), ("PET_NODE_RANK", str(rank))]
    if nproc_per_node is not None:
        env.append(("PET_NPROC_PER_NODE", str(nproc_per_node)))
    env.append(("PET_NNODES", str(total)))
    return env


def replica_slots(replicas: dict[str, int]) -> list[tuple[str, int]]:
    """The pods, node 0 first: (Master, 0), then (Worker, 0), (Worker, 1), ..."""
    return [(kind, index) for kind in REPLICA_ORDER for index in range(replicas.get(kind, 0))]


def master_port_of(spec: dict) -> int | None:
    for container in (spec["pytorchReplicaSpecs"].get("Master") or {}).get("template", {}).get("spec", {}).get(
            "containers") or []:
        if container.get("name") == PYTORCH_CONTAINER:
            for port in container.get("ports") or []:
                if port.get("name") == PYTORCH_PORT_NAME:
                    return port.get("containerPort")
    return None


def check_pytorchjob(job: dict) -> dict[str, int]:
    spec = job.get("spec") or {}
    if not (job.get("metadata") or {}).get("name"):
        raise BadInput("the PyTorchJob has no metadata.name; give it one")
    specs = spec.get("pytorchReplicaSpecs") or {}
    if not specs or set(specs) - set(REPLICA_ORDER):
        raise BadInput(f"pytorchReplicaSpecs must hold Master and/or Worker, not {sorted(specs)}")
    if spec.get("elasticPolicy"):
        raise BadInput("elasticPolicy is not modelled here; drop it")
    replicas = {}
    for kind, replica in specs.items():
        if replica.get("restartPolicy", "OnFailure") not in PYTORCH_POLICIES:
            raise BadInput(f"{kind} restartPolicy {replica.get('restartPolicy', 'OnFailure')!r} is not modelled "
                           f"({', '.join(PYTORCH_POLICIES)} are)")
        containers = ((replica.get("template") or {}).get("spec") or {}).get("containers") or []
        if not any(c.get("name") == PYTORCH_CONTAINER for c in containers):
            raise BadInput(f"{kind}: no container named {PYTORCH_CONTAINER!r}; the operator finds it by that name")
        replicas[kind] = replica.get("replicas", 1)
    if replicas.get("Master", 1) != 1:
        raise BadInput("Master replicas must be 1")
    return replicas


class PyTorchJobRun(PodController):
    """A Kubeflow PyTorchJob (kubeflow.org/v1) run locally as training-operator v1.9 runs it.

        job = PyTorchJobRun(manifest, env=..., configmaps=..., first_ip=...)   # as IndexedJob
        job.start()
        job.pod(i), pods(i), attempts(i), output(i), delete(i), wait_for_pod(i, attempt)
                          # i = node rank: 0 the Master, 1 + k Worker k
        job.history       # [(i, exit_code, verdict)], verdict succeeded/restart/failed/terminated
        job.restarts      # pods recreated
        job.outcome       # ("Succeeded" | "Failed", reason) once decided, else None
        job.wait(timeout) # the same, once no pod runs
        job.stop(grace)

    Pod i is named <job>-master-0 or <job>-worker-k (its hostname and HOSTNAME; the runner adds
    its 5-character suffix to metadata.name), address first_ip + i, the operator's labels, and
    --host lines for every pod's headless Service: <pod> and <pod>.<namespace>.svc.cluster.local.
    The "pytorch" container gets operator_env() appended. A pod that ends is judged by its
    replica's restartPolicy (pytorch_pod_verdict): restart deletes it and creates it again, alone;
    failed fails the PyTorchJob (reason PyTorchJobFailed); the Master's success is the job's
    (PyTorchJobSucceeded). Then, with cleanPodPolicy None (the default), the other pods are left
    to end on their own (wait() waits for them); Running or All deletes them."""

    kind = "PyTorchJob"

    def __init__(self, manifest: Path | str, env: dict[str, str] | None = None, keep_volumes: Path | str | None = None,
                 configmaps: dict[str, Path | str] | None = None, *, folder: Path | str | None = None,
                 first_ip: str | None = None, replacement_delay: float = REPLACEMENT_DELAY_SECONDS,
                 echo: bool = False):
        self.manifest = Path(manifest).resolve()
        documents = load_documents(self.manifest)
        self.job = one_of_kind(documents, PYTORCHJOB_API, "PyTorchJob", self.manifest)
        self.replicas = check_pytorchjob(self.job)
        self.configmap_documents = configmaps_of(documents)
        self.name = self.job["metadata"]["name"]
        self.namespace = self.job["metadata"].get("namespace", "default")
        spec = self.job["spec"]
        self.nproc_per_node = spec.get("nprocPerNode")
        self.master_port = master_port_of(spec)
        if "Master" in self.replicas and self.master_port is None:
            # The webhook's defaulting adds the port; here the manifest must have it, as submit.py's has.
            raise BadInput(f"the Master's {PYTORCH_CONTAINER} container has no port named {PYTORCH_PORT_NAME}; "
                           f"add containerPort {PYTORCH_DEFAULT_PORT} named so")
        self.clean_pod_policy = (spec.get("runPolicy") or {}).get("cleanPodPolicy", "None")
        self.env, self.keep_volumes, self.echo = dict(env or {}), keep_volumes, echo
        self.configmaps = {name: Path(path) for name, path in (configmaps or {}).items()}
        self.replacement_delay = replacement_delay
        self.slots = replica_slots(self.replicas)
        self.size = len(self.slots)
        self.ips = pod_ips(first_ip or FIRST_IP, self.size)
        self.hosts = [(name, ip) for (kind, index), ip in zip(self.slots, self.ips)
                      for name in (self.pod_name(kind, index),
                                   f"{self.pod_name(kind, index)}.{self.namespace}.svc.cluster.local")]
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix=f"local_pytorchjob-{self.name}-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.manifests = [self._pod_manifest(kind, index) for kind, index in self.slots]
        self.grace = max(local_pod.load_job(m)["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
                         for m in self.manifests)
        self.restarts = 0
        self._succeeded: dict[str, int] = {}
        self._init_controller()

    def pod_name(self, kind: str, index: int) -> str:
        return f"{self.name}-{kind.lower()}-{index}"

    def _pod_manifest(self, kind: str, index: int) -> Path:
        """The pod the operator would create, as a one-pod batch/v1 Job local_pod.py runs."""
        replica = self.job["spec"]["pytorchReplicaSpecs"][kind]
        template = copy.deepcopy(replica["template"])
        meta = template.setdefault("metadata", {})
        meta["labels"] = {**(meta.get("labels") or {}),
                          KUBEFLOW_KEY + "operator-name": "pytorchjob-controller",
                          KUBEFLOW_KEY + "job-name": self.name,
                          KUBEFLOW_KEY + "replica-type": kind.lower(),
                          KUBEFLOW_KEY + "replica-index": str(index),
                          **({KUBEFLOW_KEY + "job-role": "master"} if kind == "Master" else {})}
        pod_spec = template.setdefault("spec", {})
        pod_spec["hostname"] = self.pod_name(kind, index)  # the operator's pod name, which is the hostname
        pod_spec["restartPolicy"] = "Never"  # ExitCode: the operator, not the kubelet, restarts
        added = operator_env(self.name, self.replicas, kind, index, self.master_port, self.nproc_per_node)
        for container in pod_spec.get("containers") or []:
            container["env"] = [*(container.get("env") or []), *({"name": k, "value": v} for k, v in added)]
        # Worker pods also get the init container "init-pytorch" (nslookup of the Master until it
        # resolves); local_pod.py runs no init containers, and the Master's name resolves here at once.
        pod = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": self.pod_name(kind, index), "namespace": self.namespace},
               "spec": {"backoffLimit": 0, "template": template}}
        return write_stream(self.folder / f"{self.pod_name(kind, index)}.yaml", [*self.configmap_documents, pod])

    # ------------------------------------------------------------ the API

    def start(self) -> "PyTorchJobRun":
        for manifest, ip in zip(self.manifests, self.ips):
            local_pod.load_pod(manifest, self.env, self.configmaps, None, ip, self.hosts)
        local_pod.check_host()
        with self._lock:
            for rank in range(self.size):
                self._start_pod(rank)
        self._start_controller()
        return self

    @property
    def outcome(self) -> tuple[str, str] | None:
        """The PyTorchJob's terminal condition as soon as the operator sets it, while pods that
        cleanPodPolicy None leaves may still run (wait() waits for them too)."""
        return self._ending

    # ------------------------------------------------------------ the controller

    def _start_pod(self, rank: int) -> None:
        kind, index = self.slots[rank]
        pidfile = self.folder / f"{self.pod_name(kind, index)}-attempt{len(self._pods[rank]) + 1}.pid"
        self._launch(rank, pidfile, self.manifests[rank], [])

    def _replace(self, rank: int) -> None:
        self.restarts += 1
        self._start_pod(rank)

    def _judge(self, rank: int, pod: JobPod) -> None:
        code = pod.exit_code()
        if self._judged_while_ending(rank, code):
            return
        kind, _ = self.slots[rank]
        policy = self.job["spec"]["pytorchReplicaSpecs"][kind].get("restartPolicy", "OnFailure")
        verdict = pytorch_pod_verdict(policy, code)
        self.history.append((rank, code, verdict))
        log(f"{self.pod_name(*self.slots[rank])} (attempt {pod.attempt}) exited {code}: {verdict}")
        if verdict == "succeeded":
            self._succeeded[kind] = self._succeeded.get(kind, 0) + 1
            if pytorch_succeeded(self.replicas, self._succeeded):
                self._end("Succeeded", "PyTorchJobSucceeded")
        elif verdict == "failed":
            self._end("Failed", "PyTorchJobFailed")
        else:
            self._due[rank] = time.monotonic() + self.replacement_delay

    def _delete_on_end(self) -> bool:
        return self.clean_pod_policy in ("Running", "All")


# ---------------------------------------------------------------- Kubeflow Trainer v2's TrainJob
#
# Read from kubeflow/trainer v2.3.0 (commit 658725bdae5c): pkg/runtime/core/trainingruntime.go
# (newRuntimeInfo: runtimePatches as a strategic merge patch of the runtime's JobSet spec, the
# trainer's pod count from mlPolicy.numNodes, resourcesPerNode merged into the "node" container),
# plugins/torch/torch.go (EnforceMLPolicy: trainer.numNodes, trainer.env, then PET_*, port 29500),
# plugins/jobset/jobset.go and builder.go (SyncParallelCount, Build, Trainer: image, command, args),
# pkg/webhooks (the runtime's and the TrainJob's checks), pkg/constants/constants.go.

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_NODE = "node"  # constants.Node: the container the Trainer fills, and the replicatedJob of its PET_MASTER_ADDR
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_PORT = 29500   # constants.ContainerTrainerPort: PET_MASTER_PORT
COMPLETION_INDEX_PATH = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
# Strategic merge keys of the lists a runtime patch reaches (JobSet's and Kubernetes' patchMergeKey).
MERGE_KEYS = {"replicatedJobs": "name", "containers": "name", "initContainers": "name", "volumes": "name",
              "env": "name", "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
              "schedulingGates": "name"}


def strategic_merge(base, patch, field: str | None = None):
    """A strategic merge patch as the Trainer applies runtimePatches: maps merge key by key, the
    lists of MERGE_KEYS merge item by item on their key (a volume keeps only the patch's keys:
    retainKeys), any other value is replaced. No $patch directives (check_trainjob refuses them)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**copy.deepcopy(base), **{key: strategic_merge(base[key], value, key) if key in base else
                                         copy.deepcopy(value) for key, value in patch.items()}}
    key = MERGE_KEYS.get(field or "")
    if not (key and isinstance(base, list) and isinstance(patch, list)):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(base)
    for item in patch:
        index = next((i for i, old in enumerate(merged) if old.get(key) == item.get(key)), None)
        if index is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[index] = strategic_merge(merged[index], item)
            if field == "volumes":
                merged[index] = {name: merged[index][name] for name in item}
    return merged


def upsert(items: list[dict], item: dict, key: str = "name") -> None:
    """apply.upsert: replace the item with the same key in place, else append."""
    for index, old in enumerate(items):
        if old.get(key) == item.get(key):
            items[index] = item
            return
    items.append(item)


def trainer_jobset(trainjob: dict, runtime: dict) -> dict:
    """The JobSet the Trainer's controller makes of a TrainJob and its torch runtime: named and
    namespaced as the TrainJob; the runtime's JobSet spec with the TrainJob's runtimePatches merged
    in; on the replicatedJob labelled trainjob-ancestor-step=trainer, numNodes pods (TrainJob's,
    else the runtime's mlPolicy), and in its "node" container the trainer's image, command, args,
    resourcesPerNode (merged), env (upserted), then PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK
    (the pod's completion index), PET_MASTER_ADDR (<trainjob>-node-0-0.<trainjob>), PET_MASTER_PORT
    and its port 29500; the JobSet's labels and annotations those of the runtime's template and the
    patches'."""
    name, namespace = trainjob["metadata"]["name"], trainjob["metadata"].get("namespace", "default")
    trainer = trainjob["spec"].get("trainer") or {}
    template = copy.deepcopy(runtime["spec"]["template"])
    spec, meta = template.get("spec") or {}, template.get("metadata") or {}
    labels, annotations = dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})
    for patch in trainjob["spec"].get("runtimePatches") or []:
        patched = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        labels.update((patched.get("metadata") or {}).get("labels") or {})
        annotations.update((patched.get("metadata") or {}).get("annotations") or {})
        spec = strategic_merge(spec, patched.get("spec") or {})
    ml_policy = runtime["spec"].get("mlPolicy") or {}
    nodes = trainer.get("numNodes", ml_policy.get("numNodes", 1))
    for replicated in spec["replicatedJobs"]:
        if ((replicated["template"].get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL) == "trainer":
            replicated["replicas"] = 1
            replicated["template"]["spec"].update(parallelism=nodes, completions=nodes)
            for container in replicated["template"]["spec"]["template"]["spec"]["containers"]:
                if container["name"] == TRAINER_NODE:
                    fill_trainer_container(container, trainer, name, nodes)
    return {"apiVersion": JOBSET_API, "kind": "JobSet",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
            "spec": spec}


def fill_trainer_container(container: dict, trainer: dict, trainjob: str, nodes: int) -> None:
    for field in ("image", "command", "args"):
        if trainer.get(field) is not None:
            container[field] = copy.deepcopy(trainer[field])
    if trainer.get("resourcesPerNode"):
        container["resources"] = strategic_merge(container.get("resources") or {}, trainer["resourcesPerNode"])
    env = container.setdefault("env", [])
    for item in trainer.get("env") or []:
        upsert(env, copy.deepcopy(item))
    for item in pet_env(trainer, container, trainjob, nodes):
        upsert(env, item)
    upsert(container.setdefault("ports", []), {"containerPort": TRAINER_PORT}, "containerPort")


def pet_env(trainer: dict, container: dict, trainjob: str, nodes: int) -> list[dict]:
    """torch.go's PET_* values: numProcPerNode, else "auto" (with no GPU, the CPU count)."""
    per_node = trainer.get("numProcPerNode")
    if per_node is None:
        resources = container.get("resources") or {}
        gpus = (resources.get("limits") or {}).get("nvidia.com/gpu") or (resources.get("requests") or {}).get("nvidia.com/gpu")
        cpus = (resources.get("requests") or {}).get("cpu") or (resources.get("limits") or {}).get("cpu") or 1
        per_node = "auto" if gpus and int(gpus) > 0 else max(1, int(float(cpus)))
    return [{"name": "PET_NNODES", "value": str(nodes)}, {"name": "PET_NPROC_PER_NODE", "value": str(per_node)},
            {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_PATH}}},
            {"name": "PET_MASTER_ADDR", "value": f"{trainjob}-{TRAINER_NODE}-0-0.{trainjob}"},
            {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)}]


def check_trainjob(trainjob: dict, runtime: dict) -> None:
    """What the Trainer's webhooks refuse, and what is not modelled here."""
    if not (trainjob.get("metadata") or {}).get("name"):
        raise BadInput("the TrainJob has no metadata.name; give it one")
    if "torch" not in ((runtime.get("spec") or {}).get("mlPolicy") or {}):
        raise BadInput(f"runtime {runtime['metadata'].get('name')}: only mlPolicy.torch is modelled here")
    replicated = ((runtime["spec"].get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
    trainers = [r for r in replicated if ((r.get("template", {}).get("metadata") or {}).get("labels") or {}).get(
        ANCESTOR_LABEL) == "trainer"]
    if len(replicated) != 1 or len(trainers) != 1:
        raise BadInput("local_job.py runs a runtime of one replicatedJob labelled "
                       f"{ANCESTOR_LABEL}: trainer (initializers are not modelled)")
    containers = trainers[0]["template"]["spec"]["template"]["spec"].get("containers") or []
    if not any(c.get("name") == TRAINER_NODE for c in containers):
        raise BadInput(f"the runtime's trainer job has no container named {TRAINER_NODE!r}; the Trainer's webhook "
                       "refuses it")
    reserved = sorted({e["name"] for e in (trainjob["spec"].get("trainer") or {}).get("env") or []
                       if e["name"].startswith("PET_")})
    if reserved:
        raise BadInput(f"trainer.env must not set {', '.join(reserved)}: the Trainer sets them (its webhook refuses)")
    if "$patch" in yaml.safe_dump(trainjob["spec"].get("runtimePatches") or []):
        raise BadInput("runtimePatches with $patch directives are not modelled; drop them")


class TrainJobRun(JobSetRun):
    """A Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2.3) run locally:
    the JobSet its controller would make of it and its ClusterTrainingRuntime (or TrainingRuntime)
    in the stream (trainer_jobset()), run by JobSetRun, the pods named <trainjob>-node-0-<i>. Its
    condition is the JobSet's, renamed as the TrainJob's status does: ("Complete",
    "AllJobsCompleted") or ("Failed", the JobSet's reason). Everything else is JobSetRun's API
    (pod(i), delete(i), restarts, counted_restarts, failures, wait(), stop()); `jobset` is the
    rendered JobSet, `jobset_manifest` its stream."""

    kind = "TrainJob"

    def __init__(self, manifest: Path | str, env: dict[str, str] | None = None, keep_volumes: Path | str | None = None,
                 configmaps: dict[str, Path | str] | None = None, *, folder: Path | str | None = None, **kwargs):
        manifest = Path(manifest).resolve()
        documents = load_documents(manifest)
        trainjob = one_of_kind(documents, TRAINER_API, "TrainJob", manifest)
        runtime = runtime_of(trainjob, documents, manifest)
        check_trainjob(trainjob, runtime)
        self.trainjob = trainjob
        folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix=f"local_trainjob-{trainjob['metadata']['name']}-"))
        folder.mkdir(parents=True, exist_ok=True)
        self.jobset_manifest = write_stream(folder / f"{trainjob['metadata']['name']}-jobset.yaml",
                                            [*configmaps_of(documents), trainer_jobset(trainjob, runtime)])
        super().__init__(self.jobset_manifest, env, keep_volumes, configmaps, folder=folder, **kwargs)

    def _end(self, condition: str, reason: str) -> None:
        super()._end("Complete" if condition == "Completed" else condition, reason)


def runtime_of(trainjob: dict, documents: list[dict], path: Path) -> dict:
    """The runtime that spec.runtimeRef names (kind ClusterTrainingRuntime by default), from the stream."""
    ref = (trainjob.get("spec") or {}).get("runtimeRef") or {}
    kind = ref.get("kind", "ClusterTrainingRuntime")
    found = [d for d in documents if (d.get("apiVersion"), d.get("kind")) == (TRAINER_API, kind)
             and (d.get("metadata") or {}).get("name") == ref.get("name")]
    if kind not in RUNTIME_KINDS or len(found) != 1:
        raise BadInput(f"{path}: the TrainJob's runtimeRef names {kind} {ref.get('name')!r}, which the stream does "
                       "not hold once; put the runtime in the same stream (submit.py --engine trainjob does)")
    return found[0]


def controller_for(manifest: Path | str, *args, **kwargs):
    """IndexedJob, JobSetRun, PyTorchJobRun or TrainJobRun, by what the manifest's stream holds."""
    kinds = {(d.get("apiVersion"), d.get("kind")) for d in load_documents(Path(manifest))}
    if (TRAINER_API, "TrainJob") in kinds:
        return TrainJobRun(manifest, *args, **kwargs)
    if (JOBSET_API, "JobSet") in kinds:
        return JobSetRun(manifest, *args, **kwargs)
    if (PYTORCHJOB_API, "PyTorchJob") in kinds:
        return PyTorchJobRun(manifest, *args, **kwargs)
    return IndexedJob(manifest, *args, **kwargs)


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = local_pod.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--configmap", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--keep-volumes", metavar="DIR")
    parser.add_argument("manifest", type=Path)
    args = parser.parse_args(argv)
    try:
        env = dict(local_pod.key_value(text, "--env") for text in args.env)
        configmaps = dict(local_pod.key_value(text, "--configmap") for text in args.configmap)
        job = controller_for(args.manifest, env, args.keep_volumes, configmaps, echo=True)
        job.start()
    except local_pod.BadInput as error:
        log(str(error))
        return EXIT_BAD_INPUT
    for number in (signal.SIGTERM, signal.SIGINT):
        # Ctrl-C deletes the Job: each pod gets its terminationGracePeriodSeconds, as in a cluster.
        signal.signal(number, lambda *_: threading.Thread(target=job.stop, args=(job.grace + 5,),
                                                          daemon=True).start())
    while not job._finished.wait(0.5):
        pass
    if job.condition is None:
        log(f"Job {job.name} deleted; history {job.history}")
        return 1
    return 0 if job.condition[0] in ("Complete", "Completed", "Succeeded") else 1


if __name__ == "__main__":
    sys.exit(main())
