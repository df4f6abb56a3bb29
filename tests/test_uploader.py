"""The pod's background uploader on its own: it outlives S3 outages, its retention in S3 never
takes the checkpoint this pod trains from, and it stops writing the moment its lease is taken."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpoint
import s3 as s3lib
from podlab import BUCKET, ROOT, wait_until
from s3_fault_proxy import FaultProxy

JOB = ROOT / "job"


def commit(out: Path, step: int, keep: int = 2) -> None:
    with checkpoint.stage(out / "checkpoints" / checkpoint.step_dir_name(step)) as staged:
        with staged.open("model.pt") as file:
            file.write(os.urandom(2048))
        staged.commit(meta={"step": step, "keep": keep})


def uploader_env(tmp_path: Path, endpoint: str) -> dict:
    """A pod's uploader's settings; the pod is ready (its READY_FILE exists): status.json says running."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "ready").touch()
    return {**os.environ, "AWS_ENDPOINT_URL": endpoint, "STATE_DIR": str(state), "CODE_DIR": str(ROOT / "code"),
            "READY_FILE": str(state / "ready"),
            "LEASE_TTL_SECONDS": "4", "SYNC_INTERVAL_SECONDS": "1", "UPLOAD_RETRY_SECONDS": "3",
            "PYTHONUNBUFFERED": "1"}


def take_lease(env: dict, uri: str) -> None:
    result = subprocess.run([sys.executable, str(JOB / "lease.py"), "acquire", uri, f"{env['STATE_DIR']}/lease.json"],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def committed_in_s3(s3, prefix: str) -> set[int]:
    return {checkpoint.parse_step(k.split("/")[-2]) for k in keys_in_s3(s3, prefix)
            if k.endswith("/manifest.json") and "step-" in k}


def keys_in_s3(s3, prefix: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


def test_watcher_outlives_an_outage_longer_than_its_lease_and_catches_up(s3, s3_endpoint, tmp_path):
    out, uri = tmp_path / "out", f"s3://{BUCKET}/runs/outage/"
    commit(out, 5)
    log = tmp_path / "pod.log"
    log.write_text("a line\n")
    with FaultProxy(upstream=s3_endpoint, seed=3) as proxy:
        env = {**uploader_env(tmp_path, proxy.url), "LOG_FILE": str(log)}
        take_lease(env, uri)
        watcher = subprocess.Popen([sys.executable, str(JOB / "uploader.py"), "watch", uri, str(out)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert wait_until(lambda: committed_in_s3(s3, "runs/outage/") == {5}, 30)
            proxy.configure(outage=True)
            for second in range(15):  # longer than the lease's ttl: renewals fail, so does every write
                with log.open("a") as file:
                    file.write(f"the trainer logs on, {second}\n")
                time.sleep(1)
            assert watcher.poll() is None, "the uploader died in the outage"
            proxy.configure(outage=False)
            commit(out, 10)
            assert wait_until(lambda: 10 in committed_in_s3(s3, "runs/outage/"), 60), "no catching up"
        finally:
            watcher.send_signal(signal.SIGTERM)
            output = watcher.communicate(timeout=60)[0]
    assert watcher.returncode == 0, output
    assert "Traceback" not in output, output
    assert "training goes on" in output, "rounds failed, the loop backed off and went on"


def test_retention_keeps_the_checkpoint_this_pod_restored_when_a_newer_one_is_damaged(s3, s3_endpoint, tmp_path):
    out, uri = tmp_path / "out", f"s3://{BUCKET}/runs/lineage/"
    commit(out, 5, keep=1)  # what this pod restored and trains from
    manifest = (out / "checkpoints" / "step-00000005" / "manifest.json").read_bytes()
    for key, body in {"model.pt": (out / "checkpoints" / "step-00000005" / "model.pt").read_bytes(),
                      "manifest.json": manifest}.items():
        s3.put_object(Bucket=BUCKET, Key=f"runs/lineage/checkpoints/step-00000005/{key}", Body=body)
    damaged = json.loads(manifest)
    damaged["files"]["model.pt"]["sha256"] = "0" * 64  # a newer step whose files do not match
    s3.put_object(Bucket=BUCKET, Key="runs/lineage/checkpoints/step-00000010/manifest.json",
                  Body=json.dumps(damaged).encode())
    s3.put_object(Bucket=BUCKET, Key="runs/lineage/checkpoints/step-00000001/model.pt", Body=b"leftover")
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    watcher = subprocess.Popen([sys.executable, str(JOB / "uploader.py"), "watch", uri, str(out)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # an uncommitted leftover is retention's to delete: once it is gone, retention has run
        assert wait_until(lambda: not keys_in_s3(s3, "runs/lineage/checkpoints/step-00000001/"), 30)
    finally:
        watcher.send_signal(signal.SIGTERM)
        output = watcher.communicate(timeout=60)[0]
    assert watcher.returncode == 0, output
    assert committed_in_s3(s3, "runs/lineage/") == {5, 10}, output


def test_watcher_whose_lease_is_taken_stops_writing_and_stops_the_pod(s3, s3_endpoint, tmp_path):
    out, uri = tmp_path / "out", f"s3://{BUCKET}/runs/taken/"
    commit(out, 5)
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    # The watcher's parent stands in for the bootstrap, which the watcher asks to stop.
    parent = subprocess.Popen(
        ["bash", "-c", 'trap "echo bootstrap got SIGTERM" TERM; "$@" & child=$!; wait $child; wait $child; '
                       'echo "watcher exited $?"', "bash", sys.executable, str(JOB / "uploader.py"), "watch", uri,
         str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: committed_in_s3(s3, "runs/taken/") == {5}, 30)
        usurper = {"holder": "other-pod/1234", "ttl_seconds": 4, "renewed_at": time.time()}
        s3.put_object(Bucket=BUCKET, Key="runs/taken/lease.json", Body=json.dumps(usurper).encode())
        output = parent.communicate(timeout=60)[0]
    finally:
        parent.kill()
    assert "bootstrap got SIGTERM" in output and "watcher exited 75" in output, output
    assert "another pod (other-pod/1234) holds the lease" in output, output
    lease = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/taken/lease.json")["Body"].read())
    assert lease["holder"] == "other-pod/1234", "the usurper's lease was overwritten"


def test_best_of_a_step_already_in_s3_is_copied_inside_s3_and_its_manifest_goes_last(s3, s3_endpoint, tmp_path,
                                                                                      monkeypatch):
    from uploader import Uploader  # in this process: its requests are counted here

    out, uri = tmp_path / "out", f"s3://{BUCKET}/runs/best/"
    commit(out, 5)
    shutil.copytree(out / "checkpoints" / "step-00000005", out / "checkpoints" / "best")  # the trainer's link
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    monkeypatch.setenv("STATE_DIR", env["STATE_DIR"])
    uploader = Uploader(s3lib.Location.parse(uri), out, retry_seconds=10)
    uploader.writer.hold_lease()
    writes = []

    def count(params, model, **_):
        if model.name in ("PutObject", "CopyObject"):
            writes.append((model.name, params.get("Key")))

    uploader.writer.s3.meta.events.register("before-parameter-build.s3", count)
    try:
        uploader.checkpoints.sync()
    finally:
        uploader.writer.keeper.stop()
    ckpts = "runs/best/checkpoints/"
    assert writes == [("PutObject", ckpts + "step-00000005/model.pt"),
                      ("PutObject", ckpts + "step-00000005/manifest.json"),
                      ("CopyObject", ckpts + "best/model.pt"),  # no byte of it goes up again
                      ("PutObject", ckpts + "best/manifest.json")]
    model = (out / "checkpoints" / "best" / "model.pt").read_bytes()
    assert s3.get_object(Bucket=BUCKET, Key=ckpts + "best/model.pt")["Body"].read() == model


def test_status_json_says_starting_until_the_pod_is_ready_then_running(s3, s3_endpoint, tmp_path):
    # the uploader starts before the restore: until READY_FILE (the startup probe's) exists, it restores
    out, uri, ready = tmp_path / "out", f"s3://{BUCKET}/runs/starting/", tmp_path / "ready"
    env = {**uploader_env(tmp_path, s3_endpoint), "READY_FILE": str(ready)}
    take_lease(env, uri)
    reports = set()

    def status() -> dict:
        return json.loads(s3.get_object(Bucket=BUCKET, Key="runs/starting/status.json")["Body"].read())

    def three_reports_while_starting() -> bool:
        now = status()
        assert now["state"] == "starting", now
        reports.add(now["updated_at"])
        return len(reports) >= 3

    watcher = subprocess.Popen([sys.executable, str(JOB / "uploader.py"), "watch", uri, str(out)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: "runs/starting/status.json" in keys_in_s3(s3, "runs/starting/"), 30)
        assert wait_until(three_reports_while_starting, 30), reports
        ready.touch()
        assert wait_until(lambda: status()["state"] == "running", 30)
    finally:
        watcher.kill()
        output = watcher.communicate(timeout=60)[0]
    assert "Traceback" not in output, output


def test_status_json_names_each_uploaded_step_at_once_so_a_lost_pod_shows_how_far_it_got(s3, s3_endpoint, tmp_path):
    # status.json is otherwise written every SYNC_INTERVAL_SECONDS: a pod lost in between would show
    # the step of its last report, behind the checkpoint it had put in S3
    out, uri = tmp_path / "out", f"s3://{BUCKET}/runs/reported/"
    env = {**uploader_env(tmp_path, s3_endpoint), "SYNC_INTERVAL_SECONDS": "3600"}
    take_lease(env, uri)

    def end_step():
        status = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/reported/status.json")["Body"].read())
        return status["attempts"][-1]["end_step"], status["committed_step"]

    watcher = subprocess.Popen([sys.executable, str(JOB / "uploader.py"), "watch", uri, str(out)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: "runs/reported/status.json" in keys_in_s3(s3, "runs/reported/"), 30)
        for step in (5, 10):
            commit(out, step)
            (out / "progress.json").write_text(json.dumps({"step": step, "max_steps": 100}))
            assert wait_until(lambda: end_step() == (step, step), 30), end_step()
    finally:
        watcher.kill()
        output = watcher.communicate(timeout=60)[0]
    assert "Traceback" not in output, output


def test_a_step_damaged_here_after_its_commit_is_never_committed_in_s3_nor_traded_for_s3s_copy(
        s3, s3_endpoint, tmp_path, monkeypatch, capfd):
    # Real s3transfer over HTTP, in parts as for a large checkpoint (5 MB parts here, 256 MB in the
    # pod): what it reads to send is what gets hashed, the last part included.
    from boto3.s3.transfer import TransferConfig
    from uploader import Uploader

    monkeypatch.setattr(s3lib, "TRANSFER", TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20,
                                                          preferred_transfer_client="classic"))
    out, uri, ckpts = tmp_path / "out", f"s3://{BUCKET}/runs/damaged/", "runs/damaged/checkpoints/"
    for step in (5, 10):
        save_step(out, step)
    flip_a_byte(out / "checkpoints" / "step-00000010" / "model.pt", (10 << 20) + 512)  # in the third part
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    monkeypatch.setenv("STATE_DIR", env["STATE_DIR"])
    uploader = Uploader(s3lib.Location.parse(uri), out, retry_seconds=10)
    uploader.writer.hold_lease()
    try:
        uploader.checkpoints.sync()
        uploader.checkpoints.sync()  # said once, not sent again
        assert committed_in_s3(s3, "runs/damaged/") == {5}
        sent = s3.get_object(Bucket=BUCKET, Key=ckpts + "step-00000005/model.pt")["Body"].read()
        assert sent == (out / "checkpoints" / "step-00000005" / "model.pt").read_bytes()

        # Step 5 redone here (a restart that trained it again) and damaged: S3's step 5 stays.
        save_step(out, 5, replace=True)
        flip_a_byte(out / "checkpoints" / "step-00000005" / "model.pt", 7)
        uploader.checkpoints.sync()
        assert committed_in_s3(s3, "runs/damaged/") == {5}
        assert s3.get_object(Bucket=BUCKET, Key=ckpts + "step-00000005/model.pt")["Body"].read() == sent
        assert uploader.checkpoints.newest_refused() == "step-00000010"

        save_step(out, 10, replace=True)  # step 10 saved again, whole this time
        uploader.checkpoints.sync()
        assert committed_in_s3(s3, "runs/damaged/") == {5, 10}
        assert uploader.checkpoints.newest_refused() is None
    finally:
        uploader.writer.keeper.stop()
    said = capfd.readouterr().out
    assert said.count("step-00000010 here does not match its manifest (model.pt does not match its sha256") == 1, said
    assert "step-00000005 here does not match its manifest" in said, said

    # The pod's final upload after SIGTERM: its exit must not say the newest step is committed.
    save_step(out, 15)
    flip_a_byte(out / "checkpoints" / "step-00000015" / "state.pt", 3)  # the single PutObject's file
    final = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", uri, str(out), "143"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert final.returncode == 75, final.stdout + final.stderr
    assert "error: step-00000015, the newest step here, is not in S3" in final.stdout, final.stdout
    assert committed_in_s3(s3, "runs/damaged/") == {5, 10}


def save_step(out: Path, step: int, replace: bool = False) -> None:
    """11 MB in 5 MB parts (model.pt) and 2 KB in one PutObject (state.pt, whose body s3transfer
    closes after)."""
    with checkpoint.stage(out / "checkpoints" / checkpoint.step_dir_name(step)) as staged:
        with staged.open("model.pt") as file:
            file.write(os.urandom(11 << 20))
        with staged.open("state.pt") as file:
            file.write(os.urandom(2048))
        staged.commit(meta={"step": step, "keep": 2}, replace=replace)


def flip_a_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))
