"""What the uploader's growing files cost per interval (tests/test_upload_growth.py's method): the real
watcher, against the local S3 through lab/s3_fault_proxy.py, which counts requests and request-body
bytes by the key's first folder under the run; the trainer's writes made with its SummaryWriter and
log lines. Each interval writes a batch and waits for the watcher's next round; then nothing is
written for a while and the requests of those idle intervals are counted.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from podlab import BUCKET, ROOT, wait_until
from s3_fault_proxy import FaultProxy

POINTS_PER_INTERVAL = 20  # scalars, and as many log lines
PREFIX = "runs/growth/"
URI = f"s3://{BUCKET}/{PREFIX}"


class Meter:
    """Requests and request-body bytes through a FaultProxy, by the key's first folder under the run."""

    def __init__(self, proxy: FaultProxy, prefix: str = PREFIX):
        self.prefix = prefix
        self.lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.puts: collections.Counter[str] = collections.Counter()  # key -> PUTs of it
        self.current = threading.local()
        choose, pace = proxy.choose_fault, proxy.pace_body

        def choose_fault(method, path):
            where = self.folder_of(path)
            self.current.where = where
            with self.lock:
                self.requests[where] += 1
                if method == "PUT":
                    self.puts[path.split("?")[0]] += 1
            return choose(method, path)

        def pace_body(size):
            with self.lock:
                self.bytes[getattr(self.current, "where", "?")] += size
            return pace(size)

        proxy.choose_fault, proxy.pace_body = choose_fault, pace_body

    def folder_of(self, path: str) -> str:
        key = path.split("?")[0].removeprefix(f"/{BUCKET}/").removeprefix(self.prefix)
        return key.split("/")[0] if "/" in key else key

    def snapshot(self) -> tuple[dict, dict]:
        with self.lock:
            return dict(self.requests), dict(self.bytes)


def growing(counts: dict) -> int:
    return counts.get("tensorboard", 0) + counts.get("logs", 0)


class Trainer:
    """Writes as train.py does: a SummaryWriter's event file and log lines, a batch per interval."""

    def __init__(self, out: Path, log: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))
        self.log = log
        self.step = 0

    def interval(self) -> int:
        """Write one interval's points; the bytes written."""
        before = self.event_file().stat().st_size + self.log.stat().st_size
        with self.log.open("a") as file:
            for _ in range(POINTS_PER_INTERVAL):
                self.step += 1
                self.writer.add_scalar("train/loss", 1.0 / self.step, self.step)
                file.write(f"2026-11-23T00:00:00Z train: step {self.step}/600000 | loss {1.0 / self.step:.4f}\n")
        self.writer.flush()
        return self.event_file().stat().st_size + self.log.stat().st_size - before

    def event_file(self) -> Path:
        return Path(self.writer.file_writer.event_writer._file_name)


def measure(endpoint: str, folder: Path, intervals: int, idle_intervals: int) -> dict:
    """Bytes the watcher put for growing files in each interval, bytes written in each, and the
    requests of each idle interval (all of them, and those for growing files)."""
    out, log, state = folder / "out", folder / "pod.log", folder / "state"
    state.mkdir(parents=True)
    log.write_text("")
    with FaultProxy(upstream=endpoint, seed=1) as proxy:
        meter = Meter(proxy)
        # A long TTL: no renewal inside the window, so the counts are the uploader's own.
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, "STATE_DIR": str(state), "CODE_DIR": str(ROOT / "code"),
               "LEASE_TTL_SECONDS": "3600", "SYNC_INTERVAL_SECONDS": "1", "UPLOAD_RETRY_SECONDS": "3",
               "PYTHONUNBUFFERED": "1", "LOG_FILE": str(log)}
        subprocess.run([sys.executable, str(ROOT / "job" / "lease.py"), "acquire", URI, str(state / "lease.json")],
                       env=env, check=True, capture_output=True)
        trainer = Trainer(out, log)
        watcher = subprocess.Popen([sys.executable, str(ROOT / "job" / "uploader.py"), "watch", URI, str(out)],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            uploaded, written = [], []
            for _ in range(intervals):
                before_requests, before_bytes = meter.snapshot()
                written.append(trainer.interval())
                # Until the watcher has put the log again: a round of growing files ran after the writes.
                if not wait_until(lambda: meter.snapshot()[0].get("logs", 0) > before_requests.get("logs", 0), 60):
                    raise RuntimeError("the watcher did no upload round in 60 s")
                uploaded.append(growing(meter.snapshot()[1]) - growing(before_bytes))
            # Idle: nothing written. status.json goes up once an interval: count intervals by it.
            start, _ = meter.snapshot()
            wait_until(lambda: meter.snapshot()[0].get("status.json", 0) >= start.get("status.json", 0) + idle_intervals,
                       60)
            end, _ = meter.snapshot()
        finally:
            watcher.send_signal(signal.SIGTERM)
            watcher.communicate(timeout=60)
    idle = max(1, end.get("status.json", 0) - start.get("status.json", 0))
    return {"uploaded": uploaded, "written": written, "idle_intervals": idle,
            "idle_requests": (sum(end.values()) - sum(start.values())) / idle,
            "idle_growing_requests": (growing(end) - growing(start)) / idle}
