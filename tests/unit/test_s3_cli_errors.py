"""The AWS CLI's and s5cmd's error text sorted by the one table in job/s3_errors.py: what no retry
fixes gets one line naming the cause and the fix (script.sh, tensorboard.sh); the rest is retried."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import s3_errors

JOB = Path(__file__).resolve().parents[2] / "job"
URI = "s3://b/code/"

CASES = [
    # (output, the line expected to contain; None: a retry may pass)
    ("An error occurred (NoSuchBucket) when calling the ListObjectsV2 operation: The specified bucket does not exist",
     "bucket b does not exist; create it or fix the URI s3://b/code/"),
    ("An error occurred (404) when calling the HeadBucket operation: Not Found", "bucket b does not exist"),
    ('ERROR "sync s3://b/code/* /w/": NoSuchBucket: The specified bucket does not exist status code: 404',
     "bucket b does not exist"),
    ("An error occurred (403) when calling the HeadBucket operation: Forbidden",
     "access to s3://b/code/ denied; give the pod's role or Secret s3:ListBucket"),
    ("An error occurred (AccessDenied) when calling the ListObjectsV2 operation: Access Denied", "access to s3://b/code/ denied"),
    ('ERROR "ls s3://b/code/": AccessDenied: Access Denied status code: 403', "access to s3://b/code/ denied"),
    ("An error occurred (AllAccessDisabled) when calling the GetObject operation: All access disabled",
     "access to s3://b/code/ denied"),
    ("fatal error: An error occurred (InvalidAccessKeyId) when calling the ListObjectsV2 operation: (403)",
     "refused by S3 (InvalidAccessKeyId"),
    ("An error occurred (SignatureDoesNotMatch) when calling the ListObjectsV2 operation: ...", "refused by S3 (SignatureDoesNotMatch); fix the Secret"),
    ("An error occurred (ExpiredToken) when calling the HeadBucket operation", "refused by S3 (ExpiredToken)"),
    ("An error occurred (InvalidBucketName) when calling the ListObjectsV2 operation", "b is not a valid bucket name"),
    ('Unable to locate credentials. You can configure credentials by running "aws configure".',
     "no AWS credentials; create the Secret aws-credentials"),
    ('ERROR "sync s3://b/code/*": NoCredentialProviders: no valid providers in chain', "no AWS credentials"),
    ("Could not connect to the endpoint URL: \"http://127.0.0.1:9/b\"", None),
    ("An error occurred (SlowDown) when calling the PutObject operation (reached max retries: 4)", None),
    ("An error occurred (InternalError) when calling the ListObjectsV2 operation (500)", None),
    ("Read timeout on endpoint URL", None),
    ("An error occurred (404) when calling the HeadObject operation: Not Found", None),  # a key, not the bucket
    ("", None),
]


@pytest.mark.parametrize("output,line", CASES, ids=[c[0][:50] or "empty" for c in CASES])
def test_cli_output_is_explained_by_the_table(output, line):
    explained = s3_errors.explain_cli(output, URI)
    if line is None:
        assert explained is None
    else:
        assert explained is not None and line in explained and "\n" not in explained


def test_a_local_tool_is_told_its_own_fix():
    line = s3_errors.explain_cli("Unable to locate credentials", URI, "local")
    assert line == "no AWS credentials; set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"


def test_every_cli_marker_names_a_code_of_the_table():
    assert {code for _, code in s3_errors.CLI_MARKERS} <= set(s3_errors.PERMANENT)


@pytest.mark.parametrize("args,stdin,out,code", [
    (["explain-cli", URI], "An error occurred (AccessDenied) when", "access to s3://b/code/ denied", 0),
    (["explain-cli", URI, "--for", "local"], "(AccessDenied)", "these credentials need s3:ListBucket", 0),
    (["explain-cli", URI], "Could not connect to the endpoint URL", "", 0),
    (["explain"], "", "", 64),
])
def test_the_command_runs_on_a_bare_python(args, stdin, out, code):
    """-S -I: no site-packages (no boto3), as the image's python3 before the pod's Python is chosen."""
    result = subprocess.run([sys.executable, "-S", "-I", str(JOB / "s3_errors.py"), *args], input=stdin,
                            capture_output=True, text=True)
    assert result.returncode == code, result.stderr
    assert (out in result.stdout) if out else result.stdout == ""
