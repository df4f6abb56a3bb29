"""The uploader never stops quietly: a damaged status.json in S3 costs one warning, not the run's
checkpoints; an uploader that dies in a pod is restarted once, and a second death stops the pod
the way a retry can mend (the trainer commits its step, exit 75); a trainer of one's own that
writes no progress.json still ends with COMPLETE."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import checkpoint
from podlab import BUCKET, Run, wait_until
from test_pod import _descends_from
from test_uploader import JOB, commit, committed_in_s3, keys_in_s3, take_lease, uploader_env

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")

DAMAGED = {"not JSON": b"{\"attempts\": [", "a list": b"[1, 2]", "attempts not a list": b'{"attempts": "x"}',
           "an attempt not an object": b'{"attempts": [1]}',
           "an attempt without a start": b'{"attempts": [{"attempt": 1, "pod": "p"}]}'}


def status_in_s3(s3, prefix: str):
    try:
        return json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}status.json")["Body"].read())
    except Exception:  # noqa: BLE001 - absent or still the damaged one
        return None


def status_warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if "warning:" in line and "status.json" in line]


@pytest.mark.parametrize("body", DAMAGED.values(), ids=DAMAGED.keys())
def test_watcher_uploads_checkpoints_past_a_damaged_status_json_and_replaces_it(s3, s3_endpoint, tmp_path, body):
    out, uri, prefix = tmp_path / "out", f"s3://{BUCKET}/runs/damaged/", "runs/damaged/"
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}status.json", Body=body)
    commit(out, 5)
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    watcher = subprocess.Popen([sys.executable, str(JOB / "uploader.py"), "watch", uri, str(out)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: committed_in_s3(s3, prefix) == {5}, 30), "the checkpoint never went up"
        commit(out, 10)
        assert wait_until(lambda: 10 in committed_in_s3(s3, prefix), 30), "nor the next one"
        replaced = wait_until(lambda: (status_in_s3(s3, prefix) or {}).get("state") == "running", 30)
    finally:
        watcher.send_signal(signal.SIGTERM)
        output = watcher.communicate(timeout=60)[0]
    assert replaced, output
    status = status_in_s3(s3, prefix)
    assert [a["attempt"] for a in status["attempts"]] == [1], "the damaged history counts as empty"
    assert status["committed_step"] == 10
    assert watcher.returncode == 0, output
    assert "Traceback" not in output, output
    assert len(status_warnings(output)) == 1, output


@pytest.mark.parametrize("body", [DAMAGED["not JSON"], DAMAGED["attempts not a list"]], ids=["not JSON", "attempts"])
def test_final_upload_past_a_damaged_status_json_writes_complete_and_releases_the_lease(s3, s3_endpoint, tmp_path,
                                                                                         body):
    out, uri, prefix = tmp_path / "out", f"s3://{BUCKET}/runs/final/", "runs/final/"
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}status.json", Body=body)
    commit(out, 5)
    (out / "progress.json").write_text(json.dumps({"step": 5, "start_step": 0, "max_steps": 5, "val_loss": 1.5}))
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    result = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", uri, str(out), "0"], env=env,
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output, output
    assert committed_in_s3(s3, prefix) == {5}
    complete = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}COMPLETE")["Body"].read())
    assert complete["steps"] == 5 and complete["attempts"] == 1 and complete["val_loss"] == 1.5
    assert status_in_s3(s3, prefix)["state"] == "completed"
    assert f"{prefix}lease.json" not in keys_in_s3(s3, prefix), "the lease is released"
    assert len(status_warnings(output)) == 1, output


def test_final_upload_without_progress_json_completes_on_the_newest_committed_step(s3, s3_endpoint, tmp_path):
    out, uri, prefix = tmp_path / "out", f"s3://{BUCKET}/runs/own/", "runs/own/"
    commit(out, 3, keep=3)
    commit(out, 6, keep=3)
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    result = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", uri, str(out), "0"], env=env,
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output, output
    assert committed_in_s3(s3, prefix) == {3, 6}
    complete = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}COMPLETE")["Body"].read())
    assert complete["steps"] == 6 and complete["val_loss"] is None
    status = status_in_s3(s3, prefix)
    assert status["state"] == "completed" and status["committed_step"] == 6 and status["progress"] == {}
    assert f"{prefix}lease.json" not in keys_in_s3(s3, prefix)


def test_final_upload_after_a_nonzero_exit_writes_no_complete_without_progress_json(s3, s3_endpoint, tmp_path):
    out, uri, prefix = tmp_path / "out", f"s3://{BUCKET}/runs/own-failed/", "runs/own-failed/"
    commit(out, 3)
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, uri)
    result = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", uri, str(out), "1"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert committed_in_s3(s3, prefix) == {3}
    assert f"{prefix}COMPLETE" not in keys_in_s3(s3, prefix)
    assert status_in_s3(s3, prefix)["state"] == "failed"


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan"])
def test_watcher_with_a_bad_retry_setting_says_so_in_one_line(s3, s3_endpoint, tmp_path, value):
    env = {**uploader_env(tmp_path, s3_endpoint), "UPLOAD_RETRY_SECONDS": value}
    result = subprocess.run([sys.executable, str(JOB / "uploader.py"), "watch", f"s3://{BUCKET}/runs/x/",
                             str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 64, output
    assert output.strip().count("\n") == 0 and "Traceback" not in output, output
    assert f"UPLOAD_RETRY_SECONDS={value} must be a positive number of seconds" in output


# -- through the real job.yaml ------------------------------------------------------------------------


def watcher_pids(pod, uri: str) -> list[int]:
    """The pod's background uploader (`uploader.py watch URI`), as host PIDs."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        is_watcher = any(p.endswith(b"uploader.py") for p in cmdline) and b"watch" in cmdline and uri.encode() in cmdline
        if is_watcher and state != "Z" and _descends_from(int(entry.name), pod.pid1()):
            found.append(int(entry.name))
    return found


def kill_watcher(pod, uri: str, not_this: int | None = None) -> int:
    pids = wait_until(lambda: [p for p in watcher_pids(pod, uri) if p != not_this], 60)
    assert len(pids) == 1, (pids, pod.output[-3000:])
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


@contextlib.contextmanager
def pod_of(run, **env):
    """A started pod that a failing test does not leave running (it would write to the next test's S3)."""
    pod = run.start(**env)
    try:
        yield pod
    finally:
        if pod.proc.poll() is None:
            pod.lose_node()
            pod.wait()


def index_of(lines: list[str], text: str, start: int = 0) -> int:
    return next(i for i in range(start, len(lines)) if text in lines[i])


@pytest.mark.slow
@needs_root
def test_pod_with_a_damaged_status_json_uploads_completes_and_releases_the_lease(run):
    run.s3.put_object(Bucket=BUCKET, Key=f"{run.prefix}status.json", Body=DAMAGED["attempts not a list"])
    code, pod = run.run()
    assert code == 0, pod.output
    assert "Traceback" not in pod.output, pod.output
    assert run.committed_steps() == [60, 55]
    assert run.verify_in_s3("step-00000060") is None
    assert run.json("COMPLETE")["steps"] == 60
    status = run.json("status.json")
    assert status["state"] == "completed" and [a["attempt"] for a in status["attempts"]] == [1]
    assert "lease.json" not in run.keys(), "the lease is released"
    assert len(status_warnings(pod.output)) == 1, pod.output


@pytest.mark.slow
@needs_root
def test_pod_restarts_an_uploader_that_died_and_the_next_checkpoint_still_reaches_s3(run):
    with pod_of(run, TRAIN_ARGS="--set train.max_steps=150") as pod:
        pod.wait_for("is in S3")  # the watcher is at work
        kill_watcher(pod, run.output_uri)
        pod.wait_for("restarting it", timeout=60)
        assert pod.wait() == 0, pod.output
    lines = pod.lines
    restarted = index_of(lines, "restarting it")
    uploaded_after = index_of(lines, "is in S3", restarted)
    assert uploaded_after < index_of(lines, "final upload (trainer exit 0)"), "the restarted watcher uploads"
    assert sum("restarting it" in line for line in lines) == 1
    assert "Traceback" not in pod.output, pod.output
    assert run.json("COMPLETE")["steps"] == 150
    status = run.json("status.json")
    assert [a["attempt"] for a in status["attempts"]] == [1], "the restarted uploader carries on this pod's attempt"
    assert status["attempts"][0]["exit_code"] == 0 and not status["attempts"][0].get("lost")
    assert "lease.json" not in run.keys()


@pytest.mark.slow
@needs_root
def test_pod_whose_uploader_dies_again_saves_the_current_step_and_exits_75(run):
    with pod_of(run, TRAIN_ARGS="--set train.max_steps=5000 --set log.interval=1") as pod:
        pod.wait_for("is in S3")
        first = kill_watcher(pod, run.output_uri)
        pod.wait_for("restarting it", timeout=60)
        kill_watcher(pod, run.output_uri, not_this=first)
        assert pod.wait() == 75, pod.output
    why = [line for line in pod.lines if "the uploader died again" in line]
    assert len(why) == 1, pod.output
    saved = pod.wait_for("finished; committing a checkpoint of it before exit")
    step = int(saved.split("step ")[1].split()[0])
    assert run.committed_steps()[0] == step, "the trainer committed its step and the final upload put it in S3"
    assert run.verify_in_s3(checkpoint.step_dir_name(step)) is None
    assert "COMPLETE" not in run.keys()
    status = run.json("status.json")
    assert status["state"] == "failed" and status["attempts"][-1]["exit_code"] == 75
    assert "lease.json" not in run.keys()


OWN_TRAINER = '''\
"""A trainer of one's own: commits two steps with checkpoint.py, writes no progress.json."""
import argparse
import os
from pathlib import Path

import checkpoint

parser = argparse.ArgumentParser()
for name in ("--config", "--data_dir", "--output_dir"):
    parser.add_argument(name)
args, _ = parser.parse_known_args()
out = Path(args.output_dir) / "checkpoints"
start = checkpoint.parse_step(checkpoint.newest_valid(out).name) if checkpoint.newest_valid(out) else 0
for step in (start + 1, start + 2):
    with checkpoint.stage(out / checkpoint.step_dir_name(step)) as staged:
        with staged.open("model.pt") as file:
            file.write(b"weights of step %d" % step)
        staged.commit(meta={"step": step, "keep": 3})
    Path(os.environ["HEALTH_FILE"]).touch()
print("own trainer: committed step", start + 2)
'''


@pytest.mark.slow
@needs_root
def test_pod_with_its_own_trainer_that_writes_no_progress_json_ends_with_complete(run, tmp_path):
    trainer = tmp_path / "own_train.py"
    trainer.write_text(OWN_TRAINER)
    run.s3.upload_file(str(trainer), BUCKET, "code/train.py")
    code, pod = run.run()
    assert code == 0, pod.output
    assert "own trainer: committed step 2" in pod.output
    assert "Traceback" not in pod.output, pod.output
    assert run.committed_steps() == [2, 1]
    assert run.json("COMPLETE")["steps"] == 2
    status = run.json("status.json")
    assert status["state"] == "completed" and status["committed_step"] == 2
    assert "lease.json" not in run.keys()


POLITE_TRAINER = '''\
"""A trainer of one's own that, like many, catches SIGTERM, commits and exits 0; no progress.json."""
import argparse
import os
import signal
import time
from pathlib import Path

import checkpoint

parser = argparse.ArgumentParser()
for name in ("--config", "--data_dir", "--output_dir"):
    parser.add_argument(name)
args, _ = parser.parse_known_args()
out = Path(args.output_dir) / "checkpoints"
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
step = 0
while not stop:
    step += 1
    time.sleep(0.2)
    Path(os.environ["HEALTH_FILE"]).touch()
    if step == 3:
        print("polite trainer: training", flush=True)
with checkpoint.stage(out / checkpoint.step_dir_name(step)) as staged:
    with staged.open("model.pt") as file:
        file.write(b"weights of step %d" % step)
    staged.commit(meta={"step": step, "keep": 3})
print("polite trainer: committed step", step, "and exits 0", flush=True)
'''


@pytest.mark.slow
@needs_root
def test_pod_deleted_while_its_own_trainer_exits_0_on_sigterm_is_not_complete(run, tmp_path):
    # Without progress.json the runtime cannot tell "done" from "stopped and saved": an exit 0
    # after SIGTERM must not end the run. torchrun, which gets the SIGTERM first, exits non-zero
    # whatever its worker does, so the pod exits 143 and writes no COMPLETE (a guard: it held before).
    trainer = tmp_path / "polite_train.py"
    trainer.write_text(POLITE_TRAINER)
    run.s3.upload_file(str(trainer), BUCKET, "code/train.py")
    pod = run.start()
    pod.wait_for("polite trainer: training", timeout=180)
    pod.delete()
    assert pod.wait() == 143, pod.output
    assert "and exits 0" in pod.output
    assert run.committed_steps(), "its step went up"
    assert "COMPLETE" not in run.keys(), pod.output
