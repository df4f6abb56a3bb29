"""The one table of S3 errors no retry fixes: each error code and the one line that names its cause
and fix. s3.py (boto3's errors, in the pod's helpers), script.sh and scripts/tensorboard.sh (the AWS
CLI's and s5cmd's error text, through the command below) and scripts/status.py all say it this way.

    python3 s3_errors.py explain-cli URI [--for pod|local] < the command's output

prints the line when the output shows such an error, nothing when a retry may still pass (exit 0
both; 64 on a usage error). Standard library only: script.sh runs it with the image's python3
before the pod's Python (and boto3) is chosen.
"""

from __future__ import annotations

import sys

# What the fix is depends on who reads the line: the pod (its Secret or IAM role) or a person
# running a tool on a laptop (their own AWS settings).
FIXES = {
    "pod": {
        "no_credentials": "create the Secret aws-credentials (see README) or give the pod an IAM role",
        "bad_credentials": "fix the Secret aws-credentials (or the pod's IAM role)",
        "permissions": "give the pod's role or Secret s3:ListBucket and s3:GetObject there "
                       "(and s3:PutObject, s3:DeleteObject on S3_OUTPUT_URI)",
    },
    "local": {
        "no_credentials": "set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        "bad_credentials": "renew or fix them",
        "permissions": "these credentials need s3:ListBucket and s3:GetObject there",
    },
}

PERMANENT = {
    "NoSuchBucket": "bucket {bucket} does not exist; create it or fix the URI {uri}",
    "InvalidBucketName": "{bucket} is not a valid bucket name; fix the URI {uri}",
    "AccessDenied": "access to {uri} denied; {permissions}",
    "AllAccessDisabled": "access to {uri} denied; {permissions}",
    "NoCredentials": "no AWS credentials; {no_credentials}",
    # The code names the cause (unknown key, wrong secret, expired session token).
    "InvalidAccessKeyId": "the AWS credentials were refused by S3 (InvalidAccessKeyId); {bad_credentials}",
    "SignatureDoesNotMatch": "the AWS credentials were refused by S3 (SignatureDoesNotMatch); {bad_credentials}",
    "ExpiredToken": "the AWS credentials were refused by S3 (ExpiredToken); {bad_credentials}",
    "InvalidToken": "the AWS credentials were refused by S3 (InvalidToken); {bad_credentials}",
}

# Codes as they come without a name: a HEAD has no body, so S3 answers it with the status alone.
ALIASES = {"403": "AccessDenied", "Forbidden": "AccessDenied"}

# The AWS CLI and s5cmd print the code among other words. The specific codes come before the
# generic "(403)": a refused key is also a 403.
CLI_MARKERS = (
    ("NoSuchBucket", "NoSuchBucket"),
    ("(404) when calling the HeadBucket", "NoSuchBucket"),
    ("InvalidBucketName", "InvalidBucketName"),
    ("InvalidAccessKeyId", "InvalidAccessKeyId"),
    ("SignatureDoesNotMatch", "SignatureDoesNotMatch"),
    ("ExpiredToken", "ExpiredToken"),
    ("InvalidToken", "InvalidToken"),
    ("Unable to locate credentials", "NoCredentials"),
    ("NoCredentialProviders", "NoCredentials"),
    ("no valid providers", "NoCredentials"),
    ("AllAccessDisabled", "AllAccessDisabled"),
    ("AccessDenied", "AccessDenied"),
    ("Forbidden", "AccessDenied"),
    ("(403)", "AccessDenied"),
)


def is_permanent(code: str) -> bool:
    return ALIASES.get(code, code) in PERMANENT


def explain_code(code: str, uri: str, audience: str = "pod") -> str | None:
    """The line for an error code no retry fixes, or None."""
    template = PERMANENT.get(ALIASES.get(code, code))
    if template is None:
        return None
    bucket = uri[len("s3://"):].split("/", 1)[0] if uri.startswith("s3://") else uri
    return template.format(bucket=bucket, uri=uri, **FIXES[audience])


def classify_cli(text: str) -> str | None:
    """The permanent error code an AWS CLI / s5cmd output shows, or None."""
    for marker, code in CLI_MARKERS:
        if marker in text:
            return code
    return None


def explain_cli(text: str, uri: str, audience: str = "pod") -> str | None:
    code = classify_cli(text)
    return None if code is None else explain_code(code, uri, audience)


def main(argv: list[str]) -> int:
    audience = "pod"
    if len(argv) == 4 and argv[2] == "--for" and argv[3] in FIXES:
        audience = argv[3]
        argv = argv[:2]
    if len(argv) != 2 or argv[0] != "explain-cli":
        print("usage: s3_errors.py explain-cli URI [--for pod|local] < output", file=sys.stderr)
        return 64
    # The CLI's last lines say what failed; a bound on what is read from a child's output.
    line = explain_cli(sys.stdin.read()[-4000:], argv[1], audience)
    if line:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
