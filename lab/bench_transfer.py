"""Moving a checkpoint's bytes, each way against its floors in the same run (local S3 on loopback).

upload: a committed checkpoint goes up through the real watcher (job/uploader.py watch), timed by
its `uploaded` event; beside it `s5cmd cp` of the same folder and s3torchconnector's writer.
The watcher's lag is the `uploaded` event's time minus the moment the folder was committed.

restore: job/restore.py run as the pod runs it (a process: S3_OUTPUT_URI OUT) on the newest of
those checkpoints; beside it `s5cmd cp` of the same objects, a plain write of the same bytes to
the same disk, plain parallel ranged GETs read into nothing (boto3), and s3torchconnector's reader
into a file. None of them fsyncs: the restore does not (its copy is hashed on every start). Each
repetition runs every method once, one after another, so a burst of load from elsewhere hits all
of them; the figures are medians.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_report import figure, unmeasured
from podlab import BUCKET, ROOT, VENV_BIN, Pod, checkpoint

CHUNK = 64 << 20
GET_PART = 16 << 20
GET_THREADS = 8


def median(values: list[float]) -> float:
    return statistics.median(values)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def commit_random(root: Path, step: int, size: int, noise: bytes) -> Path:
    """A committed step folder of `size` bytes (a third model.pt, the rest state.pt), as train.py
    commits one: through the hashing writer, fsynced, manifest last."""
    final = root / "checkpoints" / checkpoint.step_dir_name(step)
    with checkpoint.stage(final) as staged:
        for name, share in (("model.pt", size // 3), ("state.pt", size - size // 3)):
            with staged.open(name) as file:
                left = share
                while left:
                    piece = min(left, len(noise))
                    # Each chunk differs (a step counter in front): no two files the same bytes.
                    file.write(step.to_bytes(8, "little") + noise[8:piece] if piece > 8 else noise[:piece])
                    left -= piece
        staged.commit(meta={"step": step, "keep": 2})
    return final


def timed(command: list[str], env: dict) -> float:
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    took = time.monotonic() - started
    if result.returncode:
        raise RuntimeError(f"{command[:3]} exited {result.returncode}: {(result.stdout + result.stderr)[-2000:]}")
    return took


def plain_write(folder: Path, sizes: dict[str, int], noise: bytes) -> float:
    """The disk's floor: the same bytes written as the restore writes them (not fsynced), no
    network, no hashing."""
    folder.mkdir(parents=True)
    started = time.monotonic()
    for name, size in sizes.items():
        with open(folder / name, "wb") as file:
            left = size
            while left:
                piece = min(left, len(noise))
                file.write(noise[:piece])
                left -= piece
    took = time.monotonic() - started
    shutil.rmtree(folder)
    return took


def parallel_gets(s3, prefix: str, sizes: dict[str, int]) -> float:
    """The network's floor: ranged GETs of every object in GET_PART parts, GET_THREADS at a time, read
    into nothing. (The lab's S3 reads only a range's bytes: podlab.serve_ranges_lazily.)"""
    parts = [(name, start, min(start + GET_PART, size) - 1) for name, size in sizes.items()
             for start in range(0, size, GET_PART)]

    def get(part) -> int:
        name, first, last = part
        body = s3.get_object(Bucket=BUCKET, Key=f"{prefix}{name}", Range=f"bytes={first}-{last}")["Body"]
        got = 0
        while chunk := body.read(1 << 20):
            got += len(chunk)
        return got

    started = time.monotonic()
    with ThreadPoolExecutor(GET_THREADS) as pool:
        got = sum(pool.map(get, parts))
    took = time.monotonic() - started
    assert got == sum(sizes.values()), (got, sizes)
    return took


def delete_prefix(s3, prefix: str) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for entry in page.get("Contents", []):
            s3.delete_object(Bucket=BUCKET, Key=entry["Key"])


def s3tc_checkpoint(endpoint: str):
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    # moto on 127.0.0.1: no bucket in the host name, so path-style addressing.
    return S3Checkpoint(region="us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))


def s3tc_upload(ckpt, folder: Path, prefix: str) -> float:
    started = time.monotonic()
    for path in sorted(folder.iterdir()):
        with ckpt.writer(f"s3://{BUCKET}/{prefix}{path.name}") as writer, open(path, "rb") as file:
            while chunk := file.read(CHUNK):
                writer.write(chunk)
    return time.monotonic() - started


def s3tc_restore(ckpt, prefix: str, sizes: dict[str, int], folder: Path) -> float:
    folder.mkdir(parents=True)
    started = time.monotonic()
    for name in sizes:
        with ckpt.reader(f"s3://{BUCKET}/{prefix}{name}") as reader, open(folder / name, "wb") as file:
            while chunk := reader.read(CHUNK):
                file.write(chunk)
    took = time.monotonic() - started
    shutil.rmtree(folder)
    return took


def measure(s3, endpoint: str, folder: Path, size: int, reps: int) -> dict[str, dict]:
    """Every transfer key, for a checkpoint of `size` bytes, `reps` repetitions each."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "S3_ENDPOINT_URL": endpoint,
           "PYTHONUNBUFFERED": "1"}
    noise = os.urandom(min(CHUNK, size))
    out, state = folder / "out", folder / "state"
    state.mkdir(parents=True)
    uri = f"s3://{BUCKET}/bench/transfer/"
    watcher_env = {**env, "STATE_DIR": str(state), "CODE_DIR": str(ROOT / "code"), "SYNC_INTERVAL_SECONDS": "1",
                   "LEASE_TTL_SECONDS": "3600", "UPLOAD_RETRY_SECONDS": "30", "LOG_FILE": str(folder / "pod.log")}
    (folder / "pod.log").write_text("")
    subprocess.run([sys.executable, str(ROOT / "job" / "lease.py"), "acquire", uri, str(state / "lease.json")],
                   env=watcher_env, check=True, capture_output=True)
    watcher = Pod([sys.executable, str(ROOT / "job" / "uploader.py"), "watch", uri, str(out)], folder / "none.pid",
                  watcher_env)
    ours, lags, s5, tc_up = [], [], [], []
    try:
        ckpt = s3tc_checkpoint(endpoint)
        tc_problem = None
    except Exception as error:  # noqa: BLE001 - recorded as the key's reason
        ckpt, tc_problem = None, f"{type(error).__name__}: {error}"
    try:
        for step in range(1, reps + 1):
            final = commit_random(out, step, size, noise)
            committed = time.time()
            event = watcher.wait_for_event("uploaded", timeout=600, step=step)
            lags.append(event["time"] - committed)
            ours.append(event["seconds"])
            s5.append(timed([str(VENV_BIN / "s5cmd"), "cp", f"{final}/*", f"s3://{BUCKET}/bench/s5cmd/{final.name}/"],
                            env))
            if ckpt is not None and tc_problem is None:
                try:
                    tc_up.append(s3tc_upload(ckpt, final, f"bench/s3tc/{final.name}/"))
                except Exception as error:  # noqa: BLE001
                    tc_problem = f"{type(error).__name__}: {error}"
            checkpoint.prune(out / "checkpoints", 1)
            delete_prefix(s3, f"bench/s5cmd/{final.name}/")  # moto holds every byte: keep S3 at one copy each
            delete_prefix(s3, f"bench/s3tc/{final.name}/")
    finally:
        watcher.delete()
        watcher.wait(timeout=120)
    name = checkpoint.step_dir_name(reps)
    sizes = {n: e["size"] for n, e in checkpoint.read_manifest(out / "checkpoints" / name)["files"].items()}
    prefix = f"bench/transfer/checkpoints/{name}/"
    restore, s5_down, disk, gets, tc_down, starts = [], [], [], [], [], []
    for rep in range(reps):
        target = folder / f"restored-{rep}"
        restore.append(timed([sys.executable, str(ROOT / "job" / "restore.py"), uri, str(target)], env))
        # What the restore's process pays before it moves a byte: Python, boto3 and its own modules.
        starts.append(timed([sys.executable, "-c", "import restore"], {**env, "PYTHONPATH": str(ROOT / "job")}))
        assert checkpoint.verify(target / "checkpoints" / name) is None, "restore brought back a damaged checkpoint"
        shutil.rmtree(target)
        s5_down.append(timed([str(VENV_BIN / "s5cmd"), "cp", f"s3://{BUCKET}/{prefix}*", f"{folder / 's5'}/"], env))
        shutil.rmtree(folder / "s5")
        disk.append(plain_write(folder / "disk", sizes, noise))
        gets.append(parallel_gets(s3, prefix, sizes))
        if ckpt is not None and tc_problem is None:
            try:
                tc_down.append(s3tc_restore(ckpt, prefix, sizes, folder / "s3tc"))
            except Exception as error:  # noqa: BLE001
                tc_problem = f"{type(error).__name__}: {error}"
    shutil.rmtree(out)
    mb = f"{size / 1e6:.0f} MB"
    each = f"median of {reps}"
    figures = {
        "restore_vs_s5cmd": figure("restore_vs_s5cmd", median(restore),
                                   f"`python job/restore.py` of a {mb} committed checkpoint (2 files, verified) over "
                                   f"`s5cmd cp` of the same objects, {each}", median(s5_down), runs=restore,
                                   python_start_s=median(starts)),
        "restore_vs_disk_floor": figure("restore_vs_disk_floor", median(restore),
                                        f"the restore over a plain write (no fsync, as the restore) of the same "
                                        f"{mb} to the same disk, {each}", median(disk), floors=disk),
        "restore_vs_get_floor": figure("restore_vs_get_floor", median(restore),
                                       f"the restore over plain parallel ranged GETs ({GET_THREADS} threads, parts "
                                       f"of {GET_PART / 1e6:.0f} MB) of the same "
                                       f"{mb} into nothing (boto3), {each}",
                                       median(gets), floors=gets),
        "upload_vs_s5cmd": figure("upload_vs_s5cmd", median(ours),
                                  f"the watcher's upload of a {mb} committed checkpoint (its `uploaded` event's "
                                  f"seconds, manifest last) over `s5cmd cp` of the same folder, {each}", median(s5),
                                  runs=ours, floors=s5),
        "upload_lag_p95_s": figure("upload_lag_p95_s", p95(lags),
                                   f"p95 of {reps}: a {mb} folder committed on disk to its manifest in S3 with "
                                   f"`uploader.py watch` running (SYNC_INTERVAL_SECONDS=1); floor: the median upload "
                                   f"itself", median(ours), lags=[round(x, 3) for x in lags]),
    }
    if tc_problem is None:
        import s3torchconnector

        version = getattr(s3torchconnector, "__version__", "installed")
        figures["s3torchconnector"] = figure("s3torchconnector", version,
                                             "s3torchconnector ran against the local S3 (path-style, http endpoint)")
        figures["restore_vs_s3torchconnector"] = figure(
            "restore_vs_s3torchconnector", median(restore),
            f"the restore over s3torchconnector {version}'s S3Checkpoint reader of the same {mb} into files "
            f"(no fsync, no verification), {each}", median(tc_down), floors=tc_down)
        figures["upload_vs_s3torchconnector"] = figure(
            "upload_vs_s3torchconnector", median(ours),
            f"the watcher's upload over s3torchconnector {version}'s S3Checkpoint writer of the same {mb} "
            f"folder, {each}", median(tc_up), floors=tc_up)
    else:
        for key in ("s3torchconnector", "restore_vs_s3torchconnector", "upload_vs_s3torchconnector"):
            figures[key] = unmeasured(key, f"s3torchconnector against the local S3 failed: {tc_problem}")
    return figures
