"""Shared fixtures: a real S3 (moto's HTTP server on loopback) reached through AWS_ENDPOINT_URL.

Anything that runs in another process (the AWS CLI, the bootstrap, TensorBoard) talks to the same
server over HTTP, as it would to S3. State is reset between tests.
"""

import logging
import os
import sys
import urllib.request
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "test-bucket"

sys.path.insert(0, str(ROOT / "code"))
sys.path.insert(0, str(ROOT / "scripts" / "lib"))
sys.path.insert(0, str(ROOT / "scripts"))
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request otherwise


@pytest.fixture(scope="session")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def fake_aws(monkeypatch, s3_endpoint: str) -> dict:
    """Fake credentials and the local endpoint, for this process and the ones it starts."""
    settings = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}
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
        patch.setenv("PATH", venv_bin() + os.pathsep + os.environ.get("PATH", ""))
        yield fresh_bucket(s3_endpoint)


def venv_bin() -> str:
    return str(Path(sys.executable).parent)


@pytest.fixture
def tool_path(monkeypatch):
    """Put the venv's tools (aws, kubectl, torchrun, s5cmd) first on PATH for child processes."""
    monkeypatch.setenv("PATH", venv_bin() + os.pathsep + os.environ.get("PATH", ""))
