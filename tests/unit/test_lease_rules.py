"""The lease's pure rules: its settings, S3_LEASE, the verdict on a store's conditional writes,
freshness, and what a pod without a lease (S3_LEASE=off) does. No S3 server: nothing here may
reach one (a bad setting is refused before any client is made)."""

from __future__ import annotations

import json

import pytest

import lease as leaselib
import s3 as s3lib
from s3 import Location

RUN = Location.parse("s3://bucket/runs/r/")


@pytest.mark.parametrize("value,expected", [
    (None, 30.0), ("", 30.0), ("120", 120.0), ("3", 3.0), ("4", 4.0), ("90.5", 90.5), (" 60 ", 60.0),
])
def test_ttl_accepts_seconds_from_the_floor_up(value, expected):
    environ = {} if value is None else {"LEASE_TTL_SECONDS": value}
    assert leaselib.ttl_seconds(environ) == expected


@pytest.mark.parametrize("value", ["soon", "2m", "0", "-5", "2.9", "1", "nan", "inf", "1e400"])
def test_ttl_refuses_what_is_no_number_or_would_make_renewal_spin(value):
    with pytest.raises(s3lib.BadInput) as refused:
        leaselib.ttl_seconds({"LEASE_TTL_SECONDS": value})
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"LEASE_TTL_SECONDS={value} ") and "at least 3" in line and "job.yaml" in line


@pytest.mark.parametrize("value,expected", [(None, 3000.0), ("", 3000.0), ("3000", 3000.0), ("0", 0.0), ("60", 60.0)])
def test_wait_accepts_seconds_from_zero_up(value, expected):
    environ = {} if value is None else {"LEASE_WAIT_SECONDS": value}
    assert leaselib.wait_seconds(environ) == expected


@pytest.mark.parametrize("value", ["forever", "-1", "-0.5", "nan", "inf"])
def test_wait_refuses_what_is_no_number_or_negative(value):
    with pytest.raises(s3lib.BadInput, match=f"^LEASE_WAIT_SECONDS={value} must be a number of seconds, at least 0"):
        leaselib.wait_seconds({"LEASE_WAIT_SECONDS": value})


@pytest.mark.parametrize("value,on", [(None, True), ("on", True), ("off", False), ("", True)])
def test_s3_lease_is_on_unless_off(value, on):
    environ = {} if value is None else {"S3_LEASE": value}
    assert leaselib.lease_wanted(environ) is on


@pytest.mark.parametrize("value", ["OFF", "no", "false", "0", "of"])
def test_s3_lease_refuses_anything_but_on_or_off(value):
    with pytest.raises(s3lib.BadInput, match=f"^S3_LEASE={value} must be on or off"):
        leaselib.lease_wanted({"S3_LEASE": value})


@pytest.mark.parametrize("if_none_match_landed,if_match_landed,ignored", [
    (False, False, None),
    (True, False, "If-None-Match"),
    (False, True, "If-Match"),
    (True, True, "If-None-Match and If-Match"),
])
def test_store_verdict_names_each_condition_the_store_ignored(if_none_match_landed, if_match_landed, ignored):
    verdict = leaselib.store_verdict(RUN, if_none_match_landed, if_match_landed)
    if ignored is None:
        assert verdict is None
        return
    assert "\n" not in verdict
    assert f"ignores {ignored} on PUT" in verdict
    assert "S3_LEASE=off" in verdict and "one pod per S3_OUTPUT_URI" in verdict
    assert str(RUN) in verdict


@pytest.mark.parametrize("since_renewal,ttl,stale", [
    (0.0, 120, False), (59.9, 120, False), (60.1, 120, True), (1.4, 3, False), (1.6, 3, True),
])
def test_a_lease_is_stale_once_half_its_ttl_has_passed(since_renewal, ttl, stale):
    lease = leaselib.Lease(None, RUN, "me", ttl)
    lease.renewed = 1000.0
    assert lease.stale(now=1000.0 + since_renewal) is stale


@pytest.mark.parametrize("age,ttl,expired", [(29.9, 30, False), (30.0, 30, False), (30.1, 30, True)])
def test_a_lease_record_is_expired_only_past_its_ttl(age, ttl, expired):
    record = leaselib.LeaseRecord("other-pod", '"etag"', age, ttl)
    assert record.expired is expired
    with pytest.raises(AttributeError):
        record.holder = "me"  # a record read from S3 is not edited in place


def test_a_refused_lease_write_passes_through_retries_as_itself():
    # Not sorted into BadInput (a permanent S3 error) nor retried: the caller decides what a lost
    # race means.
    def refused():
        raise leaselib.LeaseHeld("another writer holds the lease")

    with pytest.raises(leaselib.LeaseHeld):
        s3lib.retrying("lease", "bucket", seconds=5)(refused)


def test_without_a_lease_every_check_passes_and_nothing_is_renewed(tmp_path):
    state = tmp_path / "lease.json"
    leaselib.NoLease.record(state)
    assert json.loads(state.read_text())["held"] is False
    unleased = leaselib.Lease.load(None, RUN, state)  # no client: it must never call S3
    assert isinstance(unleased, leaselib.NoLease)
    keeper = leaselib.Keeper(unleased)
    keeper.start()
    keeper.join(timeout=5)
    assert not keeper.is_alive(), "nothing to renew: the keeper ends at once"
    keeper.check()
    keeper.check(retry=lambda fn, *a: pytest.fail("no S3 call without a lease"))
    unleased.release()
    assert not state.exists(), "the pod's finish must not think a lease is still held"


def test_a_held_lease_loads_as_a_lease(tmp_path, monkeypatch):
    monkeypatch.setenv("LEASE_TTL_SECONDS", "30")
    state = tmp_path / "lease.json"
    leaselib.Lease(None, RUN, "me", 30, etag='"abc"').save(state)
    loaded = leaselib.Lease.load(None, RUN, state)
    assert (type(loaded), loaded.holder, loaded.etag, loaded.ttl) == (leaselib.Lease, "me", '"abc"', 30.0)


@pytest.mark.parametrize("env,message", [
    ({"LEASE_TTL_SECONDS": "0.1"}, "LEASE_TTL_SECONDS=0.1 must be a number of seconds, at least 3"),
    ({"LEASE_TTL_SECONDS": "two minutes"}, "LEASE_TTL_SECONDS=two minutes must be a number of seconds"),
    ({"LEASE_WAIT_SECONDS": "-1"}, "LEASE_WAIT_SECONDS=-1 must be a number of seconds, at least 0"),
    ({"S3_LEASE": "maybe"}, "S3_LEASE=maybe must be on or off"),
])
def test_lease_py_on_a_bad_setting_exits_64_with_one_line_before_any_s3_call(env, message, monkeypatch, capsys,
                                                                             tmp_path):
    for name in ("LEASE_TTL_SECONDS", "LEASE_WAIT_SECONDS", "S3_LEASE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: a call would hang, then 75
    code = leaselib.main(["acquire", str(RUN), str(tmp_path / "lease.json")])
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert code == 64
    assert len(lines) == 1 and "lease: error: " + message in lines[0], lines
    assert not (tmp_path / "lease.json").exists()


def test_lease_py_with_s3_lease_off_holds_nothing_and_calls_no_s3(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("S3_LEASE", "off")
    monkeypatch.setenv("LEASE_TTL_SECONDS", "not used when off")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    code = leaselib.main(["acquire", str(RUN), str(tmp_path / "lease.json")])
    output = capsys.readouterr().out.splitlines()
    lines = [line for line in output if not line.startswith("EVENT ")]
    assert code == 0
    assert [line for line in output if line.startswith("EVENT ")] and '"state": "off"' in output[0], output
    assert len(lines) == 1 and "lease: warning: S3_LEASE=off" in lines[0], lines
    assert "one pod per S3_OUTPUT_URI" in lines[0] and "podReplacementPolicy: Failed" in lines[0]
    assert json.loads((tmp_path / "lease.json").read_text())["held"] is False

