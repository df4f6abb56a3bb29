"""How the pod sorts S3 errors: what a retry may fix (throttling, 5xx, resets) and what it never
will (exit 64, with one line that names the cause and the fix). Pure: errors are built, not met."""

from __future__ import annotations

import errno

import boto3.exceptions
import botocore.exceptions
import pytest
import s3transfer.exceptions

import s3


def client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


TRANSIENT = [
    ("503 slow down", client_error("SlowDown", 503)),
    ("500 internal", client_error("InternalError", 500)),
    ("429 throttled", client_error("Throttling", 429)),
    ("408 timeout", client_error("RequestTimeout", 408)),
    ("no status (reset)", client_error("", 0)),
    ("connection closed", botocore.exceptions.ConnectionClosedError(endpoint_url="http://x")),
    ("endpoint unreachable", botocore.exceptions.EndpointConnectionError(endpoint_url="http://x")),
    ("socket reset", ConnectionResetError(errno.ECONNRESET, "reset")),
    # download_fileobj raises s3transfer's, download_file boto3's, once a part's own retries ran out
    ("part retries ran out", s3transfer.exceptions.RetriesExceededError(ConnectionResetError())),
    ("part retries ran out (boto3)", boto3.exceptions.RetriesExceededError(ConnectionResetError())),
    ("body came up short", s3transfer.exceptions.S3DownloadFailedError("Contents of stream did not match")),
]

PERMANENT = [
    ("no bucket", client_error("NoSuchBucket", 404), "bucket b does not exist; create it or fix the URI s3://b/"),
    ("denied", client_error("AccessDenied", 403), "access to s3://b/ denied"),
    ("unknown key", client_error("InvalidAccessKeyId", 403), "refused by S3 (InvalidAccessKeyId); fix the Secret"),
    ("wrong secret", client_error("SignatureDoesNotMatch", 403), "refused by S3 (SignatureDoesNotMatch)"),
    ("expired token", client_error("ExpiredToken", 400), "refused by S3 (ExpiredToken)"),
    ("store lacks a feature", client_error("NotImplemented", 501), "needs conditional writes"),
    ("no credentials", botocore.exceptions.NoCredentialsError(), "no AWS credentials; create the Secret aws-credentials"),
    ("full disk", OSError(errno.ENOSPC, "No space left on device"), "no space left on the workspace volume"),
    ("read-only disk", OSError(errno.EROFS, "Read-only file system"), "the workspace is read-only (WORK_DIR), not an S3 fault"),
    ("other 4xx", client_error("InvalidArgument", 400), "S3 error InvalidArgument"),
]


@pytest.mark.parametrize("case,err", TRANSIENT, ids=[c[0] for c in TRANSIENT])
def test_transient_errors_are_retried(case, err):
    assert s3.is_transient(err)


@pytest.mark.parametrize("case,err,line", PERMANENT, ids=[c[0] for c in PERMANENT])
def test_permanent_errors_get_one_line_that_names_the_fix(case, err, line):
    assert not s3.is_transient(err)
    explained = s3.explain(err, "b")
    assert line in explained and "\n" not in explained


def test_a_permanent_error_is_not_retried_and_becomes_bad_input():
    calls = []

    def denied():
        calls.append(1)
        raise client_error("AccessDenied", 403)

    with pytest.raises(s3.BadInput, match="upload: access to s3://b/ denied"):
        s3.retrying("upload", "b", seconds=30)(denied)
    assert len(calls) == 1


def test_a_transient_error_is_retried_until_it_passes():
    answers = [client_error("SlowDown", 503), "ok"]

    def flaky():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    retry = s3.retrying("upload", "b", seconds=30)
    retry.retrying.wait = lambda state: 0  # no real backoff in a unit test
    assert retry(flaky) == "ok" and not answers


@pytest.mark.parametrize("uri,bucket,prefix", [
    ("s3://bkt/runs/x", "bkt", "runs/x/"),
    ("s3://bkt/runs/x/", "bkt", "runs/x/"),
    ("s3://bkt", "bkt", ""),
])
def test_locations_normalise_their_prefix(uri, bucket, prefix):
    where = s3.Location.parse(uri)
    assert (where.bucket, where.prefix) == (bucket, prefix)
    assert where.key("checkpoints", "step-00000005", "manifest.json") == prefix + "checkpoints/step-00000005/manifest.json"


@pytest.mark.parametrize("uri", ["", "s3://", "https://bkt/x", "bkt/x", "s3://b/x", "s3://Bkt/x", "s3://bkt_1/x"])
def test_a_location_that_is_not_an_s3_uri_is_bad_input(uri):
    # the same rule as the pod's shell (job/s3_uri.sh): S3 would refuse these buckets only later
    with pytest.raises(s3.BadInput, match="is not an s3://bucket/prefix/ URI"):
        s3.Location.parse(uri)


@pytest.mark.parametrize("body,problem", [
    (b"{" * 100_000 + b"}" * 100_000, "its manifest.json is not JSON"),  # deeper than the parser goes
    (b"not json", "its manifest.json is not JSON"),
    (b" " * (s3.MAX_JSON_BYTES + 1), "its manifest.json is larger than 16 MiB"),
])
def test_json_from_s3_that_is_too_big_or_not_json_is_damage_not_a_crash(body, problem):
    with pytest.raises(ValueError, match=problem):
        s3.parse_json(body, "manifest.json")


def test_json_from_s3_parses():
    assert s3.parse_json(b'{"files": {}}', "manifest.json") == {"files": {}}
