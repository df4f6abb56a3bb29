"""Bad input, through the real job.yaml: each case gets one line that names the cause and the fix,
the right exit code (64 when no retry can help, so the Job stops), and nothing that was already in
S3 is overwritten or deleted. docs/troubleshooting.md's table of error lines is this table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import boto3
import pytest
import yaml

from podlab import BUCKET, JOB_YAML, ROOT, VENV_BIN, Run, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]
BOOKKEEPING = ("status.json", "lease.json")  # the run's own record of each attempt: updated by design


@dataclass
class Case:
    name: str
    code: int
    message: str
    env: dict = field(default_factory=dict)
    prepare: Callable | None = None  # (lab, tmp_path) -> extra env, may stage things in S3
    never_shown: tuple = ()  # values that must appear nowhere in the pod's output (secrets)
    shown: tuple = ()  # more that the pod's output says
    before_data: bool = False  # refused right after the code sync: no data synced, no lease, no torchrun


@pytest.fixture(scope="module")
def lab(module_s3, s3_endpoint, tmp_path_factory):
    """One staged bucket and one completed run, shared by the cases (each gets its own copy)."""
    done = Run(module_s3, s3_endpoint, tmp_path_factory.mktemp("done"), name="done").stage()
    code, pod = done.run()
    assert code == 0, pod.output
    assert "unlike this runtime's" not in pod.output, "stage.sh's copies of the runtime's modules are this runtime's"
    return Lab(module_s3, s3_endpoint, done)


@dataclass
class Lab:
    s3: object
    endpoint: str
    done: Run

    def copy_of_done(self, name: str) -> str:
        """A copy of the completed run under runs/NAME/ without its COMPLETE: a run to resume."""
        for key in self.done.keys():
            if key != "COMPLETE":
                self.s3.copy_object(Bucket=BUCKET, Key=f"runs/{name}/{key}",
                                    CopySource={"Bucket": BUCKET, "Key": self.done.prefix + key})
        return f"s3://{BUCKET}/runs/{name}/"

    def put(self, key: str, body: bytes) -> None:
        self.s3.put_object(Bucket=BUCKET, Key=key, Body=body)

    def code_copy(self, prefix: str, **replace: bytes) -> str:
        for obj in self.s3.list_objects_v2(Bucket=BUCKET, Prefix="code/")["Contents"]:
            name = obj["Key"][len("code/"):]
            if name in replace:
                self.put(f"{prefix}{name}", replace[name])
            else:
                self.s3.copy_object(Bucket=BUCKET, Key=f"{prefix}{name}", CopySource={"Bucket": BUCKET, "Key": obj["Key"]})
        return f"s3://{BUCKET}/{prefix}"

    def newest_manifest_key(self, run_uri: str) -> str:
        prefix = run_uri.split(BUCKET + "/", 1)[1]
        keys = [o["Key"] for o in self.s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "checkpoints/step-")["Contents"]]
        return max(k for k in keys if k.endswith("manifest.json"))


def truncate_newest(lab: Lab, tmp_path: Path) -> dict:
    uri = lab.copy_of_done("truncated")
    model = lab.newest_manifest_key(uri).replace("manifest.json", "model.pt")
    data = lab.s3.get_object(Bucket=BUCKET, Key=model)["Body"].read()
    lab.put(model, data[: len(data) // 3])
    return {"S3_OUTPUT_URI": uri}


def manifest_names_missing_file(lab: Lab, tmp_path: Path) -> dict:
    uri = lab.copy_of_done("missing-file")
    key = lab.newest_manifest_key(uri)
    manifest = json.loads(lab.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    manifest["files"]["extra.pt"] = {"size": 10, "sha256": "0" * 64}
    lab.put(key, json.dumps(manifest).encode())
    return {"S3_OUTPUT_URI": uri}


def broken_manifest(lab: Lab, tmp_path: Path) -> dict:
    uri = lab.copy_of_done("broken-manifest")
    lab.put(lab.newest_manifest_key(uri), b"{not json")
    return {"S3_OUTPUT_URI": uri}


def other_model_shape(lab: Lab, tmp_path: Path) -> dict:
    return {"S3_OUTPUT_URI": lab.copy_of_done("other-shape"), "TRAIN_ARGS": "--set model.n_embd=32"}


def yaml_syntax_error(lab: Lab, tmp_path: Path) -> dict:
    lab.put("code/config/broken.yaml", b"model:\n  n_layer: [2, 4\n")
    return {"TRAIN_CONFIG": "config/broken.yaml"}


def stale_runtime_copy(lab: Lab, tmp_path: Path) -> dict:
    """The code staged by an older runtime: its copy of contract.py is not the ConfigMap's."""
    older = (ROOT / "job" / "contract.py").read_bytes() + b"# an older runtime's\n"
    return {"S3_CODE_URI": lab.code_copy("code-stale/", **{"contract.py": older})}


def only_val_bin(lab: Lab, tmp_path: Path) -> dict:
    lab.s3.copy_object(Bucket=BUCKET, Key="half-data/val.bin", CopySource={"Bucket": BUCKET, "Key": "data/val.bin"})
    return {"S3_DATA_URI": f"s3://{BUCKET}/half-data/"}


def unknown_vocabulary(lab: Lab, tmp_path: Path) -> dict:
    for name in ("train.bin", "val.bin"):
        lab.s3.copy_object(Bucket=BUCKET, Key=f"big-vocab/{name}", CopySource={"Bucket": BUCKET, "Key": f"data/{name}"})
    lab.put("big-vocab/meta.json", b'{"vocab_size": 50257}')
    return {"S3_DATA_URI": f"s3://{BUCKET}/big-vocab/"}


def token_id_past_the_vocabulary(lab: Lab, tmp_path: Path) -> dict:
    import numpy as np

    train = np.frombuffer(lab.s3.get_object(Bucket=BUCKET, Key="data/train.bin")["Body"].read(), dtype="<u2").copy()
    train[len(train) // 2] = 300  # the tiny model has 256 embeddings
    lab.put("wide-ids/train.bin", train.tobytes())
    lab.s3.copy_object(Bucket=BUCKET, Key="wide-ids/val.bin", CopySource={"Bucket": BUCKET, "Key": "data/val.bin"})
    return {"S3_DATA_URI": f"s3://{BUCKET}/wide-ids/"}


def bad_requirements(lab: Lab, tmp_path: Path) -> dict:
    uri = lab.code_copy("code-badreq/", **{"requirements.txt": b"no-such-package-anywhere==9.9\n"})
    return {"S3_CODE_URI": uri, "PIP_NO_INDEX": "1"}


def no_checkpoint_module(lab: Lab, tmp_path: Path) -> dict:
    uri = lab.code_copy("code-nockpt/")
    for name in ("checkpoint.py", "contract.py", "trainer_kit.py"):  # code/'s links to job/: the runtime brings them
        lab.s3.delete_object(Bucket=BUCKET, Key=f"code-nockpt/{name}")
    return {"S3_CODE_URI": uri}


def four_fake_gpus(lab: Lab, tmp_path: Path) -> dict:
    # A node with GPUs cannot exist here: a fake nvidia-smi stands in for one with 4.
    return {"PATH": f"{ROOT / 'tests' / 'fake-bin'}:{VENV_BIN}:/usr/bin:/bin", "NPROC_PER_NODE": "8"}


def small_disk(lab: Lab, tmp_path: Path) -> dict:
    job = yaml.safe_load(JOB_YAML.read_text())
    for volume in job["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "home":  # a full disk, for real: the workspace on a 1 MiB tmpfs
            volume["emptyDir"] = {"medium": "Memory", "sizeLimit": "1Mi"}
    path = tmp_path / "job-small-disk.yaml"
    path.write_text(yaml.safe_dump(job))
    return {"JOB_YAML": str(path)}


CASES = [
    Case("S3_CODE_URI missing", 64, "S3_CODE_URI is not set; set it to s3://bucket/prefix/", {"S3_CODE_URI": ""}),
    Case("S3_DATA_URI not s3://", 64, "S3_DATA_URI=https://example.com/data is not an s3://bucket/prefix/ URI",
         {"S3_DATA_URI": "https://example.com/data"}),
    Case("S3_OUTPUT_URI inside the code", 64, "overlap; give S3_OUTPUT_URI its own prefix",
         {"S3_OUTPUT_URI": f"s3://{BUCKET}/code/out/"}),
    Case("bucket does not exist", 64, "bucket no-such-bucket does not exist; create it or fix the URI",
         {"S3_DATA_URI": "s3://no-such-bucket/data/"}),
    Case("bucket does not exist, through the AWS CLI", 64, "bucket no-such-bucket does not exist; create it or fix "
         "the URI", {"S3_DATA_URI": "s3://no-such-bucket/data/", "S3_SYNC_TOOL": "aws"}),
    Case("empty code prefix", 64, "holds no train.py; upload the code with scripts/stage.sh",
         {"S3_CODE_URI": f"s3://{BUCKET}/nothing-here/"}),
    Case("empty data prefix", 64, "holds no train.bin; make it with scripts/prepare_data.py",
         {"S3_DATA_URI": f"s3://{BUCKET}/nothing-here/"}),
    Case("no train.bin", 64, "holds no train.bin", prepare=only_val_bin),
    Case("TRAIN_CONFIG not in the code", 64, "TRAIN_CONFIG=config/nope.yaml is not in", {"TRAIN_CONFIG": "config/nope.yaml"}),
    Case("TRAIN_SCRIPT outside the code", 64, "TRAIN_SCRIPT=../train.py must be relative to the code, without ..",
         {"TRAIN_SCRIPT": "../train.py"}),
    Case("TRAIN_SCRIPT not in the code", 64, "holds no nope.py; upload the code with scripts/stage.sh",
         {"TRAIN_SCRIPT": "nope.py"}),
    Case("finetune.py without a model", 64, "S3_MODEL_URI is not set; TRAIN_SCRIPT=finetune.py needs a model snapshot",
         {"TRAIN_SCRIPT": "finetune.py"}),
    Case("config YAML syntax error", 64, "YAML syntax error at line", prepare=yaml_syntax_error, before_data=True),
    Case("config unknown key", 64, "unknown setting model.n_layers; did you mean model.n_layer?",
         {"TRAIN_ARGS": "--set model.n_layers=3"}, before_data=True),
    Case("config wrong type", 64, "train.max_steps must be an integer, got 'many'", {"TRAIN_ARGS": "--set train.max_steps=many"},
         before_data=True),
    Case("config wrong type, the code staged by an older runtime", 64, "train.max_steps must be an integer, got 'many'",
         {"TRAIN_ARGS": "--set train.max_steps=many"}, prepare=stale_runtime_copy, before_data=True,
         shown=(f"warning: s3://{BUCKET}/code-stale/ holds contract.py unlike this runtime's: the trainer imports the "
                "code's copies",)),
    Case("TRAIN_ARGS with an argument the trainer lacks", 64,
         "train.py refuses its settings (TRAIN_CONFIG=config/tiny.yaml, TRAIN_ARGS): train.py: error: unrecognized "
         "arguments: --sett", {"TRAIN_ARGS": "--sett train.max_steps=5"}, before_data=True),
    # A trainer of the user's own: its argparse says why and exits 2, which torchrun turns into 1.
    Case("TRAIN_ARGS that a trainer's argparse refuses", 64, "minimal_train.py: error: unrecognized arguments: --sett 5",
         {"TRAIN_SCRIPT": "minimal_train.py", "TRAIN_ARGS": "--sett 5"},
         shown=("the trainer refused its command line (exit 2, a usage error): fix TRAIN_ARGS",)),
    Case("data vocabulary larger than the model's", 64, "model.vocab_size (256) is smaller than the data's vocabulary (50257",
         prepare=unknown_vocabulary),
    Case("NPROC_PER_NODE of 0", 64, "NPROC_PER_NODE=0 must be a positive integer", {"NPROC_PER_NODE": "0"}),
    Case("NPROC_PER_NODE above the GPUs", 64, "NPROC_PER_NODE=8 but the pod sees 4 GPUs", prepare=four_fake_gpus),
    Case("SYNC_INTERVAL_SECONDS not a number", 64, "SYNC_INTERVAL_SECONDS=soon must be a positive integer",
         {"SYNC_INTERVAL_SECONDS": "soon"}),
    Case("endpoint without a scheme", 64, "has no http:// or https:// scheme; add it", {"AWS_ENDPOINT_URL": "127.0.0.1:9"}),
    # Every other setting the pod reads: refused before any sync, with the value and the fix.
    Case("LEASE_TTL_SECONDS of 0", 64, "LEASE_TTL_SECONDS=0 must be a whole number of seconds, at least 3",
         {"LEASE_TTL_SECONDS": "0"}),
    Case("LEASE_WAIT_SECONDS negative", 64, "LEASE_WAIT_SECONDS=-1 must be a whole number of seconds, at least 0",
         {"LEASE_WAIT_SECONDS": "-1"}),
    Case("UPLOAD_RETRY_SECONDS of 0", 64, "UPLOAD_RETRY_SECONDS=0 must be a positive integer", {"UPLOAD_RETRY_SECONDS": "0"}),
    Case("HEALTH_MAX_AGE_SECONDS below the heartbeat", 64,
         "HEALTH_MAX_AGE_SECONDS=5 must be a whole number of seconds, at least 10", {"HEALTH_MAX_AGE_SECONDS": "5"}),
    Case("TORCH_ELASTIC_SHUTDOWN_TIMEOUT in minutes", 64,
         "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=3m must be a whole number of seconds, at least 1",
         {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3m"}),
    Case("S3_RETRY_SECONDS not a number", 64, "S3_RETRY_SECONDS=10m must be a positive integer", {"S3_RETRY_SECONDS": "10m"}),
    Case("AWS_MAX_ATTEMPTS of 0", 64, "AWS_MAX_ATTEMPTS=0 must be a positive integer", {"AWS_MAX_ATTEMPTS": "0"}),
    Case("AWS_RETRY_MODE unknown", 64, "AWS_RETRY_MODE=fast must be standard, adaptive or legacy", {"AWS_RETRY_MODE": "fast"}),
    Case("S3_LEASE neither on nor off", 64, "S3_LEASE=no must be on or off", {"S3_LEASE": "no"}),
    Case("READY_FILE relative", 64, "READY_FILE=ready must be an absolute path", {"READY_FILE": "ready"}),
    Case("HEALTH_FILE in no writable folder", 64, "HEALTH_FILE=/no/such/healthy is in no writable folder",
         {"HEALTH_FILE": "/no/such/healthy"}),
    Case("WORK_DIR relative", 64, "WORK_DIR=code must be an absolute path", {"WORK_DIR": "code"}),
    Case("CHECKPOINT_HMAC_KEY too short", 64, "CHECKPOINT_HMAC_KEY is set but shorter than 16 bytes",
         {"CHECKPOINT_HMAC_KEY": "short-s3cret"}, never_shown=("short-s3cret",)),
    Case("TRAIN_ARGS with an unbalanced quote", 64, "TRAIN_ARGS has an unbalanced quote",
         {"TRAIN_ARGS": "--set 'train.max_steps=10"}),
    # Split as a shell would: the second line reaches the trainer, the quoted value stays whole.
    Case("TRAIN_ARGS over two lines, quoted", 64, "train.max_steps must be an integer, got 'two words'",
         {"TRAIN_ARGS": "--set train.seed=1\n--set 'train.max_steps=two words'"}, before_data=True),
    Case("S3_OUTPUT_URI with a newline", 64, "holds a control character", {"S3_OUTPUT_URI": f"s3://{BUCKET}/runs/x/\n"}),
    Case("a token id past model.vocab_size", 64, "/train.bin holds token id 300 (token ",
         prepare=token_id_past_the_vocabulary),
    Case("requirements that fail to install", 64, "the code's requirements cannot be installed", prepare=bad_requirements),
    Case("no credentials", 64, "no AWS credentials; create the Secret aws-credentials",
         {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_EC2_METADATA_DISABLED": "true"}),
    Case("checkpoint from another model shape", 64, "was trained with model.n_embd=64 but the config says 32",
         prepare=other_model_shape),
    Case("disk fills while a checkpoint is written", 64, "no space left in /home/eai_role/code/out for checkpoint",
         prepare=small_disk),
    # What a retry-free fallback handles: a warning names it, the run completes.
    Case("truncated newest checkpoint in S3", 0, "in S3 is damaged (model.pt has", prepare=truncate_newest),
    Case("manifest naming a missing file", 0, "in S3 is damaged (extra.pt is named in the manifest but missing)",
         prepare=manifest_names_missing_file),
    # The protocol ships with the runtime: a trainer that brings none imports the runtime's copy.
    Case("code without checkpoint.py, contract.py, trainer_kit.py", 0, "COMPLETE: {", prepare=no_checkpoint_module),
    Case("manifest that is not JSON", 0, "in S3 is damaged (its manifest.json is not JSON)", prepare=broken_manifest),
]


def everything_in(s3) -> dict[str, str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def run_case(lab: Lab, run: Run, case: Case, tmp_path: Path):
    env = dict(case.env)
    if case.prepare:
        env.update(case.prepare(lab, tmp_path))
    job_yaml = Path(env.pop("JOB_YAML", JOB_YAML))
    before = everything_in(lab.s3)
    pod = run.start(job_yaml, **env)
    code = pod.wait(timeout=300)
    return code, pod, before, everything_in(lab.s3)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_line_the_right_exit_code_and_s3_keeps_what_it_had(lab, case, tmp_path):
    run = Run(lab.s3, lab.endpoint, tmp_path, name=re.sub(r"\W+", "-", case.name))
    code, pod, before, after = run_case(lab, run, case, tmp_path)
    assert code == case.code, pod.output[-3000:]
    assert case.message in pod.output, pod.output[-3000:]
    for secret in case.never_shown:
        assert secret not in pod.output
    for text in case.shown:
        assert text in pod.output, pod.output[-3000:]
    errors = [line for line in pod.lines if re.search(r"\berror: ", line)]
    exits = [i for i, line in enumerate(pod.lines) if '"event": "exit"' in line]  # none: stopped before the log
    assert not exits or [line for line in pod.lines[exits[-1] + 1:] if not line.startswith("local_pod:")] == [], \
        "the exit line is the pod's last: nothing (torchrun's report of a stop) comes after it"
    if case.code == 64:
        assert len(errors) == 1, errors
        assert case.message in errors[0]
    else:
        assert not errors, errors
    if case.before_data:
        phases = [e["name"] for e in pod.events if e["event"] == "phase" and e["state"] == "start"]
        assert phases == ["check S3 access", "sync code", "python environment", "check the trainer's settings"], phases
        assert "torchrun" not in pod.output, "no trainer started, no torchrun banner"
    for key, etag in before.items():
        if key.rsplit("/", 1)[-1] in BOOKKEEPING or (case.code == 0 and "/checkpoints/" in key):
            continue  # a redone checkpoint replaces the damaged one it was told to ignore
        assert after.get(key) == etag, f"{key} was changed or deleted"


@pytest.fixture(scope="module")
def locked_s3(tmp_path_factory):
    """A second local S3 that checks credentials: a user with no permissions, a bucket."""
    port_file = tmp_path_factory.mktemp("auth") / "port"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    server = subprocess.Popen([sys.executable, str(ROOT / "lab" / "local_s3.py"), "--port-file", str(port_file)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = wait_until(lambda: server.poll() is not None or port_file.exists() and port_file.read_text(), 60, 0.1)
    if not started or server.poll() is not None:
        server.kill()
        pytest.fail(f"lab/local_s3.py did not start (exit code {server.wait()})")
    endpoint = f"http://127.0.0.1:{port_file.read_text()}"
    admin = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    iam = boto3.client("iam", **admin)
    iam.create_user(UserName="pod")
    key = iam.create_access_key(UserName="pod")["AccessKey"]
    boto3.client("s3", **admin).create_bucket(Bucket="locked")
    yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    server.terminate()
    server.wait()


@pytest.mark.parametrize("who,message", [
    ("no permissions", "access to s3://locked/code/ denied; give the pod's role or Secret s3:ListBucket"),
    # The bucket's check lists COMPLETE: a GET, whose error body names the cause (a HEAD has none).
    ("unknown key", "the AWS credentials were refused by S3 (InvalidAccessKeyId); fix the Secret"),
])
def test_s3_refusing_the_pod_exits_64(locked_s3, tmp_path, who, message, s3_endpoint, monkeypatch, tool_path):
    endpoint, key_id, secret = locked_s3
    if who == "unknown key":
        key_id, secret = "AKIA0000000000000000", "not-a-real-secret"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    run = Run(None, endpoint, tmp_path, name="locked")
    pod = run.start(S3_CODE_URI="s3://locked/code/", S3_DATA_URI="s3://locked/data/",
                    S3_OUTPUT_URI="s3://locked/runs/r/")
    assert pod.wait(timeout=120) == 64, pod.output
    errors = [line for line in pod.lines if re.search(r"\berror: ", line)]
    assert len(errors) == 1 and message in errors[0], pod.output
