"""The lease against a store that differs from AWS S3, and writes that outlast its freshness window.

A store that ignores If-None-Match / If-Match (the fault proxy's ignore_conditional_writes mode
strips them from writes before moto sees them) would let two pods both win the lease: lease.py
proves at every acquire that the store refuses a write it must refuse, and stops with exit 64
unless S3_LEASE=off. A checkpoint upload slower than ttl/2 is checked as its bytes go, so a
takeover meanwhile stops it before any of it becomes an object.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import boto3
import botocore.exceptions
import pytest
from boto3.s3.transfer import TransferConfig

import checkpoint
import lease as leaselib
import s3 as s3lib
from podlab import BUCKET, ROOT, wait_until
from s3_fault_proxy import FaultProxy
from uploader import Uploader

JOB = ROOT / "job"
PART = 5 << 20  # S3's smallest multipart part


def keys_in_s3(s3, prefix: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


def acquire(tmp_path, endpoint: str, uri: str, **env: str) -> subprocess.CompletedProcess:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, str(JOB / "lease.py"), "acquire", uri, str(state / "lease.json")],
                          env={**os.environ, "AWS_ENDPOINT_URL": endpoint, "LEASE_TTL_SECONDS": "30",
                               "LEASE_WAIT_SECONDS": "10", **env},
                          capture_output=True, text=True, timeout=120)


# -- the proxy's mode ----------------------------------------------------------------------------


def test_proxy_ignoring_conditional_writes_lets_a_put_that_must_fail_land(s3, s3_endpoint):
    s3.put_object(Bucket=BUCKET, Key="k", Body=b"first")
    with FaultProxy(upstream=s3_endpoint, ignore_conditional_writes=True) as proxy:
        through = boto3.client("s3", endpoint_url=proxy.url)
        through.put_object(Bucket=BUCKET, Key="k", Body=b"second", IfNoneMatch="*")
        through.put_object(Bucket=BUCKET, Key="k", Body=b"third", IfMatch='"0123456789abcdef0123456789abcdef"')
        # A GET's conditions are not writes: they still work.
        etag = through.head_object(Bucket=BUCKET, Key="k")["ETag"]
        with pytest.raises(botocore.exceptions.ClientError, match="304|Not Modified"):
            through.get_object(Bucket=BUCKET, Key="k", IfNoneMatch=etag)
        assert proxy.stats()["conditions_ignored"] == 2
        proxy.configure(ignore_conditional_writes=False)
        with pytest.raises(botocore.exceptions.ClientError, match="PreconditionFailed"):
            through.put_object(Bucket=BUCKET, Key="k", Body=b"fourth", IfNoneMatch="*")
    assert s3.get_object(Bucket=BUCKET, Key="k")["Body"].read() == b"third"


# -- acquire proves the store ---------------------------------------------------------------------


def test_acquire_on_a_store_ignoring_conditional_writes_exits_64_with_one_line(s3, s3_endpoint, tmp_path):
    uri = f"s3://{BUCKET}/runs/lax/"
    with FaultProxy(upstream=s3_endpoint, ignore_conditional_writes=True) as proxy:
        result = acquire(tmp_path, proxy.url, uri)
        requests = proxy.stats()["total"]
    output = result.stdout + result.stderr
    assert result.returncode == 64, output
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if re.search(r"\berror: ", line)]
    assert len(errors) == 1, output
    assert "ignores If-None-Match and If-Match on PUT" in errors[0]
    assert "S3_LEASE=off" in errors[0] and "one pod per S3_OUTPUT_URI" in errors[0]
    assert keys_in_s3(s3, "runs/lax/") == [], "the lease it took was let go again"
    assert not (tmp_path / "state" / "lease.json").exists(), "the pod's finish must not think it holds a lease"
    assert requests <= 8, f"{requests} requests to find out"


def test_acquire_on_a_store_with_conditional_writes_costs_two_refused_puts(s3, s3_endpoint, tmp_path):
    uri = f"s3://{BUCKET}/runs/strict/"
    with FaultProxy(upstream=s3_endpoint) as proxy:
        result = acquire(tmp_path, proxy.url, uri)
        requests = [(method, path) for _, method, path, _ in proxy.stats()["recent"]]
    assert result.returncode == 0, result.stdout + result.stderr
    state = json.loads((tmp_path / "state" / "lease.json").read_text())
    lease = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/strict/lease.json")["Body"].read())
    assert lease["holder"] == state["holder"] and state["held"] is True
    assert s3.head_object(Bucket=BUCKET, Key="runs/strict/lease.json")["ETag"] == state["etag"], \
        "the refused probes changed nothing"
    puts = [path for method, path in requests if method == "PUT"]
    assert puts == ["/test-bucket/runs/strict/lease.json"] * 3, requests  # take it, then two refused
    assert len(requests) == 5, requests  # and one GET before, one HEAD for COMPLETE
    assert keys_in_s3(s3, "runs/strict/") == ["runs/strict/lease.json"], "no probe object left behind"


def test_acquire_with_s3_lease_off_on_a_lax_store_holds_nothing_and_asks_s3_nothing(s3, s3_endpoint, tmp_path):
    with FaultProxy(upstream=s3_endpoint, ignore_conditional_writes=True) as proxy:
        result = acquire(tmp_path, proxy.url, f"s3://{BUCKET}/runs/off/", S3_LEASE="off")
        requests = proxy.stats()["total"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning: S3_LEASE=off" in result.stdout
    assert json.loads((tmp_path / "state" / "lease.json").read_text())["held"] is False
    assert requests == 0 and keys_in_s3(s3, "runs/off/") == []


def test_uploader_without_a_lease_uploads_and_applies_retention(s3, s3_endpoint, tmp_path, monkeypatch):
    uri = f"s3://{BUCKET}/runs/unleased/"
    assert acquire(tmp_path, s3_endpoint, uri, S3_LEASE="off").returncode == 0
    monkeypatch.setenv("STATE_DIR", str(tmp_path / "state"))
    uploader = Uploader(s3lib.Location.parse(uri), tmp_path / "out", retry_seconds=10)
    uploader.writer.hold_lease()
    for step in (5, 10, 15):
        commit(tmp_path / "out", step, size=1000, keep=2)
    uploader.checkpoints.sync()
    assert "runs/unleased/lease.json" not in keys_in_s3(s3, "runs/unleased/"), "a lease was taken"
    uploader.writer.keeper.stop()
    uploader.writer.keeper.lease.release(uploader.writer.retry)
    committed = {k.split("/")[-2] for k in keys_in_s3(s3, "runs/unleased/") if k.endswith("manifest.json")}
    assert committed == {"step-00000010", "step-00000015"}
    assert not (tmp_path / "state" / "lease.json").exists()


# -- a write longer than the freshness window --------------------------------------------------


def commit(out, step: int, size: int, keep: int = 3):
    with checkpoint.stage(out / "checkpoints" / checkpoint.step_dir_name(step)) as staged:
        with staged.open("model.pt") as file:
            file.write(os.urandom(size))
        staged.commit(meta={"step": step, "keep": keep})
    return out / "checkpoints" / checkpoint.step_dir_name(step)


@pytest.fixture
def slow_parts(s3, s3_endpoint, tmp_path, monkeypatch):
    """An uploader whose lease lives 3 s, uploading 5 MB parts one at a time through a proxy that
    answers each part 1.5 s late: an 8-part file takes about 12 s, four times ttl/2."""
    monkeypatch.setattr(s3lib, "TRANSFER", TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                                          max_concurrency=1, use_threads=True))
    with FaultProxy(upstream=s3_endpoint, slow_rate=1.0, slow_seconds=1.5, slow_match="partNumber=") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("LEASE_TTL_SECONDS", "3")
        monkeypatch.setenv("STATE_DIR", str(tmp_path / "state"))
        (tmp_path / "state").mkdir()
        where = s3lib.Location.parse(f"s3://{BUCKET}/runs/slow/")
        assert leaselib.Lease(s3lib.client(), where, "this-pod", 3, path=tmp_path / "state" / "lease.json").acquire(10)
        uploader = Uploader(where, tmp_path / "out", retry_seconds=10)
        uploader.writer.hold_lease()
        yield uploader, proxy
        uploader.writer.keeper.stop()


def parts_sent(proxy) -> int:
    return len([p for _, method, p, _ in proxy.stats()["recent"] if method == "PUT" and "partNumber=" in p])


def upload_in_background(uploader, folder):
    outcome = {}

    def upload():
        try:
            outcome["uploaded"] = uploader.checkpoints.upload(folder)
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            outcome["error"] = err

    thread = threading.Thread(target=upload)
    thread.start()
    return thread, outcome


def test_a_write_longer_than_ttl_half_stops_at_a_takeover_and_nothing_of_it_lands(slow_parts, s3, tmp_path):
    uploader, proxy = slow_parts
    folder = commit(tmp_path / "out", 5, size=8 * PART)
    thread, outcome = upload_in_background(uploader, folder)
    assert wait_until(lambda: parts_sent(proxy) >= 1, 60), "the upload never started"
    usurper = {"holder": "other-pod/1234", "ttl_seconds": 3, "renewed_at": time.time()}
    s3.put_object(Bucket=BUCKET, Key="runs/slow/lease.json", Body=json.dumps(usurper).encode())
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), leaselib.LeaseLost), outcome
    assert parts_sent(proxy) < 8, "the transfer went on after the takeover"
    assert keys_in_s3(s3, "runs/slow/") == ["runs/slow/lease.json"], "part of the checkpoint landed"
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads"), "its parts were left in S3"
    lease = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/slow/lease.json")["Body"].read())
    assert lease["holder"] == "other-pod/1234"


def test_a_write_longer_than_ttl_half_completes_while_the_lease_is_renewed(slow_parts, s3, tmp_path):
    uploader, proxy = slow_parts
    folder = commit(tmp_path / "out", 5, size=3 * PART + 1234)
    thread, outcome = upload_in_background(uploader, folder)
    thread.join(timeout=120)
    assert outcome == {"uploaded": True}, outcome
    assert parts_sent(proxy) == 4
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/slow/checkpoints/step-00000005/manifest.json")
                          ["Body"].read())
    body = s3.get_object(Bucket=BUCKET, Key="runs/slow/checkpoints/step-00000005/model.pt")["Body"].read()
    assert len(body) == manifest["files"]["model.pt"]["size"] == 3 * PART + 1234
    assert uploader.writer.keeper.lost is None


# -- through the real job.yaml --------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")


@pytest.mark.slow
@needs_root
def test_pod_on_a_store_ignoring_conditional_writes_stops_with_64_and_one_line(run, s3_endpoint):
    with FaultProxy(upstream=s3_endpoint, ignore_conditional_writes=True) as proxy:
        run.endpoint = proxy.url
        pod = run.start()
        code = pod.wait(timeout=300)
    assert code == 64, pod.output[-3000:]
    errors = [line for line in pod.lines if re.search(r"\berror: ", line)]
    assert len(errors) == 1, errors
    assert "ignores If-None-Match and If-Match on PUT" in errors[0] and "S3_LEASE=off" in errors[0]
    assert not [e for e in pod.events if e["source"] == "train"], "it trained without a lease"
    assert run.keys() == {}, "the lease was let go and nothing was uploaded"


@pytest.mark.slow
@needs_root
def test_pod_with_s3_lease_off_on_that_store_trains_and_completes(run, s3_endpoint):
    with FaultProxy(upstream=s3_endpoint, ignore_conditional_writes=True) as proxy:
        run.endpoint = proxy.url
        pod = run.start(S3_LEASE="off")
        code = pod.wait(timeout=300)
    assert code == 0, pod.output[-3000:]
    warnings = [line for line in pod.lines if "S3_LEASE=off" in line]
    assert len(warnings) == 1 and "warning:" in warnings[0], warnings
    assert not [line for line in pod.lines if re.search(r"\berror: ", line)]
    assert "COMPLETE" in run.keys() and "lease.json" not in run.keys()
    assert run.committed_steps()
    for step in run.committed_steps():
        assert run.verify_in_s3(f"step-{step:08d}") is None


def test_acquire_on_a_store_refusing_conditional_writes_exits_64_with_one_line(s3, s3_endpoint, tmp_path):
    with FaultProxy(upstream=s3_endpoint, refuse_conditional_writes=True) as proxy:
        result = acquire(tmp_path, proxy.url, f"s3://{BUCKET}/runs/refusing/")
        refused = proxy.stats()["conditions_refused"]
    output = result.stdout + result.stderr
    assert result.returncode == 64, output
    errors = [line for line in output.splitlines() if re.search(r"\berror: ", line)]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert "the S3 store refuses conditional writes (NotImplemented, 501)" in errors[0]
    assert "S3_LEASE=off" in errors[0] and "one pod per S3_OUTPUT_URI" in errors[0]
    assert refused == 1, "no retry of what no retry fixes"
    assert keys_in_s3(s3, "runs/refusing/") == []


def test_a_single_put_streaming_longer_than_ttl_half_stops_mid_body_at_a_takeover(s3, s3_endpoint, tmp_path,
                                                                                   monkeypatch):
    """One request, no parts: only the check as the bytes go can stop it once it is sent."""
    with FaultProxy(upstream=s3_endpoint, body_seconds_per_mb=0.5) as proxy:  # 24 MB: 12 s
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("LEASE_TTL_SECONDS", "3")
        monkeypatch.setenv("STATE_DIR", str(tmp_path / "state"))
        (tmp_path / "state").mkdir()
        where = s3lib.Location.parse(f"s3://{BUCKET}/runs/stream/")
        assert leaselib.Lease(s3lib.client(), where, "this-pod", 3, path=tmp_path / "state" / "lease.json").acquire(10)
        uploader = Uploader(where, tmp_path / "out", retry_seconds=10)
        uploader.writer.hold_lease()
        try:
            folder = commit(tmp_path / "out", 5, size=24 << 20)
            thread, outcome = upload_in_background(uploader, folder)
            assert wait_until(lambda: any(m == "PUT" and "model.pt" in p for _, m, p, _ in proxy.stats()["recent"]),
                              60), "the upload never started"
            usurper = {"holder": "other-pod/1234", "ttl_seconds": 3, "renewed_at": time.time()}
            s3.put_object(Bucket=BUCKET, Key="runs/stream/lease.json", Body=json.dumps(usurper).encode())
            thread.join(timeout=120)
        finally:
            uploader.writer.keeper.stop()
    assert isinstance(outcome.get("error"), leaselib.LeaseLost), outcome
    assert keys_in_s3(s3, "runs/stream/") == ["runs/stream/lease.json"], "the body was sent whole and landed"


def test_every_write_request_of_the_uploader_waits_on_the_lease_reads_do_not(s3, s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("LEASE_TTL_SECONDS", "3")
    monkeypatch.setenv("STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    where = s3lib.Location.parse(f"s3://{BUCKET}/runs/gated/")
    assert leaselib.Lease(s3lib.client(), where, "this-pod", 3, path=tmp_path / "state" / "lease.json").acquire(10)
    s3.put_object(Bucket=BUCKET, Key="runs/gated/old", Body=b"kept")
    uploader = Uploader(where, tmp_path / "out", retry_seconds=10)
    uploader.writer.hold_lease()
    try:
        s3.put_object(Bucket=BUCKET, Key="runs/gated/lease.json", Body=b'{"holder": "other-pod"}')
        assert wait_until(lambda: uploader.writer.keeper.lost, 30), "the keeper never saw the takeover"
        # Straight calls on the client, no write() around them: the client itself refuses.
        for call, args in [(uploader.writer.s3.put_object, {"Key": "runs/gated/new", "Body": b"x"}),
                           (uploader.writer.s3.delete_object, {"Key": "runs/gated/old"}),
                           (uploader.writer.s3.copy_object, {"Key": "runs/gated/copy",
                                                      "CopySource": {"Bucket": BUCKET, "Key": "runs/gated/old"}}),
                           (uploader.writer.s3.delete_objects, {"Delete": {"Objects": [{"Key": "runs/gated/old"}]}})]:
            with pytest.raises(leaselib.LeaseLost):
                call(Bucket=BUCKET, **args)
        assert uploader.writer.s3.get_object(Bucket=BUCKET, Key="runs/gated/old")["Body"].read() == b"kept"
        assert sorted(keys_in_s3(uploader.writer.s3, "runs/gated/")) == ["runs/gated/lease.json", "runs/gated/old"]
    finally:
        uploader.writer.keeper.stop()


# -- what another pod left in lease.json -------------------------------------------------------

def test_a_lease_is_not_taken_over_before_its_holders_own_ttl(s3, s3_endpoint, tmp_path):
    # A holder with a longer TTL (say 120, renewing every 40 s) must not lose its lease to a pod
    # whose own TTL is shorter: it may still write until its own TTL/2.
    s3.put_object(Bucket=BUCKET, Key="runs/mixed/lease.json",
                  Body=json.dumps({"holder": "old-pod/1", "ttl_seconds": 120}).encode())
    time.sleep(4)  # older than the taker's TTL of 3, far younger than the holder's 120
    result = acquire(tmp_path, s3_endpoint, f"s3://{BUCKET}/runs/mixed/", LEASE_TTL_SECONDS="3",
                     LEASE_WAIT_SECONDS="0")
    assert result.returncode == 75, result.stdout + result.stderr
    assert "another pod (old-pod/1) holds the lease" in result.stdout
    body = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/mixed/lease.json")["Body"].read())
    assert body["holder"] == "old-pod/1"


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"{" * 50_000 + b"}" * 50_000, b'{"holder": 7}'])
def test_a_damaged_lease_expires_and_is_taken_over_like_any_other(s3, s3_endpoint, tmp_path, body):
    s3.put_object(Bucket=BUCKET, Key="runs/damaged/lease.json", Body=body)
    time.sleep(4)
    result = acquire(tmp_path, s3_endpoint, f"s3://{BUCKET}/runs/damaged/", LEASE_TTL_SECONDS="3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "took over the lease of ?" in result.stdout and "Traceback" not in result.stderr


def test_two_date_headers_from_a_proxy_still_judge_the_lease_on_s3s_clock(s3, s3_endpoint, tmp_path):
    # Seen before: the two Date values, joined by the HTTP client, parsed to a naive time; subtracting
    # the aware LastModified raised TypeError and acquire exited 64, which fails the Job for good.
    s3.put_object(Bucket=BUCKET, Key="runs/dates/expired/lease.json",
                  Body=json.dumps({"holder": "dead-pod/1", "ttl_seconds": 3}).encode())
    s3.put_object(Bucket=BUCKET, Key="runs/dates/live/lease.json",
                  Body=json.dumps({"holder": "live-pod/1", "ttl_seconds": 120}).encode())
    time.sleep(4)
    with FaultProxy(upstream=s3_endpoint, duplicate_date=True) as proxy:
        expired = acquire(tmp_path, proxy.url, f"s3://{BUCKET}/runs/dates/expired/", LEASE_TTL_SECONDS="3")
        live = acquire(tmp_path, proxy.url, f"s3://{BUCKET}/runs/dates/live/", LEASE_TTL_SECONDS="3",
                       LEASE_WAIT_SECONDS="0")
        assert proxy.stats()["dates_duplicated"] > 0
    assert expired.returncode == 0 and "took over the lease of dead-pod/1" in expired.stdout, expired.stdout + expired.stderr
    assert live.returncode == 75 and "another pod (live-pod/1) holds the lease" in live.stdout, live.stdout + live.stderr
    assert "Traceback" not in expired.stderr + live.stderr


@pytest.mark.parametrize("date,expected", [
    ("Tue, 25 Nov 2025 10:00:00 GMT", "2025-11-25 10:00:00+00:00"),
    ("Tue, 25 Nov 2025 10:00:00 GMT, Tue, 25 Nov 2025 10:00:01 GMT", "2025-11-25 10:00:00+00:00"),  # the first
    ("Tue, 25 Nov 2025 10:00:00 -0000", None),  # naive for parsedate_to_datetime: not S3's format
    ("Tue, 25 Nov 2025 10:00:00", None),
    ("Tue, 99 Foo 2025 10:00:00 GMT", None),
    ("garbage", None), ("", None), (None, None),
])
def test_the_servers_clock_is_one_aware_time_or_none(date, expected):
    found = leaselib.server_time(date)
    assert (str(found) if found else None) == expected
    assert found is None or found.tzinfo is not None


def put_complete(s3, uri: str, body: bytes) -> None:
    where = s3lib.Location.parse(uri)
    s3.put_object(Bucket=BUCKET, Key=where.key("COMPLETE"), Body=body)
    s3.delete_object(Bucket=BUCKET, Key=where.key("lease.json"))  # the last acquire's


def signed_complete(monkeypatch, uri: str) -> bytes:
    with monkeypatch.context() as env:
        env.setenv("CHECKPOINT_HMAC_KEY", "k" * 32)
        env.setenv("S3_OUTPUT_URI", uri)
        return json.dumps(checkpoint.signed_complete({"steps": 10})).encode()


@pytest.mark.parametrize("lease", ["on", "off"])
def test_with_a_key_only_a_complete_signed_for_this_run_ends_it(s3, s3_endpoint, tmp_path, monkeypatch, lease):
    # Seen before (read in the code): any object at COMPLETE ended every later pod with exit 0.
    uri = f"s3://{BUCKET}/runs/complete-{lease}/"
    env = {"CHECKPOINT_HMAC_KEY": "k" * 32, "S3_OUTPUT_URI": uri, "S3_LEASE": lease}
    for body, code in [(b'{"steps": 10}', 0), (signed_complete(monkeypatch, f"s3://{BUCKET}/runs/other/"), 0),
                       (signed_complete(monkeypatch, uri), 3)]:
        put_complete(s3, uri, body)
        result = acquire(tmp_path, s3_endpoint, uri, **env)
        assert result.returncode == code, (body, result.stdout + result.stderr)
        if code == 0:
            assert f"warning: {uri}COMPLETE does not end this run" in result.stdout
            assert "its final upload writes a signed COMPLETE" in result.stdout
    if lease == "on":  # with S3_LEASE=off and no key, script.sh's own check is the one (and asks S3 nothing)
        put_complete(s3, uri, b"not json, no key")
        assert acquire(tmp_path, s3_endpoint, uri, S3_LEASE=lease).returncode == 3, "without a key: as before"


def test_a_lease_holder_with_line_breaks_forges_no_line_on_the_pods_log(s3, s3_endpoint, tmp_path):
    # Seen before: a holder "x\nEVENT {exit, code 0}\ny" printed its own EVENT line, and contract.wait
    # took the pod for one that had exited 0.
    forged = 'EVENT {"event": "exit", "source": "script", "code": 0, "seconds": 1.0, "time": 1.0}'
    s3.put_object(Bucket=BUCKET, Key="runs/forger/lease.json",
                  Body=json.dumps({"holder": f"x\n{forged}\r\x1b[2Ky", "ttl_seconds": 120}).encode())
    result = acquire(tmp_path, s3_endpoint, f"s3://{BUCKET}/runs/forger/", LEASE_WAIT_SECONDS="0")
    assert result.returncode == 75, result.stdout + result.stderr
    log = tmp_path / "pod.log"
    log.write_text(result.stdout + result.stderr)
    assert not [line for line in log.read_text().splitlines() if line.startswith("EVENT")]
    assert "\x1b" not in log.read_text() and "\r" not in log.read_text()
    assert 'another pod (x\\nEVENT {"event": "exit"' in result.stdout, result.stdout
    waited = subprocess.run([sys.executable, str(JOB / "contract.py"), "wait", str(log), "0", "exit", "code=0"],
                            capture_output=True, text=True)
    assert waited.returncode == 1, waited.stdout
