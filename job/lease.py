"""One writer per S3_OUTPUT_URI: a lease object in S3 with a heartbeat and an expiry.

A Kubernetes Job may run the same pod twice (and a pod cut off from the API server keeps running).
Two pods writing one prefix would overwrite each other's checkpoints, so every writer first takes
`lease.json` with a conditional PUT (If-None-Match: * to create, If-Match: <etag> to renew or to take
over an expired one); S3 lets exactly one of two racing writers win. Expiry is judged on S3's clock
(the object's LastModified against the response's Date), so pods' clock skew does not matter.

The holder renews every ttl/3 from a thread. A holder that cannot prove its lease is fresh writes
nothing; one whose renewal is refused (412) has lost it and stops.

    python lease.py acquire S3_OUTPUT_URI STATE_FILE   # waits while another live pod holds it
    exit 0: held (token in STATE_FILE), 3: the run is already COMPLETE, 64/75: errors
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import botocore.exceptions

import s3 as s3lib
from s3 import Location, log

KEY = "lease.json"
EXIT_COMPLETE = 3


def _once(fn, *args):
    """No retries: the caller's caller sorts what fails."""
    return fn(*args)


class LeaseLost(s3lib.Stop):
    """Another pod holds the lease now: this one must not write."""


def ttl_seconds() -> float:
    return float(os.environ.get("LEASE_TTL_SECONDS", "120"))


class Lease:
    def __init__(self, s3, run: Location, holder: str, ttl: float, etag: str | None = None,
                 path: Path | None = None):
        self.s3, self.run, self.holder, self.ttl = s3, run, holder, ttl
        self.etag = etag
        self.path = path  # where the current ETag is kept for the pod's next helper
        self.renewed = 0.0  # not proven fresh until renewed
        self._lock = threading.Lock()

    # -- taking it -----------------------------------------------------------------------------

    def acquire(self, wait_seconds: float) -> bool:
        """Block until this pod holds the lease (True) or the run is COMPLETE (False)."""
        retry = s3lib.retrying("lease", self.run.bucket, name="lease")
        self._take(retry, wait_seconds)
        # The pod before may have finished the run and let the lease go just now.
        if retry(self._complete):
            self.release(retry)
            return False
        return True

    def _take(self, retry, wait_seconds: float) -> None:
        deadline = time.monotonic() + wait_seconds
        while True:
            current = retry(self._read)
            if current is None and retry(self._put, if_none_match=True):
                return
            if current is not None:
                owner, etag, age = current
                if owner == self.holder:  # our write landed though its answer was lost
                    self._hold(etag, age)
                    return
                if age > self.ttl and retry(self._put, if_match=etag):
                    log("lease", f"took over the lease of {owner}, expired {age - self.ttl:.0f}s ago")
                    return
                if age <= self.ttl:
                    if retry(self._complete):
                        return
                    if time.monotonic() > deadline:
                        raise s3lib.Unavailable(f"another pod ({owner}) holds the lease on {self.run} "
                                                f"(renewed {age:.0f}s ago); gave up after {wait_seconds:.0f}s")
                    log("lease", f"{owner} holds the lease on {self.run} (renewed {age:.0f}s ago): waiting")
                    time.sleep(min(10.0, max(1.0, self.ttl - age + 0.5)))

    def _read(self) -> tuple[str, str, float] | None:
        """(holder, etag, seconds since its last renewal on S3's clock) or None."""
        try:
            answer = self.s3.get_object(Bucket=self.run.bucket, Key=self.run.key(KEY))
        except botocore.exceptions.ClientError as err:
            if s3lib.not_found(err):
                return None
            raise
        body = json.loads(answer["Body"].read())
        server_now = _server_time(answer)
        age = (server_now - answer["LastModified"]).total_seconds()
        return body.get("holder", "?"), answer["ETag"], age

    def _complete(self) -> bool:
        try:
            self.s3.head_object(Bucket=self.run.bucket, Key=self.run.key("COMPLETE"))
            return True
        except botocore.exceptions.ClientError as err:
            if s3lib.not_found(err):
                return False
            raise

    def _put(self, if_none_match: bool = False, if_match: str | None = None) -> bool:
        """A conditional write of the lease; False when another writer got there first."""
        body = json.dumps({"holder": self.holder, "ttl_seconds": self.ttl, "pod": os.environ.get("HOSTNAME", ""),
                           "renewed_at": time.time()}).encode()
        condition = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match}
        try:
            answer = self.s3.put_object(Bucket=self.run.bucket, Key=self.run.key(KEY), Body=body,
                                        ContentType="application/json", **condition)
        except botocore.exceptions.ClientError as err:
            if s3lib.http_status(err) in (409, 412):
                return False
            raise
        self._hold(answer["ETag"])
        return True

    def _hold(self, etag: str, age: float = 0.0) -> None:
        """Ours, as of `age` seconds ago; saved at once, so a SIGTERM right after still lets the
        pod's last helper release it."""
        self.etag, self.renewed = etag, time.monotonic() - age
        if self.path:
            self.save(self.path)

    # -- keeping it ----------------------------------------------------------------------------

    def renew(self) -> None:
        """Prove the lease is still ours and push its expiry. LeaseLost if another pod has it;
        S3's own error when S3 cannot say (then this pod must not write; an s3.retrying sorts it)."""
        with self._lock:
            if self._put(if_match=self.etag):
                return
            current = self._read()
            if current and current[0] == self.holder:  # a retried renewal whose first try landed
                self._hold(current[1], current[2])
                return
            raise LeaseLost(f"another pod ({current[0] if current else 'none'}) holds the lease on "
                            f"{self.run} now; this pod stops writing there")

    def ensure_fresh(self, retry=None) -> None:
        """Before a write: the lease was renewed within ttl/2, or is renewed now (through `retry`,
        an s3.retrying, when given)."""
        if time.monotonic() - self.renewed > self.ttl / 2:
            (retry or _once)(self.renew)

    def release(self, retry=None) -> None:
        """Let the next pod start at once instead of waiting for the expiry (through `retry`,
        an s3.retrying, when given)."""
        retry = retry or _once
        with self._lock:
            current = retry(self._read)
            if current is None or current[0] != self.holder:
                return
            retry(self._delete, current[1])
        if self.path:  # the pod's finish must not think it still holds it
            self.path.unlink(missing_ok=True)

    def _delete(self, etag: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.run.bucket, Key=self.run.key(KEY), IfMatch=etag)
        except botocore.exceptions.ClientError as err:
            if s3lib.http_status(err) not in (404, 409, 412):
                raise

    def save(self, path: Path) -> None:
        """Atomically: the keeper thread saves while the process may be exiting."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"holder": self.holder, "etag": self.etag}))
        os.replace(partial, path)

    @classmethod
    def load(cls, s3, run: Location, path: Path) -> "Lease":
        state = json.loads(path.read_text())
        return cls(s3, run, state["holder"], ttl_seconds(), etag=state["etag"], path=path)


class Keeper(threading.Thread):
    """Renews the lease every ttl/3 in the background; remembers if it was lost."""

    def __init__(self, lease: Lease):
        super().__init__(daemon=True, name="lease-keeper")
        self.lease = lease
        self.lost: LeaseLost | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        every = delay = self.lease.ttl / 3
        while not self._stop_event.wait(delay):
            try:
                self.lease.renew()
                delay = every
            except LeaseLost as err:
                self.lost = err
                log("lease", f"error: {err}")
                return
            except Exception as err:  # noqa: BLE001 - an outage: back off; writes check freshness
                delay = min(60.0, delay * 2) * random.uniform(0.5, 1.0)
                log("lease", f"renewal failed ({s3lib.explain(err, self.lease.run.bucket)}); "
                             f"again in {delay:.0f}s")

    def check(self, retry=None) -> None:
        """Raise LeaseLost unless this pod may write now (s3.Unavailable if S3 cannot say)."""
        if self.lost:
            raise self.lost
        self.lease.ensure_fresh(retry)

    def stop(self) -> None:
        self._stop_event.set()


def _server_time(answer: dict) -> datetime:
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if date:
        return email.utils.parsedate_to_datetime(date)
    return datetime.now(timezone.utc)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "acquire":
        print("usage: lease.py acquire S3_OUTPUT_URI STATE_FILE", file=sys.stderr)
        return s3lib.EXIT_BAD_INPUT

    def run() -> int:
        where = Location.parse(argv[1])
        holder = f"{os.environ.get('HOSTNAME', 'pod')}/{uuid.uuid4().hex[:8]}"
        lease = Lease(s3lib.client(), where, holder, ttl_seconds(), path=Path(argv[2]))
        started = time.monotonic()
        if not lease.acquire(float(os.environ.get("LEASE_WAIT_SECONDS", "3000"))):
            log("lease", f"{where} became COMPLETE while waiting: nothing to do")
            return EXIT_COMPLETE
        log("lease", f"holding the lease on {where} as {holder} "
                     f"(ttl {lease.ttl:.0f}s, waited {time.monotonic() - started:.1f}s)")
        return 0

    return s3lib.main_guard("lease", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
