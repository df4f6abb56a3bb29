#!/usr/bin/env python3
"""Run an Indexed Job's pods side by side, locally, under the Job controller's rules.

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

Exit status of the command: 0 when the Job is Complete, 1 when it Failed, 64 for bad input.
Needs root, as local_pod.py does. Python API: IndexedJob (see its docstring).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import local_pod
import podlab

EXIT_BAD_INPUT = 64
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
            if self.echo:
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


class IndexedJob:
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
    echo: copy each pod's output to stdout, prefixed [index.attempt] (the command line does).
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
        self.history: list[tuple[int, int, str]] = []
        self.failures = 0
        self.condition: tuple[str, str] | None = None
        self._pods: dict[int, list[JobPod]] = {i: [] for i in range(self.size)}
        self._succeeded: set[int] = set()
        self._due: dict[int, float] = {}  # index -> when its replacement starts
        self._ending: tuple[str, str] | None = None
        self._lock = threading.RLock()
        self._new_pod = threading.Condition(self._lock)
        self._finished = threading.Event()
        self._stopping = threading.Event()
        self._controller: threading.Thread | None = None

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
        self._controller = threading.Thread(target=self._control, daemon=True)
        self._controller.start()
        return self

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
        """("Complete" | "Failed", reason) once the Job has finished and every pod has terminated."""
        if not self._finished.wait(timeout) or self.condition is None:
            tails = "\n".join(f"--- index {i}, pod {self.attempts(i)}:\n{self.pod(i).output[-2000:]}"
                              for i in range(self.size) if self.attempts(i))
            raise AssertionError(f"Job {self.name} not finished after {timeout}s; history {self.history}\n{tails}")
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

    def _start_pod(self, index: int) -> None:
        attempt = len(self._pods[index]) + 1
        pidfile = self.folder / f"{self.name}-{index}-attempt{attempt}.pid"
        command = [sys.executable, str(RUNNER), "--pidfile", str(pidfile), "--index", str(index),
                   "--pod-ip", self.ips[index]]
        command += [arg for name, ip in self.hosts for arg in ("--host", f"{name}={ip}")]
        command += [arg for name, path in self.configmaps.items() for arg in ("--configmap", f"{name}={path}")]
        if self.keep_volumes:
            command += ["--keep-volumes", str(self.keep_volumes)]
        command += [arg for key, value in self.env.items() for arg in ("--env", f"{key}={value}")]
        pod = JobPod(command + [str(self.manifest)], pidfile, podlab.tool_env(), index, attempt, self.echo)
        self._pods[index].append(pod)
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
                self._judge(index, pod)
        now = time.monotonic()
        for index, due in list(self._due.items()):
            if now >= due and not self._ending and not self._stopping.is_set():
                del self._due[index]
                self._start_pod(index)
        if self.deadline is not None and not self._ending and now - self.started_at > self.deadline:
            self._end("Failed", "DeadlineExceeded")
        running = any(p.exit_code() is None for pods in self._pods.values() for p in pods)
        if not running and (self._ending or self._stopping.is_set()):
            self.condition = self._ending
            self._finished.set()
            self._new_pod.notify_all()
            if self._ending:
                log(f"Job {self.name} {self._ending[0]}: {self._ending[1]}")

    def _judge(self, index: int, pod: JobPod) -> None:
        code = pod.exit_code()
        pod._reader.join(timeout=5)  # its last lines are read before anyone hears of its end
        if self._ending or self._stopping.is_set():
            self.history.append((index, code, "terminated"))
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

    def _end(self, condition: str, reason: str) -> None:
        """The Job has finished: no new pods, and every running one is deleted."""
        self._ending = (condition, reason)
        self._due.clear()
        for pods in self._pods.values():
            if pods and pods[-1].exit_code() is None:
                pods[-1].delete(disruption=False)


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
        job = IndexedJob(args.manifest, env, args.keep_volumes, configmaps, echo=True)
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
    return 0 if job.condition[0] == "Complete" else 1


if __name__ == "__main__":
    sys.exit(main())
