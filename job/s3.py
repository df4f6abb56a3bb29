"""S3 for the pod's Python helpers: one client, retries with backoff, and errors sorted into those
a retry may fix and those it never will (exit 64, one line that names the cause and the fix).

The endpoint comes from AWS_ENDPOINT_URL (boto3 reads it), so S3-compatible stores work too.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from dataclasses import dataclass

import boto3
import boto3.exceptions
import botocore.exceptions
import s3transfer.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

import s3_errors
from checkpoint import TooDeep, untrusted_json
from contract import EXIT_BAD_INPUT, EXIT_UNAVAILABLE, printable, s3_uri_fault, write_line  # noqa: F401 - the helpers' exit codes, named here too
from contract import POD_ERROR

# Large parts: fewer requests, and S3 servers (moto included) that re-read an object per ranged
# GET stay fast.
# "classic": boto3 would switch to the CRT transfer client where awscrt is installed on a node it
# rates as optimized, and ignore these settings (the memory bound below among them).
TRANSFER = TransferConfig(multipart_threshold=256 << 20, multipart_chunksize=256 << 20,
                          max_concurrency=8, use_threads=True, preferred_transfer_client="classic")
# A download into a stream (hashed as it comes): smaller parts, so the first is whole, and hashed,
# while the rest still download. s3transfer holds at most max_in_memory_download_chunks parts
# ahead of the stream, and max_io_queue pieces of io_chunksize that wait for it: about 150 MB a
# file, 600 MB for the 4 files a restore fetches at once at most (remote_checkpoints). Pieces of
# 8 MB, not s3transfer's 256 KB: each piece is a task with its own locks and context copies, and
# 32 times fewer took a 1.5 GB restore from 6.4 to 5.2 s on 2 cores (docs/performance.md).
IN_ORDER = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20, max_concurrency=8,
                          io_chunksize=8 << 20, max_io_queue=2, use_threads=True, preferred_transfer_client="classic")
IN_ORDER.max_in_memory_download_chunks = 8



class BadInput(Exception):
    """Will fail the same way on every retry: exit 64."""


class Unavailable(Exception):
    """S3 stayed unreachable past the retry bound: exit 75."""


class Stop(Exception):
    """Not an S3 failure: this pod must stop writing (lease.LeaseLost). Retries pass it on."""


def log(name: str, message: str) -> None:
    """One line on the pod's log, whatever the message quotes (a lease holder, an S3 error's text):
    a line break or terminal escape in it could otherwise start a forged EVENT or exit line."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_line(f"{stamp} {name}: {printable(message)}")


@dataclass(frozen=True)
class Location:
    """An s3://bucket/prefix/ (prefix normalized to end in / unless empty)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> "Location":
        """The pod's shell has checked uri already (job/s3_uri.sh); a caller from anywhere else gets the
        same rule here, not a bucket name S3 would refuse later."""
        fault = s3_uri_fault(uri)
        if fault:
            raise BadInput(f"{uri!r} {fault}")
        bucket, _, prefix = uri[5:].partition("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return cls(bucket, prefix)

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def child(self, *parts: str) -> "Location":
        return Location(self.bucket, self.key(*parts).rstrip("/") + "/")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def client():
    """A client whose own retries are few and quick; callers wrap calls in retrying()."""
    config = Config(retries={"mode": "standard", "total_max_attempts": 3},
                    connect_timeout=5, read_timeout=60, max_pool_connections=32)  # 4 files x 8 parts
    try:
        return boto3.client("s3", config=config)
    except botocore.exceptions.BotoCoreError as err:
        raise BadInput(f"cannot make an S3 client: {err}; check AWS_ENDPOINT_URL and AWS_DEFAULT_REGION") from None


def error_code(err: BaseException) -> str:
    if isinstance(err, botocore.exceptions.ClientError):
        return str(err.response.get("Error", {}).get("Code", ""))
    return type(err).__name__


def http_status(err: BaseException) -> int:
    if isinstance(err, botocore.exceptions.ClientError):
        return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    return 0


def is_transient(err: BaseException) -> bool:
    """Throttling, 5xx, timeouts and broken connections pass; wrong buckets or keys, a store
    without what this needs, a full disk never do."""
    if isinstance(err, (botocore.exceptions.NoCredentialsError, botocore.exceptions.ParamValidationError,
                        BadInput)):
        return False
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return False
    if isinstance(err, (s3transfer.exceptions.RetriesExceededError, boto3.exceptions.RetriesExceededError,
                        s3transfer.exceptions.S3DownloadFailedError)):
        return True  # a part's own retries ran out on resets or timeouts, or the body came up short
    if isinstance(err, botocore.exceptions.ClientError):
        code, status = error_code(err), http_status(err)
        return not s3_errors.is_permanent(code) and status != 501 and (
            status >= 500 or status in (0, 408, 429) or code in ("SlowDown", "RequestTimeout", "Throttling"))
    return isinstance(err, (botocore.exceptions.BotoCoreError, OSError))  # OSError: resets, timeouts


def explain(err: BaseException, bucket: str) -> str:
    """One line: what went wrong and how to fix it."""
    where = f"s3://{bucket}/"
    if isinstance(err, botocore.exceptions.NoCredentialsError):
        return s3_errors.explain_code("NoCredentials", where)
    if isinstance(err, botocore.exceptions.ParamValidationError):
        return f"this boto3 lacks a feature the pod needs ({err}); use boto3>=1.36 (job/requirements.txt)"
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the workspace volume; give it more room (emptyDir sizeLimit)"
    if isinstance(err, OSError) and err.errno == errno.EROFS:
        return (f"the workspace is read-only ({err.filename or 'WORK_DIR'}), not an S3 fault; "
                "mount a writable volume (emptyDir) at WORK_DIR")
    if http_status(err) == 501:
        return (f"the S3 store refused {error_code(err)} (501): the run's lease needs conditional writes "
                "(If-None-Match, If-Match); use a store that has them")
    code = error_code(err)
    line = s3_errors.explain_code(code, where)
    if line:
        return line
    return f"S3 error {code or type(err).__name__}: {str(err).splitlines()[0][:200]}"


def retry_seconds() -> float:
    return float(os.environ.get("S3_RETRY_SECONDS", "600"))


def retrying(what: str, bucket: str, seconds: float | None = None, name: str = "s3"):
    """Retry transient errors with exponential backoff and jitter for up to `seconds`, logging each
    wait; then Unavailable. Permanent errors become BadInput at once."""
    def before_sleep(state) -> None:
        err = state.outcome.exception()
        log(name, f"{what}: {explain(err, bucket)}; retry {state.attempt_number} in "
                  f"{state.next_action.sleep:.0f}s")

    return _Retrying(what, bucket, Retrying(
        retry=retry_if_exception(is_transient),
        wait=wait_random_exponential(multiplier=1, max=30),
        stop=stop_after_delay(retry_seconds() if seconds is None else seconds),
        before_sleep=before_sleep, reraise=True))


class _Retrying:
    def __init__(self, what: str, bucket: str, retrying: Retrying):
        self.what, self.bucket, self.retrying = what, bucket, retrying

    def __call__(self, fn, *args, **kwargs):
        try:
            return self.retrying(fn, *args, **kwargs)
        except (BadInput, Unavailable, Stop, ValueError):  # sorted already; ValueError: a bad answer
            raise
        except Exception as err:  # noqa: BLE001 - sorted into the two outcomes right here
            if is_transient(err):
                raise Unavailable(f"{self.what}: S3 still unreachable after retrying for "
                                  f"{self.retrying.stop.max_delay:.0f}s ({explain(err, self.bucket)})") from None
            raise BadInput(f"{self.what}: {explain(err, self.bucket)}") from None


def not_found(err: BaseException) -> bool:
    return error_code(err) in ("404", "NoSuchKey", "NotFound")


# JSON the runtime reads from S3 (manifests, status.json): ~150 bytes a checkpoint file, so room for
# tens of thousands, and a bound on what a hostile object can make the pod read into memory.
MAX_JSON_BYTES = 16 << 20


def get_json(s3, where: Location, key: str, retry) -> tuple[dict | None, str | None]:
    """(object parsed, its ETag) or (None, None) when absent. ValueError, saying why, when it is
    larger than MAX_JSON_BYTES or not JSON: anyone who may write the bucket may have put it there."""
    def fetch():
        try:
            answer = s3.get_object(Bucket=where.bucket, Key=key)
        except botocore.exceptions.ClientError as err:
            if not_found(err):
                return None, None
            raise
        return read_body(answer, MAX_JSON_BYTES), answer["ETag"]

    body, etag = retry(fetch)
    return (None, None) if body is None else (parse_json(body, key.rsplit("/", 1)[-1]), etag)


def read_body(answer: dict, limit: int) -> bytes:
    """A GetObject answer's body, read to its end or to limit + 1 bytes (more: too large), through
    botocore's StreamingBody: at the end it checks the Content-Length (and a checksum S3 sent), so
    a body cut short by the network raises IncompleteReadError, transient and retried. (`with
    answer["Body"] as body` hands out urllib3's raw stream, which checks neither: a manifest or a
    lease cut off midway came back short and read as damaged.)"""
    body, chunks, size = answer["Body"], [], 0
    try:
        while size <= limit and (chunk := body.read(limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        body.close()
    return b"".join(chunks)


def parse_json(body: bytes, name: str):
    if len(body) > MAX_JSON_BYTES:
        raise ValueError(f"its {name} is larger than {MAX_JSON_BYTES >> 20} MiB")
    try:
        return untrusted_json(body)
    except TooDeep as err:
        raise ValueError(f"its {name} is not JSON ({err})") from None
    except ValueError:
        raise ValueError(f"its {name} is not JSON") from None


def put_json(s3, where: Location, key: str, value: dict, retry) -> None:
    body = json.dumps(value, indent=1, sort_keys=True).encode()
    retry(s3.put_object, Bucket=where.bucket, Key=key, Body=body, ContentType="application/json")


def list_prefixes(s3, where: Location, retry) -> list[str]:
    """Names of the 'folders' right under a location."""
    return [p["Prefix"][len(where.prefix):].rstrip("/")
            for page in _pages(s3, where, retry, Delimiter="/") for p in page.get("CommonPrefixes", [])]


def list_objects(s3, where: Location, retry) -> list[dict]:
    return [item for page in _pages(s3, where, retry) for item in page.get("Contents", [])]


def _pages(s3, where: Location, retry, **options) -> list[dict]:
    """Every page of a listing, retried as a whole."""
    paginator = s3.get_paginator("list_objects_v2")
    return retry(lambda: list(paginator.paginate(Bucket=where.bucket, Prefix=where.prefix, **options)))


def main_guard(name: str, run) -> int:
    """Run a helper's main, turning the two failure kinds into exit codes and one line each."""
    try:
        return run()
    except BadInput as err:
        return _failed(name, err, EXIT_BAD_INPUT)
    except Unavailable as err:
        return _failed(name, err, EXIT_UNAVAILABLE)


def _failed(name: str, err: Exception, code: int) -> int:
    log(name, f"error: {err}")
    remember_error(f"{name}: {err}")
    return code


_ERROR_BYTES = 4096  # status.json keeps 300 characters (run_status.MAX_ERROR); an S3 error's text may be long


def remember_error(line: str) -> None:
    """The pod's last error line (STATE_DIR/last-error.txt, as script.sh's die leaves it): the
    uploader's final report puts it in status.json. Its URL credentials hidden by the rules the pod's
    log goes through (redact.sed): an S3 error's text can quote the endpoint's URL."""
    state_dir = os.environ.get("STATE_DIR")
    if not state_dir or not os.path.isdir(state_dir):
        return
    try:
        hidden = subprocess.run(["sed", "-E", "-f", os.path.join(os.path.dirname(__file__), "redact.sed")],
                                input=" ".join(line.split()).encode(), capture_output=True, timeout=30,
                                env={**os.environ, "LC_ALL": "C"}, check=True).stdout
        with open(os.path.join(state_dir, POD_ERROR), "wb") as file:
            file.write(hidden[:_ERROR_BYTES])
    except (OSError, subprocess.SubprocessError):
        pass  # the line is on the log already; status.json then names only the exit code

