"""The lab's S3 (podlab.local_s3, moto's server) answers a ranged GET by reading only its bytes, and
answers every range exactly as moto itself does (compared with an unpatched moto server in a process
of its own). Real clients: boto3's, the AWS CLI's and s5cmd's multi-part downloads. About 15 s here."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from moto.s3.models import FakeKey
from moto.s3.responses import S3Response

from helpers import sha256
from podlab import BUCKET, VENV_BIN, fake_aws_env

# moto reads the access key from Authorization but checks no signature.
FAKE_AUTH = ("AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
             "SignedHeaders=host, Signature=0")
SIZE = 1000
OBJECT = bytes(range(256)) * 3 + os.urandom(SIZE - 768)
PART = 5 << 20
BIG = 24 << 20
# Headers that differ between any two servers or requests.
VOLATILE = {"date", "server", "last-modified", "x-amzn-requestid", "x-amz-request-id", "x-amz-id-2"}


@pytest.fixture
def whole_reads(monkeypatch) -> list[str]:
    """The names of the keys whose whole value moto read (FakeKey.value), in the server's thread."""
    reads = []
    value = FakeKey.value

    def counted(key):
        reads.append(key.name)
        return value.fget(key)
    monkeypatch.setattr(FakeKey, "value", property(counted, value.fset))
    return reads


@pytest.fixture
def ranged_gets(monkeypatch) -> list[str]:
    """The Range header of every GET that moto's range code answered."""
    seen = []
    handle = S3Response._handle_range_header

    def counted(self, request, headers, content):
        seen.append(request.headers.get("range"))
        return handle(self, request, headers, content)
    monkeypatch.setattr(S3Response, "_handle_range_header", counted)
    return seen


@pytest.fixture(scope="module")
def reference_moto():
    """An unpatched moto server (the same ThreadedMotoServer) in a process of its own: its endpoint."""
    code = ("import time; from moto.server import ThreadedMotoServer as S\n"
            "s = S(ip_address='127.0.0.1', port=0, verbose=False); s.start()\n"
            "print(s.get_host_and_port()[1], flush=True); time.sleep(3600)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(server.stdout.readline())}"
    finally:
        server.kill()
        server.wait()


def client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def stage(endpoint: str) -> dict:
    """BUCKET with OBJECT (SHA256 checksum) and an empty object; `versioned` with two versions of
    `v`: the first one's id."""
    s3 = client(endpoint)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="obj", Body=OBJECT, ChecksumAlgorithm="SHA256")
    s3.put_object(Bucket=BUCKET, Key="empty", Body=b"")
    s3.create_bucket(Bucket="versioned")
    s3.put_bucket_versioning(Bucket="versioned", VersioningConfiguration={"Status": "Enabled"})
    first = s3.put_object(Bucket="versioned", Key="v", Body=OBJECT[:500])["VersionId"]
    s3.put_object(Bucket="versioned", Key="v", Body=OBJECT)
    return {"etag": s3.head_object(Bucket=BUCKET, Key="obj")["ETag"], "first": first}


def answer(endpoint: str, path: str, headers: dict, method: str = "GET") -> tuple:
    """(status, headers without the volatile ones, body) of one raw request."""
    host, port = endpoint.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, headers={"Authorization": FAKE_AUTH, **headers})
        response = connection.getresponse()
        body = response.read()
        kept = {name.lower(): value for name, value in response.getheaders() if name.lower() not in VOLATILE}
        if "x-amz-version-id" in kept:
            kept["x-amz-version-id"] = "(an id)"
        if "<RequestId>" in body.decode("latin-1"):
            body = body.split(b"<RequestId>")[0]
        return response.status, kept, body
    finally:
        connection.close()


RANGES = ["bytes=0-0", "bytes=999-999", "bytes=999-", "bytes=600-", "bytes=-1", "bytes=-100", "bytes=-1000",
          "bytes=-5000", "bytes=0-", "bytes=0-999", "bytes=0-5000", "bytes=100-199", "bytes=1000-",
          "bytes=1000-1005", "bytes=-0", "bytes=0-9,20-29", "bytes=abc", "bytes=5-2", "bytes=", "bytes=-",
          "items=0-9", "bytes=1-2-3", "bytes", "bytes= 3-7"]


@pytest.fixture(scope="module")
def both(s3_endpoint, reference_moto):
    """Our server and the unpatched one, reset and staged alike."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST")).close()
    ours, theirs = stage(s3_endpoint), stage(reference_moto)
    assert ours["etag"] == theirs["etag"]
    return {s3_endpoint: ours, reference_moto: theirs}


@pytest.mark.parametrize("rng", RANGES)
@pytest.mark.parametrize("checksum", [False, True])
def test_a_range_is_answered_as_unpatched_moto_answers_it(both, rng, checksum):
    headers = {"Range": rng, **({"x-amz-checksum-mode": "ENABLED"} if checksum else {})}
    ours, theirs = (answer(endpoint, f"/{BUCKET}/obj", headers) for endpoint in both)
    assert ours == theirs


@pytest.mark.parametrize("what", ["head", "part 1", "part 2", "not modified", "if-match fails", "old version",
                                  "missing key", "empty object", "no range"])
def test_other_requests_with_a_range_are_answered_as_unpatched_moto_answers_them(both, what):
    def request(endpoint: str):
        etag = both[endpoint]["etag"]
        path, headers, method = f"/{BUCKET}/obj", {"Range": "bytes=10-19"}, "GET"
        if what == "head":
            method = "HEAD"
        elif what.startswith("part"):
            path += f"?partNumber={what[-1]}"
        elif what == "not modified":
            headers["If-None-Match"] = etag
        elif what == "if-match fails":
            headers["If-Match"] = '"0123"'
        elif what == "old version":
            path = f"/versioned/v?versionId={both[endpoint]['first']}"
        elif what == "missing key":
            path = f"/{BUCKET}/nothing"
        elif what == "empty object":
            path, headers["Range"] = f"/{BUCKET}/empty", "bytes=0-0"
        elif what == "no range":
            del headers["Range"]
        return answer(endpoint, path, headers, method)

    ours, theirs = (request(endpoint) for endpoint in both)
    assert ours == theirs


def test_a_ranged_get_does_not_read_the_whole_object(s3, whole_reads, ranged_gets):
    s3.put_object(Bucket=BUCKET, Key="obj", Body=OBJECT)
    for rng, expected in (("bytes=0-0", OBJECT[:1]), ("bytes=999-", OBJECT[999:]), ("bytes=-100", OBJECT[-100:]),
                          ("bytes=300-599", OBJECT[300:600])):
        assert s3.get_object(Bucket=BUCKET, Key="obj", Range=rng)["Body"].read() == expected
    assert len(ranged_gets) == 4
    assert whole_reads == []
    # A GET with no range, or one moto ignores (two ranges), still reads it whole, as moto does.
    assert s3.get_object(Bucket=BUCKET, Key="obj")["Body"].read() == OBJECT
    assert s3.get_object(Bucket=BUCKET, Key="obj", Range="bytes=0-1,5-6")["Body"].read() == OBJECT
    assert whole_reads == ["obj", "obj"]


def test_multi_part_downloads_of_real_clients_are_byte_identical(s3, aws_env, tmp_path, whole_reads,
                                                                 ranged_gets):
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(BIG))
    parts = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=4)
    s3.upload_file(str(source), BUCKET, "big.bin", Config=parts)
    expected, least = sha256(source), BIG // PART
    whole_reads.clear()  # completing the upload reads each part whole: not what this test is about

    s3.download_file(BUCKET, "big.bin", str(tmp_path / "boto3.bin"), Config=parts)
    assert sha256(tmp_path / "boto3.bin") == expected
    assert len(ranged_gets) >= least

    config = tmp_path / "aws-config"
    config.write_text(f"[default]\ns3 =\n  multipart_threshold = {PART}\n  multipart_chunksize = {PART}\n")
    env = {**os.environ, **fake_aws_env(aws_env["AWS_ENDPOINT_URL"]), "AWS_CONFIG_FILE": str(config),
           "S3_ENDPOINT_URL": aws_env["AWS_ENDPOINT_URL"]}
    subprocess.run([str(VENV_BIN / "aws"), "s3", "cp", f"s3://{BUCKET}/big.bin", str(tmp_path / "aws.bin")],
                   env=env, check=True, capture_output=True)
    assert sha256(tmp_path / "aws.bin") == expected
    assert len(ranged_gets) >= 2 * least

    subprocess.run([str(VENV_BIN / "s5cmd"), "cp", "--part-size", str(PART >> 20), f"s3://{BUCKET}/big.bin",
                    str(tmp_path / "s5cmd.bin")], env=env, check=True, capture_output=True)
    assert sha256(tmp_path / "s5cmd.bin") == expected
    assert len(ranged_gets) >= 3 * least
    assert whole_reads == []
