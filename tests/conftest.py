"""Shared fixtures: a real S3 (moto's HTTP server on loopback) reached through AWS_ENDPOINT_URL.

Anything that runs in another process (the AWS CLI, the bootstrap, TensorBoard) talks to the same
server over HTTP, as it would to S3. State is reset between tests.
"""

import os
import urllib.request

# Before torch is imported here or in any process a test starts: tests run two at a time on 2 cores
# (scripts/test.sh), and a trainer's OpenMP threads spinning beside another test's made its steps
# several times slower (a SIGTERM test: 8.7 s alone, 46 s beside another). The pods set it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import boto3  # noqa: E402
import pytest  # noqa: E402

from podlab import BUCKET, ROOT, Run, fake_aws_env, local_s3, venv_path  # noqa: F401 - import paths: pytest.ini


# Seconds each end-to-end file took in a full run (a clean clone, 2 workers, 2026-11-28, all passed:
# the sum of its tests' setup, call and teardown, files over 20 s). scripts/test.sh hands out a file
# to a worker in collection order: the longest go first, so that no long file starts last and runs
# alone at the end. A file not listed (or new) counts as short.
FILE_SECONDS = {
    "test_finetune.py": 331, "test_multinode_engines.py": 294, "test_multinode.py": 270, "test_reliability.py": 257,
    "test_bad_input.py": 193, "test_train.py": 171, "test_finetune_group.py": 163, "test_benchmark_gpu.py": 152,
    "test_finished_run.py": 132, "test_pod.py": 117, "test_uploader_robust.py": 110, "test_real_image.py": 103,
    "test_fsdp_pod.py": 101, "test_watch.py": 85, "test_async_checkpoint.py": 82, "test_fsdp.py": 78,
    "test_benchmark.py": 77, "test_kill_sweep.py": 76, "test_finetune_pod.py": 74, "test_lease_store.py": 68,
    "test_minimal_train.py": 61, "test_docs_examples_s3.py": 59, "test_hostile_bucket.py": 58, "test_submit.py": 50,
    "test_demo.py": 46, "test_upload_growth.py": 34, "test_resume_arithmetic.py": 30, "test_local_job.py": 28,
    "test_stage.py": 27, "test_local_pod.py": 26, "test_uploader.py": 24, "test_prepare_data.py": 21,
}


# The same for the unit files over 3 s (`--quick`, 2026-11-28): test_group.py alone is a quarter of
# the layer's test time, mostly waits past a limit, and it ran last and alone when handed out by name.
UNIT_FILE_SECONDS = {
    "test_group.py": 25, "test_preload.py": 12, "test_async_save.py": 7, "test_torchrun.py": 7,
    "test_docs_examples.py": 5, "test_settings.py": 5, "test_contract.py": 4, "test_redaction.py": 4,
}


def file_seconds(path) -> int:
    table = {"tests": FILE_SECONDS, "unit": UNIT_FILE_SECONDS}.get(path.parent.name, {})
    return table.get(path.name, 0)


def pytest_collection_modifyitems(items):
    """Longest files first (a stable sort: each file's tests keep their order)."""
    items.sort(key=lambda item: -file_seconds(item.path))


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """The names of the files checkpoint.py fsyncs, in order, as it fsyncs them (they still are)."""
    import checkpoint

    synced, fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    return synced


@pytest.fixture(scope="session")
def s3_endpoint():
    with local_s3(buckets=(), set_environ=False) as endpoint:
        yield endpoint


def fake_aws(monkeypatch, s3_endpoint: str) -> dict:
    """Fake credentials and the local endpoint, for this process and the ones it starts."""
    settings = fake_aws_env(s3_endpoint)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "S3_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return settings


def fresh_bucket(s3_endpoint: str):
    """Reset the server; a boto3 client and one empty bucket, BUCKET."""
    request = urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(request).close()
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def aws_env(s3_endpoint, monkeypatch):
    return fake_aws(monkeypatch, s3_endpoint)


@pytest.fixture
def s3(aws_env, s3_endpoint):
    return fresh_bucket(s3_endpoint)


@pytest.fixture(scope="module")
def module_s3(s3_endpoint):
    """For a module whose fixtures share runs: the fake AWS settings and .venv's tools on PATH for
    the whole module, and a server reset once for it (the `s3` fixture resets it for every test)."""
    with pytest.MonkeyPatch.context() as patch:
        fake_aws(patch, s3_endpoint)
        patch.setenv("PATH", venv_path())
        yield fresh_bucket(s3_endpoint)


@pytest.fixture
def tool_path(monkeypatch):
    """Put the venv's tools (aws, kubectl, torchrun, s5cmd) first on PATH for child processes."""
    monkeypatch.setenv("PATH", venv_path())


@pytest.fixture
def run(s3, s3_endpoint, tmp_path, tool_path):
    """A run staged in a fresh local S3, the venv's tools on PATH."""
    return Run(s3, s3_endpoint, tmp_path).stage()
