"""What the uploader's growing files cost over a run: each interval puts only the new bytes of the
TensorBoard event files and the pod's log (new objects, each written once), an idle interval asks
S3 nothing for them, and what S3 holds still reads back whole: TensorBoard's own reader takes a
run's segments in name order as one run, and an attempt's log segments concatenate to its log.

The real watcher, against the local S3 through lab/s3_fault_proxy.py (which counts the
requests and the bytes of their bodies); the trainer's writes made with the trainer's SummaryWriter.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench_growth import POINTS_PER_INTERVAL, PREFIX, URI, Meter, Trainer, growing  # the benchmark's method, one copy
from podlab import BUCKET, wait_until
from s3_fault_proxy import FaultProxy
from test_uploader import JOB, keys_in_s3, take_lease, uploader_env

INTERVALS = 15
IDLE_INTERVALS = 5
def s3_objects(s3, folder: str) -> list[str]:
    return sorted(k for k in keys_in_s3(s3, PREFIX + folder))


def concatenated(s3, keys: list[str]) -> bytes:
    return b"".join(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys)


def start_watcher(env: dict, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB / "uploader.py"), "watch", URI, str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_watcher(watcher: subprocess.Popen) -> str:
    watcher.send_signal(signal.SIGTERM)
    output = watcher.communicate(timeout=60)[0]
    assert watcher.returncode == 0, output
    return output


def wait_for_round(meter: Meter, before: int) -> None:
    """Until the watcher has put the log again: a round of growing files ran after the writes."""
    assert wait_until(lambda: meter.snapshot()[0].get("logs", 0) > before, 60), "no upload round"


def test_each_interval_uploads_only_new_bytes_and_an_idle_one_asks_s3_nothing_for_them(s3, s3_endpoint, tmp_path):
    out, log = tmp_path / "out", tmp_path / "pod.log"
    log.write_text("")
    with FaultProxy(upstream=s3_endpoint, seed=1) as proxy:
        meter = Meter(proxy)
        # A long TTL: no renewal inside the window, so the counts are the uploader's own.
        env = {**uploader_env(tmp_path, proxy.url), "LOG_FILE": str(log), "LEASE_TTL_SECONDS": "3600"}
        take_lease(env, URI)
        trainer = Trainer(out, log)
        watcher = start_watcher(env, out)
        try:
            per_interval = []
            for _ in range(INTERVALS):
                before_requests, before_bytes = meter.snapshot()
                trainer.interval()
                wait_for_round(meter, before_requests.get("logs", 0))
                after_requests, after_bytes = meter.snapshot()
                per_interval.append(growing(after_bytes) - growing(before_bytes))
            # Idle: nothing written. status.json goes up once an interval: count intervals by it.
            idle_start_requests, _ = meter.snapshot()
            assert wait_until(lambda: meter.snapshot()[0].get("status.json", 0)
                              >= idle_start_requests.get("status.json", 0) + IDLE_INTERVALS, 60)
            idle_end_requests, _ = meter.snapshot()
        finally:
            output = stop_watcher(watcher)
    event_bytes = trainer.event_file().read_bytes()
    local_bytes = len(event_bytes) + log.stat().st_size
    idle_intervals = idle_end_requests["status.json"] - idle_start_requests["status.json"]
    idle_growing = growing(idle_end_requests) - growing(idle_start_requests)
    idle_all = sum(idle_end_requests.values()) - sum(idle_start_requests.values())
    print(f"\ngrowing files over {INTERVALS} intervals of {POINTS_PER_INTERVAL} points and log lines: "
          f"{sum(per_interval)} bytes uploaded for {local_bytes} bytes written "
          f"({sum(per_interval) / local_bytes:.2f}x); upload_bytes_per_interval first {per_interval[0]}, "
          f"last {per_interval[-1]}; idle_requests_per_interval {idle_all / idle_intervals:.2f} "
          f"(growing files {idle_growing / idle_intervals:.2f}; status.json 1) over {idle_intervals} intervals")
    assert "Traceback" not in output, output
    # O(new bytes): the last interval costs what the first did, not INTERVALS times as much; the run's
    # total is the bytes written plus each request's framing.
    assert per_interval[-1] < 3 * per_interval[0], per_interval
    assert sum(per_interval) < 1.2 * local_bytes, (sum(per_interval), local_bytes)
    assert idle_growing == 0, "an idle interval asks S3 nothing about growing files"
    written_twice = [k for k, n in meter.puts.items() if n > 1 and "/status.json" not in k and "lease" not in k]
    assert not written_twice, written_twice
    events = s3_objects(s3, "tensorboard/")
    assert len(events) > 1, "segments, not one object"
    assert concatenated(s3, events) == event_bytes, "the segments in name order are the event file"
    assert concatenated(s3, s3_objects(s3, "logs/")) == log.read_bytes()


def test_tensorboard_reads_a_runs_segments_from_s3_as_one_run(s3, s3_endpoint, tmp_path, monkeypatch):
    """Two pods' event files, each in several segments (the later ones without the file_version
    header): TensorBoard's own loader, reading S3, sees every step once, the second pod's
    purge_step replacing what the first logged past its checkpoint."""
    from torch.utils.tensorboard import SummaryWriter

    events = tmp_path / "out" / "tensorboard"
    env = {**uploader_env(tmp_path, s3_endpoint)}
    take_lease(env, URI)
    for pod, (purge, steps, offset) in enumerate(((None, range(1, 31), 0.0), (21, range(21, 41), 100.0))):
        writer = SummaryWriter(str(events), purge_step=purge, filename_suffix=f".pod{pod}")
        for chunk in range(0, len(steps), 10):
            for step in list(steps)[chunk:chunk + 10]:
                writer.add_scalar("train/loss", offset + step, step)
            writer.flush()
            final = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", URI, str(tmp_path / "out"),
                                    "1"], env=env, capture_output=True, text=True, timeout=120)
            assert final.returncode == 0, final.stdout + final.stderr
            take_lease(env, URI)
        writer.close()
        time.sleep(1.1)  # event file names carry the second they were opened: the order of pods
    keys = s3_objects(s3, "tensorboard/")
    assert len(keys) == 5, keys  # 3 + 2 rounds that found new records
    monkeypatch.setenv("S3_ENDPOINT", s3_endpoint)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(f"{URI}tensorboard", size_guidance={"scalars": 0})
    accumulator.Reload()
    served = {e.step: e.value for e in accumulator.Scalars("train/loss")}
    assert sorted(served) == list(range(1, 41))
    assert [served[s] for s in (1, 20, 21, 40)] == [1, 20, 121, 140]


def test_a_restarted_watcher_and_final_carry_on_the_segments_and_a_replaced_log_starts_anew(s3, s3_endpoint,
                                                                                           tmp_path):
    out, log = tmp_path / "out", tmp_path / "pod.log"
    log.write_text("")
    env = {**uploader_env(tmp_path, s3_endpoint), "LOG_FILE": str(log)}
    take_lease(env, URI)
    trainer = Trainer(out, log)
    trainer.interval()
    watcher = start_watcher(env, out)
    try:
        assert wait_until(lambda: concatenated(s3, s3_objects(s3, "logs/")) == log.read_bytes(), 30)
    finally:
        watcher.kill()  # the pod restarts a dead watcher: it must not start over
        watcher.wait()
    trainer.interval()
    watcher = start_watcher(env, out)
    try:
        assert wait_until(lambda: concatenated(s3, s3_objects(s3, "logs/")) == log.read_bytes(), 30)
    finally:
        stop_watcher(watcher)
    uploaded = log.read_bytes()
    trainer.interval()
    log.write_text("a new log: the file was replaced\n")  # shorter than what went up
    final = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", URI, str(out), "1"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stdout + final.stderr
    assert concatenated(s3, s3_objects(s3, "tensorboard/")) == trainer.event_file().read_bytes()
    logs = concatenated(s3, s3_objects(s3, "logs/"))
    assert logs == uploaded + b"a new log: the file was replaced\n", "nothing repeated; the new log after the old"
    assert len(s3_objects(s3, "logs/")) >= 3


def test_files_beside_the_event_files_go_up_whole_and_only_when_they_change(s3, s3_endpoint, tmp_path):
    # A projector config or a profile is no stream of records: cut as one it would never go up.
    out, log = tmp_path / "out", tmp_path / "pod.log"
    log.write_text("")
    env = {**uploader_env(tmp_path, s3_endpoint), "LOG_FILE": str(log)}
    take_lease(env, URI)
    trainer = Trainer(out, log)
    trainer.interval()
    config = trainer.event_file().parent / "projector_config.pbtxt"
    config.write_text("embeddings { tensor_name: 'wte' }\n")
    final = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", URI, str(out), "1"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stdout + final.stderr
    whole = [k for k in s3_objects(s3, "tensorboard/") if "projector_config" in k]
    assert [k.rsplit("/", 1)[-1] for k in whole] == ["projector_config.pbtxt"], whole
    assert s3.get_object(Bucket=BUCKET, Key=whole[0])["Body"].read() == config.read_bytes()
