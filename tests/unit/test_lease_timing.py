"""The lease keeper's timing: renewals every ttl/3 while they land; after a failure a quick retry
(a hiccup must not leave the lease stale, which stops the uploader's writes, nor let it expire in
S3), then backing off to once a minute through an outage."""

from __future__ import annotations

import threading

import pytest

import lease as leaselib
from s3 import Location


@pytest.mark.parametrize("failures, expected", [
    (0, 10.0), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 16.0), (6, 32.0), (7, 60.0), (30, 60.0),
])
def test_renewal_delay_retries_a_failure_soon_then_backs_off_to_a_minute(failures, expected):
    assert leaselib.renewal_delay(10.0, failures) == expected


def test_a_two_minute_outage_costs_the_keeper_few_renewals():
    spent, tries = 0.0, 0
    while spent < 120:
        tries += 1
        spent += leaselib.renewal_delay(10.0, tries) * 0.5  # the shortest jitter
    assert tries <= 10


def test_the_default_ttl_renewed_every_third_stays_fresh_after_one_failed_renewal():
    ttl = leaselib.ttl_seconds({})
    every = ttl / 3
    # The last renewal landed at 0; the next, at `every`, fails; the retry comes before ttl/2.
    assert every + leaselib.renewal_delay(every, 1) < ttl / 2


class FlakyLease:
    """A lease whose renewals fail `fail` times, then land: records when each was tried."""

    held = True
    run = Location.parse("s3://bucket/runs/r/")

    def __init__(self, ttl: float, fail: int):
        self.ttl, self.fail, self.tries = ttl, fail, []
        self.done = threading.Event()

    def renew(self) -> None:
        self.tries.append(len(self.tries))
        if len(self.tries) <= self.fail:
            raise ConnectionError("S3 hiccup")
        self.done.set()


def test_keeper_retries_a_failed_renewal_and_carries_on(monkeypatch):
    waits = []
    lease = FlakyLease(ttl=3.0, fail=2)
    keeper = leaselib.Keeper(lease)
    real_wait = keeper._stop_event.wait

    def wait(seconds):  # record the keeper's schedule, without sleeping through it
        waits.append(seconds)
        return lease.done.is_set() or real_wait(0)

    monkeypatch.setattr(keeper._stop_event, "wait", wait)
    keeper.run()
    assert len(lease.tries) == 3 and keeper.lost is None
    assert waits[0] == 1.0, "the first renewal after ttl/3"
    assert 0.5 <= waits[1] <= 1.0 and 1.0 <= waits[2] <= 2.0, waits
