#!/usr/bin/env python3
"""Run a batch/v1 Job's pod locally, the way a container runtime and the kubelet would.

Usage:
    python lab/local_pod.py [--env KEY=VALUE]... [--pidfile FILE]
                                [--configmap NAME=DIR]... [--keep-volumes DIR]
                                [--index I] [--pod-ip 127.0.0.X] [--host NAME=127.0.0.Y]... job.yaml

One run is one pod: the first container of spec.template.spec runs as PID 1 of new PID, mount,
UTS and IPC namespaces, with the host's filesystem as its "image". Running it again is the Job's
next pod (restartPolicy is the Job's business). What a pod gets:

- a fresh pod name <job>-<5 chars> (HOSTNAME, hostname, metadata.name); fresh emptyDirs (0777);
  configMap volumes from a ConfigMap of that name in the manifest's own YAML stream (as
  `kubectl apply -f` of the stream creates it), else rendered by `kubectl create configmap NAME
  --from-file=DIR --dry-run=client` from --configmap NAME=DIR, else from the job/ folder next to
  job.yaml; env secretKeyRef from a Secret (data or stringData) of the stream; volumeMounts with
  subPath and readOnly; a private /tmp (read-only too under readOnlyRootFilesystem, as in a
  real container) and a private 64Mi /dev/shm;
- an image's user database: /etc/passwd and /etc/group as an Ubuntu-based image such as
  pytorch/pytorch ships them (root, system users, nobody), with no entry for runAsUser, as on a
  cluster; the host's own entry for that uid (if any) is not seen;
- emptyDir sizeLimit on disk enforced as the kubelet's eviction manager does: usage polled every
  few seconds, a pod over a limit is evicted (SIGTERM, SIGKILL after 1 s, whatever its grace
  period) and reported as failed with reason Evicted and no DisruptionTarget condition;
- securityContext: runAsUser/runAsGroup/fsGroup/supplementalGroups, runAsNonRoot,
  allowPrivilegeEscalation, capabilities, privileged, readOnlyRootFilesystem (every mount of the
  host under /, the "image", is read-only, not only / itself; the pod's volumes, /proc, /dev and
  its /dev/shm, /dev/pts and the kubelet's /etc/hosts stay writable, as in a container);
- only the environment a container gets: PATH (the runner's), HOSTNAME, env/envFrom, then --env;
- exec probes (startup, liveness, readiness) on the kubelet's schedule, run inside the pod (a
  startup probe's failures are said only when they kill the container: a starting pod fails it);
- deletion: SIGTERM/SIGINT to the runner = SIGTERM to PID 1, SIGKILL after the grace period
  (a second signal kills at once); pod-level activeDeadlineSeconds;
- with --index I, what the Job controller gives a pod of an Indexed Job: the name <job>-I-<5 chars>,
  the hostname <job>-I (spec.hostname; HOSTNAME too), the annotation and label
  batch.kubernetes.io/job-completion-index=I and JOB_COMPLETION_INDEX=I (refused, exit 64, on a
  Job that is not Indexed or for an I outside [0, completions)). lab/local_job.py runs all of them;
- --pod-ip (status.podIP, default 127.0.0.1) and the kubelet's /etc/hosts: "<ip> <hostname>" or,
  with spec.subdomain, "<ip> <hostname>.<subdomain>.<namespace>.svc.cluster.local <hostname>";
  each --host NAME=IP adds a line, standing in for the cluster DNS (there is none here: glibc
  resolves through the pod's /etc/hosts, "hosts: files dns"). Both take loopback addresses only.

The container's output goes straight to the runner's stdout/stderr; the runner's own lines go to
stderr, prefixed "local_pod: ". Exit status: the container's (128+N when killed by signal N),
128 when the container could not start, 64 for bad input. Needs root (namespaces, mounts).

Not supported (exit 64 where the manifest asks for it): volume types other than emptyDir and
configMap, init containers, httpGet/tcpSocket/grpc probes, required Secrets that the stream does
not hold (use --env), envFrom of a Secret (only optional ones, skipped). Sidecar
containers are ignored (only the first container runs). No network namespace: the pod shares the
host's network, on its own address in 127.0.0.0/8 (all of it is on lo), so ports are shared: two
pods binding 0.0.0.0:29400 collide, where in a cluster each pod has its own; a pod binding its
own --pod-ip does not, and any pod can reach any other's ports (no NetworkPolicy). The names
--host gives resolve only by exact name (no DNS search path, no SRV records, no Service). No
cgroups: resources (cpu, memory, ephemeral-storage, nvidia.com/gpu) are accepted and ignored.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import ipaddress
import os
import posixpath
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.append(str(Path(__file__).resolve().parents[1] / "job"))  # after the libraries: job/ names no shadow
from contract import EXIT_BAD_INPUT  # noqa: E402 - the exit codes' one definition

EXIT_START_ERROR = 128  # what the kubelet reports when a container cannot start
POD_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the Job controller's: no vowels, no look-alikes
SHM_SIZE = "64m"  # the container runtime's default /dev/shm
# The kubelet's eviction manager checks every 10 s on volume stats up to a minute old
# (evictionMonitoringPeriod, volumeStatsAggPeriod); polling more often only makes tests quicker.
STORAGE_POLL_SECONDS = 2
EVICTION_GRACE_SECONDS = 1  # the kubelet's immediateEvictionGracePeriodSeconds for local storage
# /etc/passwd and /etc/group of an Ubuntu 22.04 image (pytorch/pytorch's base): no user 1000.
IMAGE_PASSWD = """\
root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
bin:x:2:2:bin:/bin:/usr/sbin/nologin
sys:x:3:3:sys:/dev:/usr/sbin/nologin
sync:x:4:65534:sync:/bin:/bin/sync
games:x:5:60:games:/usr/games:/usr/sbin/nologin
man:x:6:12:man:/var/cache/man:/usr/sbin/nologin
lp:x:7:7:lp:/var/spool/lpd:/usr/sbin/nologin
mail:x:8:8:mail:/var/mail:/usr/sbin/nologin
news:x:9:9:news:/var/spool/news:/usr/sbin/nologin
uucp:x:10:10:uucp:/var/spool/uucp:/usr/sbin/nologin
proxy:x:13:13:proxy:/bin:/usr/sbin/nologin
www-data:x:33:33:www-data:/var/www:/usr/sbin/nologin
backup:x:34:34:backup:/var/backups:/usr/sbin/nologin
list:x:38:38:Mailing List Manager:/var/list:/usr/sbin/nologin
irc:x:39:39:ircd:/run/ircd:/usr/sbin/nologin
gnats:x:41:41:Gnats Bug-Reporting System (admin):/var/lib/gnats:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
_apt:x:100:65534::/nonexistent:/usr/sbin/nologin
"""
IMAGE_GROUP = "".join(f"{name}:x:{gid}:\n" for name, gid in (
    ("root", 0), ("daemon", 1), ("bin", 2), ("sys", 3), ("adm", 4), ("tty", 5), ("disk", 6), ("lp", 7),
    ("mail", 8), ("news", 9), ("uucp", 10), ("man", 12), ("proxy", 13), ("kmem", 15), ("dialout", 20),
    ("cdrom", 24), ("sudo", 27), ("audio", 29), ("www-data", 33), ("backup", 34), ("operator", 37),
    ("list", 38), ("irc", 39), ("src", 40), ("gnats", 41), ("shadow", 42), ("utmp", 43), ("video", 44),
    ("plugdev", 46), ("staff", 50), ("games", 60), ("users", 100), ("nogroup", 65534)))
# Kernel filesystems a container runtime mounts writable whatever readOnlyRootFilesystem says.
RUNTIME_WRITABLE = ("/proc", "/dev")
# The container runtime's default capabilities; a pod does not get all of root's.
DEFAULT_CAPS = ("CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP NET_BIND_SERVICE "
                "NET_RAW SYS_CHROOT MKNOD AUDIT_WRITE SETFCAP").split()

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID = 0x20000, 0x4000000, 0x8000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)


class BadInput(Exception):
    """Bad input: the message names the cause and the fix."""


def log(message: str) -> None:
    # One unbuffered write: safe from the signal handler and from several threads at once.
    os.write(2, f"local_pod: {message}\n".encode(errors="replace"))


# ---------------------------------------------------------------- the parsed pod


@dataclass
class Volume:
    name: str
    kind: str  # emptyDir | configMap
    tmpfs_size: int | None = None  # set (0 = unlimited) for emptyDir medium: Memory
    size_limit: str | None = None  # on disk: the sizeLimit as written, enforced by eviction
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # configMap: path -> (data, mode)


@dataclass
class Mount:
    volume: str
    path: str
    sub_path: str = ""
    read_only: bool = False


@dataclass
class Security:
    uid: int | None = None
    gid: int | None = None
    groups: list[int] = field(default_factory=list)
    fs_group: int | None = None
    no_new_privs: bool = False
    privileged: bool = False
    caps: list[str] = field(default_factory=list)  # the bounding set
    read_only_root: bool = False


@dataclass
class Probe:
    kind: str  # Startup | Liveness | Readiness
    command: list[str]
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int
    grace: float | None  # probe-level terminationGracePeriodSeconds


@dataclass
class Pod:
    name: str
    command: list[str]
    env: dict[str, str]
    working_dir: str
    volumes: dict[str, Volume]
    mounts: list[Mount]
    security: Security
    probes: list[Probe]
    grace: float
    active_deadline: float | None
    hostname: str = ""  # spec.hostname (an Indexed Job's <job>-<index>); else the pod name
    ip: str = "127.0.0.1"  # status.podIP: a loopback address, the host's network is shared
    domain: str = ""  # <subdomain>.<namespace>.svc.cluster.local when spec.subdomain is set
    host_aliases: list[tuple[str, str]] = field(default_factory=list)  # (name, ip): the peers' DNS


# ---------------------------------------------------------------- reading job.yaml


def load_job(path: Path) -> dict:
    return load_stream(path)[0]


def load_stream(path: Path) -> tuple[dict, dict[str, dict[str, bytes]]]:
    """The one batch/v1 Job of a manifest (a YAML stream may hold more), and the stream's
    ConfigMaps by name (what `kubectl apply -f` of the whole stream would create)."""
    if not path.is_file():
        raise BadInput(f"{path}: no such file; pass the path of a batch/v1 Job manifest")
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except yaml.YAMLError as error:
        raise BadInput(f"{path}: not valid YAML ({' '.join(str(error).split())}); fix the file")
    docs = [d for d in docs if isinstance(d, dict)]
    jobs = [d for d in docs if (d.get("apiVersion"), d.get("kind")) == ("batch/v1", "Job")]
    if len(jobs) != 1:
        kinds = ", ".join(f"{d.get('apiVersion')}/{d.get('kind')}" for d in docs) or "nothing"
        raise BadInput(f"{path}: expected one batch/v1 Job, found {kinds}; pass a Job manifest")
    configmaps = {(d.get("metadata") or {}).get("name"): configmap_data(d)
                  for d in docs if (d.get("apiVersion"), d.get("kind")) == ("v1", "ConfigMap")}
    return jobs[0], configmaps


def stream_secrets(path: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets of a manifest's stream by name (what `kubectl apply -f` of it would create)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    return {(d.get("metadata") or {}).get("name"): secret_data(d)
            for d in docs if (d.get("apiVersion"), d.get("kind")) == ("v1", "Secret")}


def secret_data(secret: dict) -> dict[str, bytes]:
    data = {key: base64.b64decode(blob) for key, blob in (secret.get("data") or {}).items()}
    data.update({key: str(text).encode() for key, text in (secret.get("stringData") or {}).items()})
    return data


def configmap_data(configmap: dict) -> dict[str, bytes]:
    data = {key: str(text).encode() for key, text in (configmap.get("data") or {}).items()}
    data.update({key: base64.b64decode(blob) for key, blob in (configmap.get("binaryData") or {}).items()})
    return data


def pod_name_for(job_meta: dict, index: int | None = None) -> tuple[str, str]:
    job_name = job_meta.get("name") or ""
    if not job_name and job_meta.get("generateName"):
        job_name = job_meta["generateName"] + random_suffix()
    if not job_name:
        raise BadInput("the Job has no metadata.name; give it one")
    # The Job controller's generateName: "<job>-" or, for an Indexed Job, "<job>-<index>-".
    base = job_name if index is None else f"{job_name}-{index}"
    return job_name, f"{base}-{random_suffix()}"


def check_index(job: dict, index: int | None) -> None:
    """--index is the completion index the Job controller gives each pod of an Indexed Job."""
    if index is None:
        return
    spec = job.get("spec") or {}
    if spec.get("completionMode") != "Indexed":
        raise BadInput(f"--index {index}: the Job is not Indexed (spec.completionMode is "
                       f"{spec.get('completionMode', 'NonIndexed')}); drop --index or make it Indexed")
    completions = spec.get("completions")
    if type(completions) is not int or not 0 <= index < completions:
        raise BadInput(f"--index {index} is outside [0, {completions}) (spec.completions); "
                       "pass an index the Job has")


def loopback_ip(text: str, what: str) -> str:
    """The pods share the host's network, so a pod's address must be one of lo's (127.0.0.0/8)."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        address = None
    if address is None or not address.is_loopback:
        raise BadInput(f"{what} {text!r} is not a loopback address; use one in 127.0.0.0/8, "
                       "e.g. 127.0.0.10 (the pods share the host's network)")
    return str(address)


def host_alias(text: str) -> tuple[str, str]:
    name, sep, ip = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?", name):
        raise BadInput(f"--host {text.split('=')[0]!r} is not NAME=IP with a DNS name; "
                       "write it as --host r1-0.r1=127.0.0.10")
    return name, loopback_ip(ip, f"--host {name}:")


def random_suffix() -> str:
    return "".join(secrets.choice(POD_NAME_ALPHABET) for _ in range(5))


def quantity_bytes(value) -> int | None:
    """Kubernetes quantity ("512Mi", "1G", 1024) to bytes."""
    if value is None:
        return None
    match = re.fullmatch(r"([0-9.]+)([KMGTPE]i|[kMGTPE]|)", str(value))
    if not match:
        raise BadInput(f"sizeLimit {value!r} is not a Kubernetes quantity; use e.g. 512Mi")
    powers = "KMGTPE"
    unit = match.group(2)
    if unit.endswith("i"):
        scale = 1024 ** (powers.index(unit[0]) + 1)
    else:
        scale = 1000 ** (powers.index(unit.upper()) + 1) if unit else 1
    return int(float(match.group(1)) * scale)


class ConfigMaps:
    """Where each ConfigMap lives locally, rendered once by the real kubectl."""

    def __init__(self, explicit: dict[str, Path], default_dir: Path,
                 inline: dict[str, dict[str, bytes]] | None = None,
                 secrets: dict[str, dict[str, bytes]] | None = None):
        self.explicit, self.default_dir, self.cache = explicit, default_dir, {}
        self.inline = inline or {}  # ConfigMaps in the manifest's own stream: used first
        self.secrets = secrets or {}  # the stream's Secrets: the only ones there are here

    def data(self, name: str, optional: bool, use_default: bool = True) -> dict[str, bytes] | None:
        if name in self.inline:
            return self.inline[name]
        directory = self.explicit.get(name) or (self.default_dir if use_default else None)
        if directory is None or not directory.is_dir():
            if optional:
                return None
            where = f"directory {directory} not found" if directory else "no local directory for it"
            raise BadInput(f"ConfigMap {name!r}: {where}; pass --configmap {name}=DIR")
        if name not in self.cache:
            self.cache[name] = render_configmap(name, directory)
        return self.cache[name]


def render_configmap(name: str, directory: Path) -> dict[str, bytes]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        raise BadInput(f"ConfigMap {name!r} needs kubectl, which is not on PATH; put it there")
    result = subprocess.run(
        [kubectl, "create", "configmap", name, f"--from-file={directory}", "--dry-run=client", "-o", "yaml"],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        detail = " ".join(result.stderr.split())[:300]
        raise BadInput(f"kubectl could not render ConfigMap {name!r} from {directory}: {detail}; "
                       "fix that directory")
    rendered = yaml.safe_load(result.stdout) or {}
    data = {key: text.encode() for key, text in (rendered.get("data") or {}).items()}
    data.update({key: base64.b64decode(blob) for key, blob in (rendered.get("binaryData") or {}).items()})
    return data


def check_relative(path: str, what: str) -> str:
    if path.startswith("/") or ".." in path.split("/"):
        raise BadInput(f"{what} {path!r} must be a relative path without '..'; fix the manifest")
    return path


def parse_volume(spec: dict, configmaps: ConfigMaps) -> Volume:
    name = spec["name"]
    if "emptyDir" in spec:
        empty_dir = spec["emptyDir"] or {}
        size = quantity_bytes(empty_dir.get("sizeLimit"))
        if empty_dir.get("medium") == "Memory":
            return Volume(name, "emptyDir", tmpfs_size=size or 0)
        return Volume(name, "emptyDir", size_limit=str(empty_dir["sizeLimit"]) if size else None)
    if "configMap" in spec:
        source = spec["configMap"]
        optional = bool(source.get("optional"))
        data = configmaps.data(source["name"], optional) or {}
        mode = source.get("defaultMode", 0o644)
        items = source.get("items") or [{"key": key, "path": key} for key in sorted(data)]
        files = {}
        for item in items:
            if item["key"] not in data:
                if optional:
                    continue
                raise BadInput(f"volume {name!r}: ConfigMap {source['name']!r} has no key {item['key']!r}; "
                               "add the file or fix items")
            path = check_relative(item["path"], f"volume {name!r} item path")
            files[path] = (data[item["key"]], item.get("mode", mode))
        return Volume(name, "configMap", files=files)
    kinds = ", ".join(k for k in spec if k != "name")
    raise BadInput(f"volume {name!r}: type {kinds} is not supported (emptyDir and configMap are); "
                   "change the manifest or run it on a cluster")


def parse_mounts(container: dict, volumes: dict[str, Volume], env: dict[str, str]) -> list[Mount]:
    mounts = []
    for spec in container.get("volumeMounts") or []:
        if spec["name"] not in volumes:
            raise BadInput(f"volumeMount {spec['mountPath']}: no volume named {spec['name']!r}; "
                           "add it to volumes")
        sub_path = spec.get("subPath") or expand(spec.get("subPathExpr", ""), env)
        mounts.append(Mount(
            volume=spec["name"],
            path=posixpath.normpath(spec["mountPath"]),
            sub_path=check_relative(sub_path, "subPath") if sub_path else "",
            # The kubelet mounts configMap volumes read-only whatever the mount says.
            read_only=bool(spec.get("readOnly")) or volumes[spec["name"]].kind == "configMap",
        ))
    return mounts


def parse_security(pod_spec: dict, container: dict) -> Security:
    # seccompProfile, appArmorProfile, seLinuxOptions: accepted and ignored; no LSM/seccomp setup here.
    pod_context = pod_spec.get("securityContext") or {}
    context = container.get("securityContext") or {}

    def pick(key):  # the container's setting wins over the pod's
        return context.get(key, pod_context.get(key))

    uid = pick("runAsUser")
    if pick("runAsNonRoot") and not uid:
        raise BadInput("runAsNonRoot is set but the container would run as root; set runAsUser")
    fs_group = pod_context.get("fsGroup")
    groups = ([fs_group] if fs_group is not None else []) + list(pod_context.get("supplementalGroups") or [])
    capabilities = context.get("capabilities") or {}
    drop = {c.upper().removeprefix("CAP_") for c in capabilities.get("drop") or []}
    add = {c.upper().removeprefix("CAP_") for c in capabilities.get("add") or []}
    caps = set() if "ALL" in drop else set(DEFAULT_CAPS) - drop
    return Security(
        uid=uid, gid=pick("runAsGroup"), groups=groups, fs_group=fs_group,
        no_new_privs=context.get("allowPrivilegeEscalation") is False,
        privileged=bool(context.get("privileged")) or "ALL" in add,
        caps=sorted(caps | add), read_only_root=bool(context.get("readOnlyRootFilesystem")),
    )


def parse_probe(kind: str, spec: dict) -> Probe:
    if "exec" not in spec:
        handler = ", ".join(k for k in spec if k in ("httpGet", "tcpSocket", "grpc")) or "this"
        raise BadInput(f"{kind} probe: {handler} probes are not supported, only exec; use an exec probe")
    return Probe(
        kind, [str(a) for a in spec["exec"]["command"]],
        initial_delay=spec.get("initialDelaySeconds", 0), period=spec.get("periodSeconds", 10),
        timeout=spec.get("timeoutSeconds", 1), success_threshold=spec.get("successThreshold", 1),
        failure_threshold=spec.get("failureThreshold", 3), grace=spec.get("terminationGracePeriodSeconds"),
    )


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: $$ escapes, unknown references stay as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i + 2:]:
            end = text.index(")", i + 2)
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def field_value(path: str, facts: dict[str, str], meta: dict) -> str:
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    if path not in facts:
        raise BadInput(f"env fieldRef {path!r} is not supported; use one of {', '.join(facts)}")
    return facts[path]


def container_env(container: dict, facts: dict, meta: dict, configmaps: ConfigMaps,
                  overrides: dict[str, str]) -> dict[str, str]:
    """The manifest's env (envFrom, then env, expanded in order), with --env values in their place."""
    defined: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref = source["configMapRef"]
            # Only an explicit --configmap: the job/ folder's files are volume contents, not env.
            data = configmaps.data(ref["name"], bool(ref.get("optional")), use_default=False) or {}
            valid = (key for key in data if re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", key))
            defined.update({prefix + key: data[key].decode(errors="replace") for key in valid})
        elif not source.get("secretRef", {}).get("optional"):
            raise BadInput("envFrom secretRef cannot be read locally; pass its keys with --env KEY=VALUE "
                           "or mark it optional")
    for item in container.get("env") or []:
        name = item["name"]
        if name in overrides:
            defined[name] = overrides[name]  # literal: a credential may contain "$("
            continue
        value = env_item_value(item, facts, meta, configmaps, defined)
        if value is not None:
            defined[name] = value
    defined.update(overrides)
    return defined


def env_item_value(item: dict, facts: dict, meta: dict, configmaps: ConfigMaps, defined: dict) -> str | None:
    if "valueFrom" not in item:
        return expand(str(item.get("value", "")), defined)
    source, name = item["valueFrom"], item["name"]
    if "fieldRef" in source:
        return field_value(source["fieldRef"]["fieldPath"], facts, meta)
    for kind in ("secretKeyRef", "configMapKeyRef"):
        ref = source.get(kind)
        if ref is None:
            continue
        optional = bool(ref.get("optional"))
        data = configmaps.data(ref["name"], optional) if kind == "configMapKeyRef" else configmaps.secrets.get(ref["name"])
        if data is not None and ref["key"] in data:
            return data[ref["key"]].decode(errors="replace")
        if optional:
            return None
        raise BadInput(f"env {name} comes from {kind} {ref['name']}/{ref['key']}, which is not available "
                       f"locally; pass --env {name}=VALUE or mark it optional")
    raise BadInput(f"env {name}: valueFrom {', '.join(source)} is not supported; pass --env {name}=VALUE")


def load_pod(job_path: Path, overrides: dict[str, str], configmap_dirs: dict[str, Path],
             index: int | None = None, pod_ip: str = "127.0.0.1",
             host_aliases: list[tuple[str, str]] | None = None) -> Pod:
    """The pod the Job's controller and the kubelet would make; `index` for a pod of an Indexed
    Job, `pod_ip` its (loopback) address, `host_aliases` the peers' names the cluster DNS answers."""
    job, stream_configmaps = load_stream(job_path)
    check_index(job, index)
    pod_ip = loopback_ip(pod_ip, "--pod-ip")
    template = (job.get("spec") or {}).get("template") or {}
    pod_spec = template.get("spec") or {}
    containers = [dict(c) for c in pod_spec.get("containers") or []]
    if not containers:
        raise BadInput(f"{job_path}: spec.template.spec.containers is empty; add a container")
    if pod_spec.get("initContainers"):
        raise BadInput("initContainers are not supported; move their work into the container's command")
    if len(containers) > 1:
        log(f"only the first container ({containers[0].get('name')}) runs; the others are ignored")
    container = containers[0]  # its resources (cpu, memory, nvidia.com/gpu) are ignored: no cgroups here
    job_name, pod_name = pod_name_for(job.get("metadata") or {}, index)
    namespace = (job.get("metadata") or {}).get("namespace", "default")
    # The Job controller names each pod of an Indexed Job <job>-<index> (spec.hostname), whether
    # or not a subdomain makes that name resolvable; the kubelet gives the pod its FQDN with one.
    hostname = f"{job_name}-{index}" if index is not None else pod_spec.get("hostname", "")
    subdomain = pod_spec.get("subdomain")
    facts = {
        "metadata.name": pod_name,
        "metadata.namespace": namespace,
        "metadata.uid": str(uuid.uuid4()),
        "spec.nodeName": socket.gethostname(),
        "spec.serviceAccountName": pod_spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,  # an address of the host's loopback: the network is shared
        "status.hostIP": "127.0.0.1",
    }
    meta = dict(template.get("metadata") or {})
    job_labels = {"job-name": job_name, "batch.kubernetes.io/job-name": job_name}
    meta["labels"] = {**(meta.get("labels") or {}), **job_labels}
    if index is not None:
        mark_completion_index(meta, container, index)
    configmaps = ConfigMaps(configmap_dirs, job_path.resolve().parent / "job", stream_configmaps,
                            stream_secrets(job_path))
    manifest_env = container_env(container, facts, meta, configmaps, overrides)
    # The host is the image, so its PATH is the image's PATH.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOSTNAME": hostname or pod_name, **manifest_env}
    volumes = {v["name"]: parse_volume(v, configmaps) for v in pod_spec.get("volumes") or []}
    probes = [parse_probe(kind, container[f"{kind.lower()}Probe"])
              for kind in ("Startup", "Liveness", "Readiness") if container.get(f"{kind.lower()}Probe")]
    words = (container.get("command") or []) + (container.get("args") or [])
    command = [expand(str(word), manifest_env) for word in words]
    if not command:
        raise BadInput("the container has no command; the host is the image here, so give it a command")
    return Pod(
        name=pod_name, command=command, env=env, working_dir=container.get("workingDir") or "/",
        volumes=volumes, mounts=parse_mounts(container, volumes, manifest_env),
        security=parse_security(pod_spec, container), probes=probes,
        grace=pod_spec.get("terminationGracePeriodSeconds", 30),
        active_deadline=pod_spec.get("activeDeadlineSeconds"),
        hostname=hostname, ip=pod_ip,
        domain=f"{subdomain}.{namespace}.svc.cluster.local" if subdomain else "",
        host_aliases=list(host_aliases or []),
    )


def mark_completion_index(meta: dict, container: dict, index: int) -> None:
    """What the Job controller adds to each pod of an Indexed Job: the annotation, the label, and
    JOB_COMPLETION_INDEX from the annotation (appended, unless the container defines it itself)."""
    key = "batch.kubernetes.io/job-completion-index"
    meta["annotations"] = {**(meta.get("annotations") or {}), key: str(index)}
    meta["labels"] = {**meta["labels"], key: str(index)}
    env = list(container.get("env") or [])
    if not any(item.get("name") == "JOB_COMPLETION_INDEX" for item in env):
        env.append({"name": "JOB_COMPLETION_INDEX",
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}})
    container["env"] = env


# ---------------------------------------------------------------- volumes on the host


def write_volumes(pod: Pod, pod_dir: Path) -> None:
    """Every volume becomes a folder under pod_dir/volumes; the container sees them via bind mounts."""
    fs_group = pod.security.fs_group
    for volume in pod.volumes.values():
        directory = pod_dir / "volumes" / volume.name
        directory.mkdir(parents=True)
        directory.chmod(0o755)  # whatever the runner's umask: any runAsUser must read a configMap
        if volume.kind == "emptyDir":
            directory.chmod(0o777)  # the kubelet's mode: any runAsUser may write
            if fs_group is not None:
                os.chown(directory, 0, fs_group)
                directory.chmod(0o2777)
        for relative, (data, mode) in volume.files.items():
            path = directory / relative
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(mode)
            if fs_group is not None:
                os.chown(path, 0, fs_group)
    private_tmp = pod_dir / "tmp"
    private_tmp.mkdir()
    private_tmp.chmod(0o1777)
    for name, text in (("passwd", IMAGE_PASSWD), ("group", IMAGE_GROUP)):
        (pod_dir / name).write_text(text)
        (pod_dir / name).chmod(0o644)
    (pod_dir / "hosts").write_text(hosts_file(pod))


def hosts_file(pod: Pod) -> str:
    """The kubelet's /etc/hosts: the pod's own name resolves (torchrun needs it), as
    <ip> <hostname>.<subdomain>.<namespace>.svc.cluster.local <hostname> with a subdomain. The
    runner has no DNS server: the peers' names (--host) go here too, grouped by address as the
    kubelet writes hostAliases, so glibc ("hosts: files dns") answers what the cluster DNS would."""
    hostname = pod_hostname(pod)
    names = f"{hostname}.{pod.domain}\t{hostname}" if pod.domain else hostname
    text = ("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"
            f"::1\tlocalhost ip6-localhost ip6-loopback\n{pod.ip}\t{names}\n")
    by_ip: dict[str, list[str]] = {}
    for name, ip in pod.host_aliases:
        by_ip.setdefault(ip, []).append(name)
    if by_ip:
        text += "\n# What the cluster DNS would answer (local_pod.py --host).\n"
        text += "".join(f"{ip}\t{chr(9).join(names)}\n" for ip, names in by_ip.items())
    return text


def image_paths_under_mounts(pod: Pod) -> list[str]:
    """The "image" here is the host: the container's PATH entries (for a venv, the whole venv) that
    a volume mounted over a parent would hide, e.g. a checkout under /tmp. A real image's files are
    never inside its own volumes, so they are bound back on top."""
    targets = [m.path for m in pod.mounts] + ["/tmp", "/dev/shm"]
    kept = []
    for entry in pod.env.get("PATH", "").split(os.pathsep):
        if not entry.startswith("/") or not os.path.isdir(entry):
            continue
        root = os.path.realpath(entry)
        parent = os.path.dirname(root)
        if os.path.exists(os.path.join(parent, "pyvenv.cfg")):
            root = parent
        if any(root == t or root.startswith(t.rstrip("/") + "/") for t in targets) and root not in kept:
            kept.append(root)
    return kept


def pod_hostname(pod: Pod) -> str:
    return pod.hostname or pod.name[:63].rstrip("-.")


def volume_source(pod: Pod, mount: Mount) -> str:
    """Relative to the pod folder (the setup runs there), so a mount over /tmp cannot hide it."""
    base = f"volumes/{mount.volume}"
    return posixpath.join(base, mount.sub_path) if mount.sub_path else base


def planned_mounts(pod: Pod) -> list[tuple[str, str, str]]:
    """(source, target, tmpfs options or "") in mount order: parents before children."""
    targets = {m.path for m in pod.mounts}
    plan = [(volume_source(pod, m), m.path, "") for m in pod.mounts]
    if "/tmp" not in targets:  # a container has its own rootfs, so its own /tmp
        plan.append(("tmp", "/tmp", ""))
    for name in ("hosts", "passwd", "group"):
        if f"/etc/{name}" not in targets:
            plan.append((name, f"/etc/{name}", ""))
    if "/dev/shm" not in targets and os.path.isdir("/dev/shm"):
        plan.append(("shm", "/dev/shm", f"mode=1777,size={SHM_SIZE}"))
    return sorted(plan, key=lambda step: len(Path(step[1]).parts))


# ---------------------------------------------------------------- inside the new namespaces


def syscall_check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, options: str = "") -> None:
    def encode(text):
        return text.encode() if text else None

    result = LIBC.mount(
        encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(options)
    )
    syscall_check(result, f"mount {source or fstype} on {target}")


def remount_read_only(target: str) -> None:
    # A bind remount changes only this mount point, never the filesystem: the host stays writable.
    kept = os.statvfs(target).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def mount_points() -> list[str]:
    """Every mount point this mount namespace sees, in mount order."""
    points = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = unescape_mount_point(line.split()[4])
            if point not in points:
                points.append(point)
    return points


def unescape_mount_point(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in a path as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def read_only_root_targets(points: list[str], volume_paths: set[str]) -> list[str]:
    """readOnlyRootFilesystem: the host's mounts under / are all the image's root filesystem here, so
    every one becomes read-only, not only / itself. What a container keeps writable stays so: its
    writable volumes, the kernel filesystems (/proc, /dev with /dev/shm and /dev/pts) and the
    kubelet's /etc/hosts."""
    def under(path, top):
        return path == top or path.startswith(top.rstrip("/") + "/")

    writable = volume_paths | {"/etc/hosts"}
    return [p for p in points if p not in writable and not any(under(p, top) for top in RUNTIME_WRITABLE)]


def make_root_read_only(pod: Pod) -> None:
    for point in read_only_root_targets(mount_points(), {m.path for m in pod.mounts if not m.read_only}):
        try:
            remount_read_only(point)
        except FileNotFoundError:  # hidden under a later mount: nothing there to write
            continue


def make_mount_point(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(posixpath.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()


def setup_container(pod: Pod, pod_dir: Path) -> None:
    """Runs in the forked child, PID 1 of the new PID namespace, just before exec."""
    try:
        LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # the runner gone = the node gone
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
            signal.signal(number, signal.SIG_DFL)
        syscall_check(LIBC.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC), "unshare")
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        socket.sethostname(pod_hostname(pod))
        os.umask(0o022)  # a container runtime's umask, whatever the runner's
        # Relative sources resolve from this working directory even once /tmp is covered.
        os.chdir(pod_dir)
        # Opened before the volumes cover them, to be bound back on top afterwards.
        image_paths = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in image_paths_under_mounts(pod)]
        for volume in pod.volumes.values():
            if volume.tmpfs_size is not None:
                size = f",size={volume.tmpfs_size}" if volume.tmpfs_size else ""
                mount("tmpfs", f"volumes/{volume.name}", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0777{size}")
        read_only = {m.path for m in pod.mounts if m.read_only}
        for source, target, tmpfs_options in planned_mounts(pod):
            if tmpfs_options:
                mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs_options)
                continue
            if not os.path.exists(source):  # a missing subPath is created, as the kubelet does
                os.makedirs(source)
            make_mount_point(source, target)
            mount(source, target, None, MS_BIND)
        for path, fd in image_paths:
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            remount_read_only(path)
            os.close(fd)
        os.makedirs(pod.working_dir, exist_ok=True)
        # Read-only last, so mount points inside read-only mounts could still be created.
        for target in sorted(read_only, key=len, reverse=True):
            remount_read_only(target)
        if pod.security.read_only_root:
            make_root_read_only(pod)
        os.chdir(pod.working_dir)
        if not shutil.which(pod.command[0], path=pod.env.get("PATH")):
            raise OSError(f"executable file not found in $PATH: {pod.command[0]}")
    except BaseException as error:  # report, then end like a container that failed to start
        os.write(2, f"local_pod: container start failed: {error}\n".encode())
        os._exit(EXIT_START_ERROR)


def disk_usage(folder: Path) -> int:
    """Bytes of disk a folder takes, as `du -sx` (the kubelet's measure of an emptyDir) counts them:
    allocated blocks, each hard-linked file once, no symlinks followed."""
    seen, total, pending = set(), 0, [str(folder)]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:  # removed meanwhile, or not readable: as du, count what can be read
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
    return total


def setpriv_args(security: Security) -> list[str]:
    args = [shutil.which("setpriv") or "setpriv", "--pdeathsig", "keep"]
    if security.uid is not None:
        args += ["--reuid", str(security.uid)]
    if security.gid is not None:
        args += ["--regid", str(security.gid)]
    args += ["--groups", ",".join(map(str, security.groups))] if security.groups else ["--clear-groups"]
    if security.no_new_privs:
        args.append("--no-new-privs")
    if not security.privileged:
        caps = "".join(f",+{c.lower()}" for c in security.caps)
        args += ["--bounding-set", f"-all{caps}", "--inh-caps", "-all"]
    return args + ["--"]


# ---------------------------------------------------------------- running the pod


class PodRunner:
    def __init__(self, pod: Pod, pod_dir: Path, pidfile: str | None):
        self.pod, self.pod_dir, self.pidfile = pod, pod_dir, pidfile
        self.proc: subprocess.Popen | None = None
        self.lock = threading.RLock()  # the signal handler may interrupt its own thread holding it
        self.pending_deletion: tuple[str, float] | None = None
        self.terminating = False
        self.stopped = threading.Event()  # the container is being killed or has exited
        self.exited = threading.Event()
        self.spawned = threading.Event()  # Popen returned: the container runs, or could not start
        self.exit_code = EXIT_START_ERROR
        self.started = threading.Event()  # the startup probe has succeeded (or there is none)
        self.eviction: str | None = None  # why the kubelet's eviction manager evicted the pod

    def run(self) -> int:
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self.on_signal)
        log(f"pod {self.pod.name}: starting")
        container = threading.Thread(target=self.run_container, daemon=True)
        container.start()
        while not self.spawned.wait(0.2):  # short waits keep this thread free for signal handlers
            pass
        if self.proc is not None:
            self.on_container_started()
        while container.is_alive():
            container.join(0.2)
        if self.eviction:
            log(f"pod {self.pod.name} failed: reason Evicted, no DisruptionTarget condition "
                f"(counts against the Job's backoffLimit): {self.eviction}")
        log(f"exit code {self.exit_code}")
        return self.exit_code

    def run_container(self) -> None:
        """PID 1's parent, in a thread of its own.

        The runner itself is PID 1's parent, so it sees the real exit status (unshare(1) --fork
        loses signal deaths) and passes the env exactly (a setup shell would add and drop some).
        unshare(CLONE_NEWPID) only moves this thread's future children into the new namespace; a
        thread in that state cannot start threads, so the probes and timers start elsewhere.
        This thread lives until PID 1 ends: PID 1's parent-death signal is tied to it.
        """
        try:
            syscall_check(LIBC.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
            self.proc = subprocess.Popen(
                setpriv_args(self.pod.security) + self.pod.command, env=self.pod.env,
                stdin=subprocess.DEVNULL, start_new_session=True,  # so Ctrl-C reaches only the runner
                preexec_fn=lambda: setup_container(self.pod, self.pod_dir),
            )
            if self.pidfile:  # as soon as PID 1 exists: SIGKILL on it simulates a lost node
                write_atomically(Path(self.pidfile), f"{self.proc.pid}\n")
        except OSError as error:
            log(f"cannot start the pod ({error}); run as root on Linux with util-linux")
            self.exit_code = EXIT_BAD_INPUT
            return
        finally:
            self.spawned.set()
        status = self.proc.wait()
        self.exited.set()
        self.stopped.set()
        self.exit_code = status if status >= 0 else 128 - status

    def on_container_started(self) -> None:
        log(f"pod {self.pod.name}: container started, PID 1 is host pid {self.proc.pid}")
        with self.lock:
            pending = self.pending_deletion
        if pending:
            self.terminate(*pending)
        self.start_watchers()

    def start_watchers(self) -> None:
        if not any(p.kind == "Startup" for p in self.pod.probes):
            self.started.set()
        for probe in self.pod.probes:
            threading.Thread(target=self.probe_loop, args=(probe, time.monotonic()), daemon=True).start()
        if any(v.size_limit for v in self.pod.volumes.values()):
            threading.Thread(target=self.storage_loop, daemon=True).start()
        deadline = self.pod.active_deadline
        if deadline is not None:
            reason = f"activeDeadlineSeconds ({deadline}s) exceeded"
            timer = threading.Timer(deadline, self.terminate, (reason, self.pod.grace))
            timer.daemon = True
            timer.start()

    def on_signal(self, number: int, _frame) -> None:
        name = signal.Signals(number).name
        if self.terminating and self.proc:
            log(f"{name} again: SIGKILL to PID 1 now")
            self.send(signal.SIGKILL)
            return
        self.terminate(f"{name} received: deleting pod {self.pod.name}", self.pod.grace)

    def terminate(self, reason: str, grace: float, quiet: bool = False) -> None:
        """The kubelet's kill: SIGTERM to PID 1, SIGKILL once the grace period is over."""
        with self.lock:
            if self.proc is None:
                self.pending_deletion = (reason, grace)
                return
            if self.terminating:
                return
            self.terminating = True
        self.stopped.set()
        if not quiet:
            log(f"{reason}; SIGTERM to PID 1, SIGKILL after {grace:g}s")
        threading.Thread(target=self.kill_after_grace, args=(grace,), daemon=True).start()

    def kill_after_grace(self, grace: float) -> None:
        self.send(signal.SIGTERM)
        if not self.exited.wait(grace):
            log(f"grace period of {grace:g}s is over: SIGKILL to PID 1")
            self.send(signal.SIGKILL)

    def send(self, number: int) -> None:
        if self.proc and self.proc.returncode is None:
            try:
                self.proc.send_signal(number)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------ local storage eviction

    def storage_loop(self) -> None:
        """The kubelet's localStorageEviction for emptyDirs on disk: writes past sizeLimit succeed
        (the node's disk has room); the next check evicts the pod."""
        limited = [(v, quantity_bytes(v.size_limit)) for v in self.pod.volumes.values() if v.size_limit]
        while not self.stopped.wait(STORAGE_POLL_SECONDS):
            for volume, limit in limited:
                if disk_usage(self.pod_dir / "volumes" / volume.name) > limit:
                    self.evict(f'Usage of EmptyDir volume "{volume.name}" exceeds the limit "{volume.size_limit}"')
                    return

    def evict(self, message: str) -> None:
        # The eviction manager's grace is its own, not terminationGracePeriodSeconds: no time for a
        # final upload. It sets no DisruptionTarget condition, so podFailurePolicy does not ignore it.
        with self.lock:
            if self.terminating:
                return
            self.eviction = message
        self.terminate(f"pod {self.pod.name} evicted: {message}", EVICTION_GRACE_SECONDS)

    # ------------------------------------------------------------ probes

    def probe_loop(self, probe: Probe, container_start: float) -> None:
        if self.stopped.wait(max(0.0, container_start + probe.initial_delay - time.monotonic())):
            return
        if probe.kind != "Startup":  # liveness and readiness wait for the startup probe
            while not self.started.wait(0.2):
                if self.stopped.is_set():
                    return
        failures = successes = 0
        ready = False
        next_run = time.monotonic()
        while not self.stopped.is_set():
            ok, output = self.run_probe(probe)
            # A probe cut off by PID 1's exit fails before the container thread sees the exit; the
            # kubelet drops results for a stopped container, and so does this.
            if self.stopped.wait(0 if ok else 0.5):
                return
            failures, successes = (0, successes + 1) if ok else (failures + 1, 0)
            if probe.kind == "Readiness":
                ready = self.report_readiness(probe, ready, successes, failures, output)
            elif ok and probe.kind == "Startup":
                self.started.set()
                return
            elif not ok:
                self.report_failure(probe, failures, output)
            next_run = max(next_run + probe.period, time.monotonic())
            if self.stopped.wait(next_run - time.monotonic()):
                return

    def report_failure(self, probe: Probe, failures: int, output: str) -> None:
        message = f"{probe.kind} probe failed ({failures}/{probe.failure_threshold}): {output}"
        if failures < probe.failure_threshold:
            # A starting pod fails its startup probe until it is up: news only when it kills.
            if probe.kind != "Startup":
                log(message)
            return
        grace = probe.grace if probe.grace is not None else self.pod.grace
        log(f"{message}; killing container with grace {grace:g}s")
        self.terminate(message, grace, quiet=True)

    def report_readiness(self, probe: Probe, ready: bool, successes: int, failures: int, output: str) -> bool:
        if not ready and successes >= probe.success_threshold:
            log(f"Readiness probe succeeded: pod {self.pod.name} is Ready")
            return True
        if ready and failures >= probe.failure_threshold:
            log(f"Readiness probe failed ({failures}/{probe.failure_threshold}): {output}; pod is not Ready")
            return False
        return ready

    def run_probe(self, probe: Probe) -> tuple[bool, str]:
        """Like `kubectl exec`: same namespaces, user, capabilities, env and working dir as PID 1."""
        command = [shutil.which("nsenter") or "nsenter", f"--target={self.proc.pid}", "--pid", "--mount",
                   "--uts", "--ipc", f"--wdns={self.pod.working_dir}", "--"]
        command += setpriv_args(self.pod.security) + probe.command
        try:
            child = subprocess.Popen(command, env=self.pod.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as error:
            return False, str(error)
        try:
            output, _ = child.communicate(timeout=probe.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return False, f"command timed out after {probe.timeout:g}s"
        text = " ".join(output.decode(errors="replace").split())[:300]
        return child.returncode == 0, text or f"exit code {child.returncode}"


# ---------------------------------------------------------------- command line


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # bad input is exit 64 with one line, not argparse's 2
        log(f"{message}; see --help")
        sys.exit(EXIT_BAD_INPUT)


def key_value(text: str, what: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise BadInput(f"{what} {text.split('=')[0]!r} is not KEY=VALUE; write it as {what} KEY=VALUE")
    return key, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set or override a container env var (last one wins)")
    parser.add_argument("--pidfile", help="write the host pid of the pod's PID 1 here")
    parser.add_argument("--configmap", action="append", default=[], metavar="NAME=DIR",
                        help="local directory of ConfigMap NAME (default: job/ next to job.yaml)")
    parser.add_argument("--keep-volumes", metavar="DIR", help="keep the pod's volumes in DIR/<pod name>")
    parser.add_argument("--index", type=int, metavar="I",
                        help="run the pod of completion index I of an Indexed Job")
    parser.add_argument("--pod-ip", default="127.0.0.1", metavar="IP",
                        help="the pod's address (status.podIP, /etc/hosts): a loopback one")
    parser.add_argument("--host", action="append", default=[], metavar="NAME=IP",
                        help="an /etc/hosts entry (what the cluster DNS would answer for a peer)")
    parser.add_argument("job", type=Path, help="a batch/v1 Job manifest")
    return parser.parse_args(argv)


def check_host() -> None:
    if os.geteuid() != 0:
        raise BadInput("must run as root (namespaces and mounts); run it with sudo or as root")
    missing = [tool for tool in ("setpriv", "nsenter") if not shutil.which(tool)]
    if missing:
        raise BadInput(f"{', '.join(missing)} not found on PATH; install util-linux")


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def make_pod_dir(pod: Pod, keep_volumes: str | None) -> Path:
    if keep_volumes:
        pod_dir = Path(keep_volumes).resolve() / pod.name
        pod_dir.mkdir(parents=True)
        return pod_dir
    return Path(tempfile.mkdtemp(prefix=f"local_pod-{pod.name}-"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        overrides = dict(key_value(text, "--env") for text in args.env)  # last one wins
        configmap_dirs = {k: Path(v) for k, v in (key_value(t, "--configmap") for t in args.configmap)}
        aliases = [host_alias(text) for text in args.host]
        pod = load_pod(args.job, overrides, configmap_dirs, args.index, args.pod_ip, aliases)
        check_host()
        pod_dir = make_pod_dir(pod, args.keep_volumes)
    except BadInput as error:
        log(str(error))
        return EXIT_BAD_INPUT
    try:
        write_volumes(pod, pod_dir)
        return PodRunner(pod, pod_dir, args.pidfile).run()
    finally:
        if args.keep_volumes:
            log(f"volumes kept in {pod_dir}")
        else:
            shutil.rmtree(pod_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
