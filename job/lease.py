"""One writer per S3_OUTPUT_URI: a lease object in S3 with a heartbeat and an expiry.

    python lease.py acquire S3_OUTPUT_URI STATE_FILE   # waits while another live pod holds it
    exit 0: held (token in STATE_FILE; or S3_LEASE=off), 3: the run is already COMPLETE (S3_LEASE=off:
    checked only with CHECKPOINT_HMAC_KEY set, script.sh checks it otherwise), 64/75: errors

A Kubernetes Job may run the same pod twice, and two pods writing one prefix would overwrite each
other's checkpoints. So every writer first takes `lease.json` with a conditional PUT (If-None-Match
to create, If-Match to renew or take over an expired one): S3 lets one of two racing writers win.
Expiry is judged on S3's clock, so pods' clock skew does not matter. The holder renews every ttl/3
from a thread (Keeper) and writes only while its last renewal is at most ttl/2 old; every acquire
proves the store refuses what it must (exit 64 otherwise). COMPLETE ends the run only when this run
may trust it (signed, with CHECKPOINT_HMAC_KEY). docs/reliability.md has the rules and why.

Environment: LEASE_TTL_SECONDS (30, at least 3), LEASE_WAIT_SECONDS (3000), S3_LEASE (on|off).
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import random
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import botocore.exceptions

import checkpoint
import contract
import s3 as s3lib
from s3 import Location, log

KEY = contract.LEASE_KEY
EXIT_COMPLETE = contract.EXIT_COMPLETE_FOUND
# Renewal runs every ttl/3: under 3 s it would ask S3 more than once a second, and one slow answer
# would cost the lease.
MIN_TTL_SECONDS = 3.0
# No ETag S3 makes looks like this (theirs are quoted hex digests): If-Match with it must fail.
NO_SUCH_ETAG = '"lease-probe-matches-nothing"'


def _once(fn, *args):
    """No retries: the caller's caller sorts what fails."""
    return fn(*args)


class LeaseLost(s3lib.Stop):
    """Another pod holds the lease now: this one must not write."""


class LeaseHeld(s3lib.Stop):
    """A conditional write of lease.json was refused (409, 412): another writer holds it, or got
    there first. Retries pass it on, as litestream's LeaseExistsError."""


@dataclass(frozen=True)
class LeaseRecord:
    """lease.json as S3 holds it now."""

    holder: str
    etag: str
    age: float  # seconds since its last renewal, on S3's clock
    ttl: float  # the TTL that applies: the holder's own when longer than this pod's

    @property
    def expired(self) -> bool:
        return self.age > self.ttl


def _seconds(environ, name: str, default: str, minimum: float, rule: str) -> float:
    """A setting in seconds, or BadInput with one line that names it and the fix."""
    raw = (os.environ if environ is None else environ).get(name, "") or default  # empty: as unset
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum:
        raise s3lib.BadInput(f"{name}={raw} must be {rule}; fix it in job.yaml (default {default})")
    return value


def ttl_seconds(environ=None) -> float:
    # 30 s: a lost node (no EXIT trap to release it) keeps the next pod waiting at most this long.
    # Shorter costs a healthy pod nothing in an outage: a renewal that fails loses the lease only
    # if another pod takes it over (the If-Match on this pod's ETag), and only writes, never
    # training, wait while it is stale.
    return _seconds(environ, "LEASE_TTL_SECONDS", "30", MIN_TTL_SECONDS,
                    f"a number of seconds, at least {MIN_TTL_SECONDS:.0f} (the lease is renewed every third of it)")


def wait_seconds(environ=None) -> float:
    # 0: no waiting; a pod that finds a live lease exits 75 at once.
    return _seconds(environ, "LEASE_WAIT_SECONDS", "3000", 0.0, "a number of seconds, at least 0")


def lease_wanted(environ=None) -> bool:
    """S3_LEASE: on (the default) or off; anything else is a typo that must not pass as either."""
    raw = (os.environ if environ is None else environ).get("S3_LEASE", "") or "on"
    if raw not in ("on", "off"):
        raise s3lib.BadInput(f"S3_LEASE={raw} must be on or off (off: no lease, one pod per "
                             "S3_OUTPUT_URI is up to you); fix it in job.yaml")
    return raw == "on"


def store_verdict(run: Location, if_none_match_landed: bool, if_match_landed: bool) -> str | None:
    """None when the store refused both probes; else one line: what it lacks and the ways out."""
    ignored = [name for name, landed in (("If-None-Match", if_none_match_landed), ("If-Match", if_match_landed))
               if landed]
    if not ignored:
        return None
    return (f"the S3 store ignores {' and '.join(ignored)} on PUT (a write it had to refuse with 412 "
            f"landed), so the lease cannot keep a second pod off {run}; use a store with conditional "
            "writes (AWS S3 has them), or set S3_LEASE=off and run one pod per S3_OUTPUT_URI yourself")


class Lease:
    held = True

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
        self._prove_conditional_writes(retry)
        return True

    def _prove_conditional_writes(self, retry) -> None:
        """Two writes of the lease just taken that S3 must refuse: it exists (If-None-Match: *) and
        has another ETag (If-Match). Refused, they change nothing; landed, they only rewrite this
        pod's own lease, which it then lets go."""
        verdict = store_verdict(self.run, self._lands(retry, if_none_match=True),
                                self._lands(retry, if_match=NO_SUCH_ETAG))
        if verdict:
            self.release(retry)
            raise s3lib.BadInput(verdict)

    def _lands(self, retry, **condition) -> bool:
        """A conditional write of the lease went through (False: refused)."""
        try:
            retry(self._put, **condition)
        except LeaseHeld:
            return False
        return True

    def _take(self, retry, wait_seconds: float) -> None:
        deadline = time.monotonic() + wait_seconds
        while True:
            current = retry(self._read)
            try:
                if self._took(retry, current):
                    return
            except LeaseHeld:
                continue  # another writer got there first: read again
            if current is not None and not current.expired:
                if retry(self._complete):
                    return
                if time.monotonic() > deadline:
                    raise s3lib.Unavailable(f"another pod ({current.holder}) holds the lease on {self.run} "
                                            f"(renewed {current.age:.0f}s ago); gave up after {wait_seconds:.0f}s")
                log("lease", f"{current.holder} holds the lease on {self.run} (renewed {current.age:.0f}s ago): "
                             "waiting")
                time.sleep(min(10.0, max(1.0, current.ttl - current.age + 0.5)))

    def _took(self, retry, current: LeaseRecord | None) -> bool:
        """Taken now when free, ours already, or expired; False while another pod's is live.
        LeaseHeld when another writer wins the race for it."""
        if current is None:
            retry(self._put, if_none_match=True)
            return True
        if current.holder == self.holder:  # our write landed though its answer was lost
            self._hold(current.etag, current.age)
            return True
        if current.expired:
            retry(self._put, if_match=current.etag)
            log("lease", f"took over the lease of {current.holder}, expired {current.age - current.ttl:.0f}s ago")
            return True
        return False

    def _read(self) -> LeaseRecord | None:
        """lease.json as S3 holds it now, or None when there is none."""
        try:
            answer = self.s3.get_object(Bucket=self.run.bucket, Key=self.run.key(KEY))
        except botocore.exceptions.ClientError as err:
            if s3lib.not_found(err):
                return None
            raise
        body = _lease_body(s3lib.read_body(answer, _MAX_LEASE_BYTES))
        server_now = _server_time(answer)
        age = (server_now - answer["LastModified"]).total_seconds()
        # The holder's own TTL when longer: a pod that renews every 40 s (TTL 120) must not be taken
        # over after this pod's 30 s.
        return LeaseRecord(body["holder"], answer["ETag"], age, max(self.ttl, body["ttl"]))

    def _complete(self) -> bool:
        return trusted_complete(self.s3, self.run)

    def _put(self, if_none_match: bool = False, if_match: str | None = None) -> None:
        """A conditional write of the lease; LeaseHeld when another writer got there first."""
        body = json.dumps({"holder": self.holder, "ttl_seconds": self.ttl, "pod": os.environ.get("HOSTNAME", ""),
                           "renewed_at": time.time()}).encode()
        condition = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match}
        sent = time.monotonic()  # it cannot have landed before: its age on S3's clock is at most ours
        try:
            answer = self.s3.put_object(Bucket=self.run.bucket, Key=self.run.key(KEY), Body=body,
                                        ContentType="application/json", **condition)
        except botocore.exceptions.ClientError as err:
            if s3lib.http_status(err) in (409, 412):
                raise LeaseHeld(f"another writer holds the lease on {self.run}") from None
            if s3lib.http_status(err) == 501:
                raise s3lib.BadInput(
                    f"the S3 store refuses conditional writes ({s3lib.error_code(err)}, 501), which the lease "
                    f"on {self.run} needs; use a store that has them (AWS S3 does), or set S3_LEASE=off and "
                    "run one pod per S3_OUTPUT_URI yourself") from None
            raise
        self._hold(answer["ETag"], time.monotonic() - sent)

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
            self._renew_locked()

    def _renew_if_stale(self) -> None:
        with self._lock:  # the transfer's threads all find it stale at once: one renewal will do
            if self.stale():
                self._renew_locked()

    def _renew_locked(self) -> None:
        try:
            self._put(if_match=self.etag)
            return
        except LeaseHeld:
            pass
        current = self._read()
        if current and current.holder == self.holder:  # a retried renewal whose first try landed
            self._hold(current.etag, current.age)
            return
        raise LeaseLost(f"another pod ({current.holder if current else 'none'}) holds the lease on "
                        f"{self.run} now; this pod stops writing there")

    def stale(self, now: float | None = None) -> bool:
        """More than ttl/2 since the last renewal was sent: another pod may take it over within
        ttl/2 from now."""
        return (time.monotonic() if now is None else now) - self.renewed > self.ttl / 2

    def ensure_fresh(self, retry=None) -> None:
        """Before a write: the lease was renewed within ttl/2, or is renewed now (through `retry`,
        an s3.retrying, when given)."""
        if self.stale():
            (retry or _once)(self._renew_if_stale)

    def release(self, retry=None) -> None:
        """Let the next pod start at once instead of waiting for the expiry (through `retry`,
        an s3.retrying, when given)."""
        retry = retry or _once
        with self._lock:
            current = retry(self._read)
            if current is None or current.holder != self.holder:
                return
            retry(self._delete, current.etag)
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
        partial.write_text(json.dumps({"held": True, "holder": self.holder, "etag": self.etag}))
        os.replace(partial, path)

    @classmethod
    def load(cls, s3, run: Location, path: Path) -> "Lease | NoLease":
        state = json.loads(path.read_text())
        if state.get("held") is False:
            return NoLease(path)
        return cls(s3, run, state["holder"], ttl_seconds(), etag=state["etag"], path=path)


class NoLease:
    """S3_LEASE=off: nothing to take, renew, prove or release; every write may go."""

    held = False

    def __init__(self, path: Path | None = None):
        self.path = path

    @staticmethod
    def record(path: Path) -> None:
        """The state file says so, for the pod's later helpers (and its finish still runs)."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"held": False}))
        os.replace(partial, path)

    def ensure_fresh(self, retry=None) -> None:
        pass

    def release(self, retry=None) -> None:
        if self.path:
            self.path.unlink(missing_ok=True)


def renewal_delay(every: float, failures: int) -> float:
    """Seconds to the next renewal (before jitter): every ttl/3 while renewals land; after one
    fails, 1 s, then doubling to once a minute. A hiccup is retried at once, so the lease stays
    fresh (writes wait while it is not) and unexpired in S3; a long outage costs a request a minute."""
    if failures == 0:
        return every
    return min(60.0, 2.0 ** (failures - 1))


class Keeper(threading.Thread):
    """Renews the lease every ttl/3 in the background; remembers if it was lost."""

    def __init__(self, lease: Lease):
        super().__init__(daemon=True, name="lease-keeper")
        self.lease = lease
        self.lost: LeaseLost | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        if not self.lease.held:
            return
        every, failures = self.lease.ttl / 3, 0
        delay = every
        while not self._stop_event.wait(delay):
            try:
                self.lease.renew()
                failures = 0
            except LeaseLost as err:
                self.lost = err
                log("lease", f"error: {err}")
                return
            except Exception as err:  # noqa: BLE001 - an outage: back off; writes check freshness
                failures += 1
                problem = s3lib.explain(err, self.lease.run.bucket)
            delay = renewal_delay(every, failures)
            if failures:
                delay *= random.uniform(0.5, 1.0)
                log("lease", f"renewal failed ({problem}); again in {delay:.0f}s")

    def check(self, retry=None) -> None:
        """Raise LeaseLost unless this pod may write now (s3.Unavailable if S3 cannot say)."""
        if self.lost:
            raise self.lost
        self.lease.ensure_fresh(retry)

    def stop(self) -> None:
        self._stop_event.set()


_MAX_LEASE_BYTES = 64 << 10  # a lease is ~150 bytes; anyone who may write the bucket may write it


def _lease_body(raw: bytes) -> dict:
    """holder and ttl from a lease object; one that is damaged names no holder ("?") and no TTL of
    its own: it expires like any other and is taken over with If-Match."""
    try:
        body = json.loads(raw) if len(raw) <= _MAX_LEASE_BYTES else None
    except (ValueError, RecursionError):
        body = None
    body = body if isinstance(body, dict) else {}
    holder = body.get("holder") if isinstance(body.get("holder"), str) else "?"
    ttl = body.get("ttl_seconds")
    ttl = float(ttl) if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 < ttl < 1e6 else 0.0
    return {"holder": holder[:200], "ttl": ttl}


_untrusted_said: set[str] = set()


def trusted_complete(s3, run: Location) -> bool:
    """True when COMPLETE is there and ends the run: any object without CHECKPOINT_HMAC_KEY (a HEAD,
    as before), with it one signed for this run (checkpoint.complete_problem); another is said once
    and counts as none."""
    key = run.key(contract.COMPLETE_KEY)
    try:
        if not os.environ.get(checkpoint.HMAC_KEY_ENV):
            s3.head_object(Bucket=run.bucket, Key=key)
            return True
        answer = s3.get_object(Bucket=run.bucket, Key=key)
    except botocore.exceptions.ClientError as err:
        if s3lib.not_found(err):
            return False
        raise
    problem = checkpoint.complete_problem(s3lib.read_body(answer, checkpoint.MAX_COMPLETE_BYTES))
    if problem and answer["ETag"] not in _untrusted_said:
        _untrusted_said.add(answer["ETag"])
        log("lease", f"warning: {run}COMPLETE does not end this run: {problem}; the run goes on from its newest "
                     "checkpoint and its final upload writes a signed COMPLETE")
    return problem is None


# An IMF-fixdate (RFC 9110), what S3 sends: the first one when two Date headers came joined by ", ".
_HTTP_DATE = re.compile(r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun), [0-9]{2} [A-Z][a-z]{2} [0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT")
_bad_date_said = False


def server_time(date) -> datetime | None:
    """S3's clock from a Date header's value: its first HTTP date, always aware (UTC); None when it
    holds none."""
    match = _HTTP_DATE.search(date) if isinstance(date, str) else None
    try:
        return email.utils.parsedate_to_datetime(match.group()).astimezone(timezone.utc) if match else None
    except (TypeError, ValueError, OverflowError):  # "Mon, 99 Foo ..." matches and is no date
        return None


def _server_time(answer: dict) -> datetime:
    global _bad_date_said
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    found = server_time(date)
    if found is not None:
        return found
    if date and not _bad_date_said:
        _bad_date_said = True
        log("lease", f"warning: S3's Date header {ascii(date)[:120]} holds no HTTP date; judging the lease's age "
                     "on this pod's clock")
    return datetime.now(timezone.utc)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "acquire":
        print("usage: lease.py acquire S3_OUTPUT_URI STATE_FILE", file=sys.stderr)
        return contract.EXIT_BAD_INPUT

    def run() -> int:
        where = Location.parse(argv[1])
        if not lease_wanted():
            if os.environ.get(checkpoint.HMAC_KEY_ENV) and s3lib.retrying("lease", where.bucket, name="lease")(
                    trusted_complete, s3lib.client(), where):
                return EXIT_COMPLETE  # with a key, script.sh leaves COMPLETE to this check
            NoLease.record(Path(argv[2]))
            contract.event("lease", "lease", state="off")
            log("lease", f"warning: S3_LEASE=off: no lease on {where}; a second pod there would overwrite "
                         "this one's checkpoints: run one pod per S3_OUTPUT_URI yourself "
                         "(the Job's podReplacementPolicy: Failed helps)")
            return 0
        ttl, wait = ttl_seconds(), wait_seconds()
        holder = f"{os.environ.get('HOSTNAME', 'pod')}/{uuid.uuid4().hex[:8]}"
        lease = Lease(s3lib.client(), where, holder, ttl, path=Path(argv[2]))
        started = time.monotonic()
        if not lease.acquire(wait):
            log("lease", f"{where} became COMPLETE while waiting: nothing to do")
            contract.event("lease", "lease", state="complete")
            return EXIT_COMPLETE
        log("lease", f"holding the lease on {where} as {holder} "
                     f"(ttl {lease.ttl:.0f}s, waited {time.monotonic() - started:.1f}s)")
        contract.event("lease", "lease", state="held", waited=round(time.monotonic() - started, 3))
        return 0

    return s3lib.main_guard("lease", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
