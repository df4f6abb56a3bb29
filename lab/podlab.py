"""A lab for the real job.yaml: a tiny corpus and config, a run staged in a local S3, its pods run
by lab/local_pod.py (killed, deleted, waited for), and what S3 holds afterwards.

Used by the tests and by lab/chaos.py, benchmark.py and local_s3.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
CODE = ROOT / "code"
VENV_BIN = Path(sys.executable).parent
sys.path.insert(0, str(CODE))
sys.path.insert(0, str(ROOT / "job"))
import checkpoint  # noqa: E402
import contract  # noqa: E402 - the pod's events: what the waits below match, never prose

TINY_CONFIG = {
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 256,
              "dropout": 0.1, "bias": False},
    "train": {"batch_size": 8, "grad_accum_steps": 2, "max_steps": 40, "learning_rate": 3e-3,
              "min_lr": 3e-4, "warmup_steps": 5, "seed": 7},
    "eval": {"interval": 10, "steps": 2},
    "checkpoint": {"interval": 5, "keep": 2},
    "log": {"interval": 1},
    "system": {"dtype": "float32", "compile": False},
}


def write_corpus(folder: Path, documents: int = 3000, seed: int = 0) -> Path:
    """Byte-level train.bin/val.bin of made-up sentences: enough structure to learn from."""
    rng = random.Random(seed)
    words = "the a cat dog runs jumps over under quick lazy brown fox sleeps eats red blue".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "."
                     for _ in range(documents))
    tokens = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)
    cut = int(len(tokens) * 0.9)
    folder.mkdir(parents=True, exist_ok=True)
    tokens[:cut].tofile(folder / "train.bin")
    tokens[cut:].tofile(folder / "val.bin")
    return folder


def write_config(path: Path, **overrides) -> Path:
    """TINY_CONFIG with `group__key=value` overrides, as YAML."""
    cfg = yaml.safe_load(yaml.safe_dump(TINY_CONFIG))
    for name, value in overrides.items():
        group, key = name.split("__")
        cfg[group][key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


JOB_YAML = ROOT / "job.yaml"
BUCKET = "test-bucket"
POD_CONFIG = {"train__max_steps": 60, "checkpoint__interval": 5, "checkpoint__keep": 2, "eval__interval": 10,
              "model__n_embd": 64, "model__block_size": 64, "train__batch_size": 16}


class Pod:
    """One pod: the runner process, its output as it comes, and its PID 1 on the host."""

    def __init__(self, command: list[str], pidfile: Path, env: dict):
        self.pidfile = pidfile
        self.lines: list[str] = []
        self._new = queue.Queue()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> str:
        """Block until a line containing `text` appears; return it. For what a person reads; to wait
        for a moment (a step, a checkpoint, the pod's phases) use wait_for_event: prose may change."""
        for line in self.lines:
            if text in line:
                return line
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._new.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r}; output:\n{self.output[-4000:]}")

    @property
    def events(self) -> list[dict]:
        """The pod's event lines so far (job/contract.py), parsed."""
        return [e for e in map(contract.parse_event, self.lines) if e is not None]

    def wait_for_event(self, kind: str, timeout: float = 120, **fields) -> dict:
        """Block until an event of this kind with these fields appears; return it."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            lines = self.lines[seen:]
            seen += len(lines)
            for record in map(contract.parse_event, lines):
                if contract.matches(record, kind, **fields):
                    return record
            if self.proc.poll() is not None and seen == len(self.lines) and not self._reader.is_alive():
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        raise AssertionError(f"no event {kind} {fields}; output:\n{self.output[-4000:]}")

    def pid1(self) -> int:
        pid = wait_until(lambda: self.pidfile.exists() and self.pidfile.read_text().strip(), 30, interval=0.05)
        if not pid:
            raise AssertionError("the runner wrote no pidfile")
        return int(pid)

    def lose_node(self) -> bool:
        """SIGKILL the pod's PID 1: everything in it dies at once, nothing is uploaded. False when
        PID 1 had already exited."""
        try:
            os.kill(self.pid1(), signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def delete(self) -> None:
        """Graceful deletion: SIGTERM to the runner, which sends SIGTERM to PID 1."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"pod still running after {timeout}s:\n{self.output[-4000:]}")
        self._reader.join(timeout=30)  # callers read the last lines next
        return code


_STAGED: dict[tuple[str, str, str], list[tuple[str, bytes, str]]] = {}  # Run.stage()'s, per process


class Run:
    """Code, data and an output prefix in the local S3, and the pods that train there."""

    def __init__(self, s3, endpoint: str, folder: Path, name: str = "run", **config):
        self.s3, self.endpoint, self.folder = s3, endpoint, folder
        self.code_uri = f"s3://{BUCKET}/code/"
        self.data_uri = f"s3://{BUCKET}/data/"
        self.output_uri = f"s3://{BUCKET}/runs/{name}/"
        self.prefix = f"runs/{name}/"
        self.config = {**POD_CONFIG, **config}
        self.pods = 0

    def stage(self) -> "Run":
        """This repository's code/ and the tiny corpus, as scripts/stage.sh stages them, then the
        run's tiny.yaml. stage.sh runs once per process and S3 endpoint (its AWS CLI calls cost ~4 s
        of CPU); later calls put the same objects back, byte for byte, after a server reset."""
        key = (self.endpoint, self.code_uri, self.data_uri)
        data = write_corpus(self.folder / "data")
        if key not in _STAGED:
            subprocess.run([str(ROOT / "scripts" / "stage.sh"), self.code_uri, "--data", str(data), self.data_uri],
                           check=True, capture_output=True, env=tool_env())
            _STAGED[key] = self._staged_objects()
        else:
            for name, body, content_type in _STAGED[key]:
                self.s3.put_object(Bucket=BUCKET, Key=name, Body=body, ContentType=content_type)
        tiny = write_config(self.folder / "tiny.yaml", **self.config)
        self.s3.upload_file(str(tiny), BUCKET, "code/config/tiny.yaml")
        return self

    def _staged_objects(self) -> list[tuple[str, bytes, str]]:
        """(key, body, content type) of what stage.sh just put in S3: the files its record names,
        the record, and the corpus."""
        code = self.code_uri.removeprefix(f"s3://{BUCKET}/")
        data = self.data_uri.removeprefix(f"s3://{BUCKET}/")
        record = self.s3.get_object(Bucket=BUCKET, Key=f"{code}.stage-record.json")["Body"].read()
        names = [code + name for name in json.loads(record)["files"]] + [f"{code}.stage-record.json"]
        names += [data + name for name in ("train.bin", "val.bin")]
        staged = []
        for name in names:
            reply = self.s3.get_object(Bucket=BUCKET, Key=name)
            staged.append((name, reply["Body"].read(), reply["ContentType"]))
        return staged

    def env(self, **extra: str) -> dict:
        env = {
            "S3_CODE_URI": self.code_uri, "S3_DATA_URI": self.data_uri, "S3_OUTPUT_URI": self.output_uri,
            "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
            "NPROC_PER_NODE": "1", "TRAIN_CONFIG": "config/tiny.yaml", "SYNC_INTERVAL_SECONDS": "2",
            # Two cores shared with the S3 server and the uploader: spinning OpenMP threads would
            # make each step 50x slower.
            "OMP_NUM_THREADS": "1",
            "LEASE_TTL_SECONDS": "4", "S3_RETRY_SECONDS": "60",
            # The lab waits on the pod's events: on its stdout too, not only in its log file.
            "EVENTS": "stdout",
        }
        env.update(extra)
        return env

    def start(self, job_yaml: Path = JOB_YAML, **env: str) -> Pod:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pods += 1
        pidfile = self.folder / f"pod-{self.pods}.pid"
        command = [sys.executable, str(ROOT / "lab" / "local_pod.py"), "--pidfile", str(pidfile),
                   "--configmap", f"script-configmap={ROOT / 'job'}"]
        for key, value in self.env(**env).items():
            command += ["--env", f"{key}={value}"]
        return Pod(command + [str(job_yaml)], pidfile, tool_env())

    def run(self, **env: str) -> tuple[int, Pod]:
        pod = self.start(**env)
        return pod.wait(), pod

    def render_indexed(self, nodes: int = 2, name: str = "run", flags: tuple[str, ...] = ()) -> Path:
        """`scripts/submit.py NAME --engine indexed --nodes N` for this run's S3 URIs: the YAML stream
        (ConfigMap script-configmap, headless Service NAME, Indexed Job NAME), written to the folder.
        `flags` go to submit.py as they are (e.g. "--train-config", "config/tiny.yaml")."""
        self.folder.mkdir(parents=True, exist_ok=True)
        rendered = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "submit.py"), name, "--image", "local",
             "--code", self.code_uri, "--data", self.data_uri, "--output", self.output_uri,
             "--engine", "indexed", "--nodes", str(nodes), "--gpus-per-node", "1", *flags],
            capture_output=True, text=True, check=True, env=tool_env())
        path = self.folder / f"{name}-indexed-{nodes}.yaml"
        path.write_text(rendered.stdout)
        return path

    def start_indexed(self, manifest: Path | None = None, nodes: int = 2, **env: str):
        """Start an Indexed Job's pods for this run (lab/local_job.py), as start() does one pod of
        job.yaml: the same env (self.env(**env): the local S3, credentials, TRAIN_CONFIG, timings)
        on every pod. manifest: a stream from render_indexed() (rendered here when None)."""
        from local_job import IndexedJob  # noqa: PLC0415 - local_job imports this module

        self.pods += 1
        job = IndexedJob(manifest or self.render_indexed(nodes), env=self.env(**env),
                         configmaps={"script-configmap": ROOT / "job"},
                         folder=self.folder / f"indexed-{self.pods}")
        return job.start()

    # -- what S3 holds ---------------------------------------------------------------------------

    def keys(self) -> dict[str, str]:
        """Every key under the run's prefix with its ETag."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=self.prefix)
        return {o["Key"][len(self.prefix):]: o["ETag"] for p in pages for o in p.get("Contents", [])}

    def read(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=BUCKET, Key=self.prefix + key)["Body"].read()

    def json(self, key: str) -> dict:
        return json.loads(self.read(key))

    def committed_steps(self) -> list[int]:
        """Steps S3 shows as committed (their manifest is there), newest first."""
        names = {k.split("/")[1] for k in self.keys() if k.startswith("checkpoints/") and k.endswith("/manifest.json")}
        return sorted((checkpoint.parse_step(n) for n in names if checkpoint.parse_step(n) is not None), reverse=True)

    def verify_in_s3(self, name: str) -> str | None:
        """None when every file of a committed checkpoint in S3 matches its manifest."""
        manifest = self.json(f"checkpoints/{name}/manifest.json")
        for file, entry in manifest["files"].items():
            data = self.read(f"checkpoints/{name}/{file}")
            if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                return f"{name}/{file} does not match its manifest"
        return None

    def model_sha(self, step: int) -> str:
        return hashlib.sha256(self.read(f"checkpoints/{checkpoint.step_dir_name(step)}/model.pt")).hexdigest()


def venv_path() -> str:
    """This process's PATH with the venv's tools (aws, kubectl, torchrun, s5cmd) first."""
    return f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def tool_env() -> dict:
    return {**os.environ, "PATH": venv_path()}


def fake_aws_env(endpoint: str) -> dict:
    """Fake credentials and a local S3 endpoint, as environment variables."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


class _KeyBytes:
    """A key's bytes as moto's range code uses them (len, one slice), read from its buffer only
    where sliced: seek+read under the key's lock, as FakeKey.value reads the whole."""

    def __init__(self, key):
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, part):
        if not isinstance(part, slice) or part.step is not None:
            return self.whole()[part]
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))

    def whole(self) -> bytes:
        return self.key.value


class _RangedKey:
    """A FakeKey whose value is a _KeyBytes; everything else is the key's own."""

    def __init__(self, key):
        self._key = key

    def __getattr__(self, name):
        return getattr(self._key, name)

    @property
    def value(self) -> _KeyBytes:
        return _KeyBytes(self._key)


def serve_ranges_lazily() -> None:
    """Written against moto 5.2.5, which reads a WHOLE object for every GET, ranged or not
    (S3Response.get_object returns key.value; key_response then slices the range out of it): a
    1.5 GB object fetched in 8-50 MB parts cost the lab's S3 30-190 whole reads, a cost real S3
    does not have, that made the benchmark's transfers unfair to clients with small parts. Here a
    GET with a Range header gets a key whose value reads only what moto's own range code slices
    from it; moto still parses the range and answers (206, 416, 304, or the whole object where it
    ignores the range, read whole as before). Fails at start if the internals it uses moved."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_lab_lazy_ranges", False):
        return
    import inspect

    import moto

    uses = {S3Response.get_object: ("self._get_key()", "key.value"),
            S3Response.key_response: ("self._handle_range_header(", "response_content"),
            S3Response._handle_range_header: ("len(response_content)", "response_content[begin : end + 1]"),
            FakeKey.__init__: ("self._value_buffer", "self.lock"),
            FakeKey.value.fget: ("with self.lock", "self._value_buffer.read()")}
    for function, needles in uses.items():
        source = inspect.getsource(function)
        if not all(needle in source for needle in needles):
            raise RuntimeError(f"moto {moto.__version__}: {function.__qualname__} no longer does what "
                               "lab/podlab.py's serve_ranges_lazily relies on (written against 5.2.5): "
                               "review it or pin moto==5.2.5")
    moto_get_object, moto_key_response = S3Response.get_object, S3Response.key_response

    def get_object(self):
        if self.headers.get("range"):
            get_key = self._get_key  # this request's own S3Response: one get_object each

            def ranged_get_key(*args, **kwargs):
                key, not_modified = get_key(*args, **kwargs)
                return _RangedKey(key), not_modified
            self._get_key = ranged_get_key
        return moto_get_object(self)

    def key_response(self, *args, **kwargs):
        status, headers, body = moto_key_response(self, *args, **kwargs)
        return status, headers, body.whole() if isinstance(body, _KeyBytes) else body

    S3Response.get_object, S3Response.key_response = get_object, key_response
    S3Response._lab_lazy_ranges = True


@contextlib.contextmanager
def local_s3(buckets=(BUCKET,), port: int = 0, set_environ: bool = True):
    """moto's S3 server on loopback (port 0: a free one) with `buckets` created; yields its endpoint.
    With set_environ, fake_aws_env(endpoint) goes into os.environ (this process and its children)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request otherwise
    serve_ranges_lazily()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = "http://%s:%d" % server.get_host_and_port()
        if set_environ:
            os.environ.update(fake_aws_env(endpoint))
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


def free_ports(count: int = 1) -> int:
    """P with P .. P+count-1 free to listen on, below the kernel's ephemeral range: a port from that
    range (what bind(0) hands out) may be taken, between this check and a pod's bind, by any outgoing
    connection (the pods' S3 clients open hundreds), and torchrun's store then fails with EADDRINUSE."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if ephemeral_low - count < 10000:
        raise RuntimeError(f"no ports to test with below net.ipv4.ip_local_port_range ({ephemeral_low})")
    while True:
        port = random.randint(10000, ephemeral_low - count)
        try:
            for candidate in range(port, port + count):
                with socket.socket() as probe:
                    probe.bind(("0.0.0.0", candidate))
        except OSError:
            continue
        return port


def wait_until(condition, timeout: float, interval: float = 0.2):
    """Call `condition` every `interval` s until it returns something true; return its last value
    (false when `timeout` s passed first)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval)


def scaled_job_yaml(folder: Path, period: int = 1, failure: int = 2, grace: int | None = None) -> Path:
    """job.yaml with its probes run every `period` seconds (a test cannot wait 90 s for liveness)."""
    job = yaml.safe_load(JOB_YAML.read_text())
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        container[probe]["periodSeconds"] = period
        if probe == "livenessProbe":
            container[probe]["failureThreshold"] = failure
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    path = folder / "job-scaled.yaml"
    path.write_text(yaml.safe_dump(job))
    return path
