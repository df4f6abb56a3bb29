"""lab/s3_fault_proxy.py between real clients (AWS CLI, boto3, raw HTTP) and the moto S3."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import (ClientError, ConnectionClosedError, EndpointConnectionError, IncompleteReadError,
                                 ResponseStreamingError)

from helpers import sha256
from podlab import BUCKET, ROOT, wait_until
from s3_fault_proxy import FaultProxy

CONNECTION_ERRORS = (ConnectionClosedError, EndpointConnectionError)
# moto reads the access key from Authorization but checks no signature.
FAKE_AUTH = ("AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
             "SignedHeaders=host, Signature=0")


@pytest.fixture
def proxy(s3, s3_endpoint):
    """A proxy with no faults, in front of a reset moto that has BUCKET."""
    with FaultProxy(upstream=s3_endpoint, seed=1) as running:
        yield running


def client_through(proxy, attempts=1):
    # total_max_attempts counts the first try; botocore's max_attempts counts only the retries.
    config = Config(retries={"total_max_attempts": attempts, "mode": "standard"},
                    connect_timeout=5, read_timeout=20)
    return boto3.client("s3", endpoint_url=proxy.url, config=config)


def outcomes(proxy):
    return [outcome for _, _, _, outcome in proxy.stats()["recent"]]


def control(url, route, payload=None):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(f"{url}/__faults__/{route}", data=data,
                                     method="GET" if data is None else "POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


# No faults: everything passes through unchanged


def test_aws_cli_copies_20mb_up_and_down_in_parts(proxy, aws_env, tool_path, tmp_path):
    config = tmp_path / "aws-config"
    config.write_text("[default]\ns3 =\n  multipart_threshold = 8MB\n  multipart_chunksize = 8MB\n")
    env = dict(os.environ, AWS_ENDPOINT_URL=proxy.url, AWS_CONFIG_FILE=str(config))
    original = tmp_path / "big.bin"
    original.write_bytes(os.urandom(20 * 1024 * 1024))
    copy = tmp_path / "copy.bin"

    for source, destination in ((original, f"s3://{BUCKET}/big.bin"),
                                (f"s3://{BUCKET}/big.bin", copy)):
        subprocess.run(["aws", "s3", "cp", "--only-show-errors", str(source), str(destination)],
                       env=env, check=True, timeout=60)

    assert sha256(copy) == sha256(original)
    stats = proxy.stats()
    assert stats["by_outcome"]["forwarded"] == stats["total"]
    assert stats["by_method"]["PUT"] >= 3  # three 8 MB parts
    assert stats["by_method"]["POST"] >= 2  # create and complete the multipart upload
    assert stats["by_method"]["GET"] >= 3  # ranged GETs


def test_boto3_put_get_head_list_delete(proxy):
    client = client_through(proxy)
    client.put_object(Bucket=BUCKET, Key="dir/a.txt", Body=b"0123456789" * 1000)

    assert client.get_object(Bucket=BUCKET, Key="dir/a.txt")["Body"].read() == b"0123456789" * 1000
    ranged = client.get_object(Bucket=BUCKET, Key="dir/a.txt", Range="bytes=10-14")
    assert ranged["Body"].read() == b"01234"
    assert ranged["ContentRange"] == "bytes 10-14/10000"
    assert client.head_object(Bucket=BUCKET, Key="dir/a.txt")["ContentLength"] == 10000
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix="dir/")
    assert [item["Key"] for item in listing["Contents"]] == ["dir/a.txt"]
    client.delete_object(Bucket=BUCKET, Key="dir/a.txt")
    assert client.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0
    assert set(proxy.stats()["by_method"]) == {"PUT", "GET", "HEAD", "DELETE"}


def send_head(sock, method, path, headers, body=b""):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {sock.getpeername()[0]}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


def read_answer(sock_file):
    """(status, headers, body) of one answer, read from a keep-alive connection."""
    status = int(sock_file.readline().split()[1])
    headers = {}
    while (line := sock_file.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = sock_file.read(int(headers.get("content-length", 0)))
    return status, headers, body


def test_chunked_upload_after_100_continue_then_keep_alive_get(proxy):
    host, port = proxy.url.removeprefix("http://").split(":")
    chunks = [b"hello, ", b"chunked ", b"world" * 1000]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks) + b"0\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        answers = sock.makefile("rb")
        send_head(sock, "PUT", f"/{BUCKET}/chunked.txt", {
            "Authorization": FAKE_AUTH, "Transfer-Encoding": "chunked",
            "Expect": "100-continue", "x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
        assert answers.readline().startswith(b"HTTP/1.1 100")
        assert answers.readline() == b"\r\n"
        sock.sendall(framed)
        assert read_answer(answers)[0] == 200

        send_head(sock, "GET", f"/{BUCKET}/chunked.txt", {"Authorization": FAKE_AUTH})
        status, _, body = read_answer(answers)
    assert (status, body) == (200, b"".join(chunks))
    assert proxy.stats()["by_outcome"]["forwarded"] == 2


# Faults


def test_error_rate_one_answers_slowdown_or_internal_error(proxy, s3):
    client = client_through(proxy)
    proxy.configure(error_rate=1.0, error_statuses=[503])
    with pytest.raises(ClientError) as slowdown:
        client.put_object(Bucket=BUCKET, Key="never", Body=b"x" * 100_000)
    proxy.configure(error_statuses=[500])
    with pytest.raises(ClientError) as internal:
        client.get_object(Bucket=BUCKET, Key="never")

    assert slowdown.value.response["Error"]["Code"] == "SlowDown"
    assert slowdown.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert internal.value.response["Error"]["Code"] == "InternalError"
    assert internal.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert s3.list_objects_v2(Bucket=BUCKET)["KeyCount"] == 0  # never forwarded


def test_error_answers_expect_100_without_continue(proxy):
    proxy.configure(error_rate=1.0, error_statuses=[503])
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        send_head(sock, "PUT", f"/{BUCKET}/k", {"Authorization": FAKE_AUTH, "Content-Length": "5",
                                                "Expect": "100-continue"})
        status, headers, body = read_answer(sock.makefile("rb"))
    assert status == 503
    assert headers["connection"] == "close"  # the unsent body makes the connection unusable
    assert b"<Code>SlowDown</Code>" in body


@pytest.mark.parametrize("point", ["before_body", "after_body"])
def test_reset_rate_one_is_a_connection_error(proxy, s3, point):
    proxy.configure(reset_rate=1.0, reset_points=[point])
    with pytest.raises(CONNECTION_ERRORS):
        client_through(proxy).put_object(Bucket=BUCKET, Key="never", Body=b"x" * 100_000)
    assert proxy.stats()["by_outcome"]["reset"] == 1
    assert s3.list_objects_v2(Bucket=BUCKET)["KeyCount"] == 0


def test_reset_after_upstream_loses_the_answer_not_the_write(proxy, s3):
    proxy.configure(reset_rate=1.0, reset_points=["after_upstream"])
    with pytest.raises(CONNECTION_ERRORS):
        client_through(proxy).put_object(Bucket=BUCKET, Key="written", Body=b"data")
    assert s3.get_object(Bucket=BUCKET, Key="written")["Body"].read() == b"data"


def test_mid_body_delivers_the_head_and_half_the_body_then_closes(proxy, s3):
    body = os.urandom(3 << 20)
    s3.put_object(Bucket=BUCKET, Key="big", Body=body)
    proxy.configure(reset_rate=1.0, reset_points=["mid_body"])
    answer = client_through(proxy).get_object(Bucket=BUCKET, Key="big")
    assert answer["ContentLength"] == len(body), "the head came whole"
    got = bytearray()
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        while piece := answer["Body"].read(64 << 10):
            got += piece
    assert len(got) == len(body) // 2 and got == body[:len(got)], "the first half, then the end"


def test_slow_answers_after_slow_seconds(proxy):
    proxy.configure(slow_rate=1.0, slow_seconds=0.5)
    client = client_through(proxy)
    started = time.monotonic()
    client.head_bucket(Bucket=BUCKET)
    assert time.monotonic() - started >= 0.5
    assert outcomes(proxy) == ["slow"]


def test_standard_retries_ride_out_a_30_percent_error_rate(proxy, s3):
    proxy.configure(error_rate=0.3)
    client = client_through(proxy, attempts=10)
    for index in range(20):
        client.put_object(Bucket=BUCKET, Key=f"obj-{index}", Body=b"payload")

    stats = proxy.stats()
    assert stats["by_outcome"]["error"] > 0
    assert stats["total"] == 20 + stats["by_outcome"]["error"]
    puts = [path for _, method, path, _ in stats["recent"] if method == "PUT"]
    assert len(puts) > len(set(puts)) == 20  # some keys were retried
    assert s3.list_objects_v2(Bucket=BUCKET)["KeyCount"] == 20


def test_same_seed_same_faults(s3, s3_endpoint):
    runs = []
    for _ in range(2):
        with FaultProxy(upstream=s3_endpoint, seed=7, error_rate=0.5) as proxy:
            client = client_through(proxy)
            for _ in range(12):
                try:
                    client.head_bucket(Bucket=BUCKET)
                except ClientError:
                    pass
            runs.append(outcomes(proxy))
    assert runs[0] == runs[1]
    assert {"error", "forwarded"} == set(runs[0])


# Outages


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_outage_fails_every_call_with_bounded_retries_until_off(proxy, fault):
    client = client_through(proxy, attempts=3)
    proxy.configure(outage=True, outage_fault=fault)
    for _ in range(2):
        with pytest.raises((ClientError, *CONNECTION_ERRORS)):
            client.head_bucket(Bucket=BUCKET)
    assert proxy.stats()["by_outcome"]["outage"] == 6  # 3 attempts per call, no hot loop

    proxy.configure(outage=False)
    client.head_bucket(Bucket=BUCKET)
    assert outcomes(proxy)[-1] == "forwarded"


def test_timed_outage_ends_by_itself(proxy):
    client = client_through(proxy)
    proxy.configure(outage_seconds=3.0)
    assert proxy.config()["outage"] is True
    with pytest.raises(ClientError):
        client.head_bucket(Bucket=BUCKET)
    assert wait_until(lambda: proxy.config()["outage"] is False, timeout=10)
    client.head_bucket(Bucket=BUCKET)
    assert outcomes(proxy) == ["outage", "forwarded"]


# Stats and control


def test_stats_count_by_method_and_outcome_but_not_control_requests(proxy):
    client = client_through(proxy)
    client.put_object(Bucket=BUCKET, Key="k", Body=b"v")
    proxy.configure(error_rate=1.0)
    with pytest.raises(ClientError):
        client.get_object(Bucket=BUCKET, Key="k")
    proxy.configure(error_rate=0.0, outage=True)
    with pytest.raises(ClientError):
        client.head_object(Bucket=BUCKET, Key="k")
    control(proxy.url, "stats")
    control(proxy.url, "config", {"outage": False})

    stats = proxy.stats()
    assert stats["total"] == 3
    assert stats["by_method"] == {"PUT": 1, "GET": 1, "HEAD": 1}
    assert stats["by_outcome"] == {"forwarded": 1, "error": 1, "reset": 0, "slow": 0, "outage": 1}
    assert [(method, path, outcome) for _, method, path, outcome in stats["recent"]] == [
        ("PUT", f"/{BUCKET}/k", "forwarded"), ("GET", f"/{BUCKET}/k", "error"),
        ("HEAD", f"/{BUCKET}/k", "outage")]
    proxy.reset_stats()
    assert proxy.stats()["total"] == 0


def test_presigned_signatures_stay_out_of_stats(proxy):
    signer = boto3.client("s3", endpoint_url=proxy.url, config=Config(signature_version="s3v4"))
    url = signer.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": "k"})
    proxy.configure(error_rate=1.0)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(url, timeout=10)
    (_, _, path, _), = proxy.stats()["recent"]
    assert "X-Amz-Signature=REDACTED" in path and "X-Amz-Credential=REDACTED" in path
    assert "testing" not in path


def test_bad_settings_are_refused(proxy):
    with pytest.raises(ValueError):
        proxy.configure(error_rate=1.5)
    with pytest.raises(ValueError):
        proxy.configure(no_such_setting=1)
    with pytest.raises(urllib.error.HTTPError) as refused:
        control(proxy.url, "config", {"outage_fault": "teapot"})
    assert refused.value.code == 400
    assert proxy.config()["outage_fault"] == "503"


def test_cli_prints_url_takes_control_requests_and_stops_on_sigterm(s3, s3_endpoint, tmp_path):
    port_file = tmp_path / "port"
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "lab" / "s3_fault_proxy.py"), "--upstream", s3_endpoint,
         "--port", "0", "--port-file", str(port_file), "--seed", "3", "--verbose"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        assert url == f"http://127.0.0.1:{port_file.read_text().strip()}"
        client = boto3.client("s3", endpoint_url=url,
                              config=Config(retries={"total_max_attempts": 1}))
        client.head_bucket(Bucket=BUCKET)

        config = control(url, "config", {"error_rate": 1.0, "error_statuses": [503]})
        assert (config["error_rate"], config["seed"]) == (1.0, 3)
        with pytest.raises(ClientError, match="SlowDown"):
            client.get_object(Bucket=BUCKET, Key="k")
        stats = control(url, "stats")
        assert stats["by_outcome"]["forwarded"] == stats["by_outcome"]["error"] == 1

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait()
    log = process.stderr.read()
    assert log.count("\n") == 1 and "error: 503 for GET /test-bucket/k" in log
    assert "testing" not in log  # no credentials, no header values
