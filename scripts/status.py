#!/usr/bin/env python3
"""Where every training run stands, from S3 alone (what job/uploader.py writes there).

Usage:
    python scripts/status.py s3://bucket/gpt/runs/                  # one line per run under the prefix
    python scripts/status.py s3://bucket/gpt/runs/my-run/           # one run: summary and every attempt
    python scripts/status.py s3://bucket/gpt/runs/ --json           # the same, as JSON, for machines
    python scripts/status.py s3://bucket/gpt/runs/ --plot loss.png  # train/val loss of the runs
    python scripts/status.py s3://bucket/gpt/runs/ --stale-after 300
    python scripts/status.py --logs s3://bucket/gpt/runs/my-run/      # its pods' logs, oldest first

A run is a folder holding status.json or checkpoints/, at any depth under the prefix; a URI that
holds them itself is one run. Columns: state, newest step committed in S3 / max steps, best
validation loss, attempts (pods) so far, time since the trainer's last heartbeat, bytes in S3.

The states, the columns and every flag are in --help (HELP below) and docs/watching.md.
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import re
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import botocore.exceptions
from botocore.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "job"))  # the pod's contract, S3 error table, protocol
import checkpoint  # noqa: E402 - step folder names, as the pod names them
import contract  # noqa: E402
import s3_errors  # noqa: E402

EXIT_BAD_INPUT = contract.EXIT_BAD_INPUT
EXIT_UNAVAILABLE = contract.EXIT_UNAVAILABLE
STOPPED_BY_SIGNAL = (contract.EXIT_SIGINT, contract.EXIT_SIGTERM)
LIVE_STATES = ("starting", "running")
MAX_JSON_BYTES = 1 << 20  # status.json is a few kB per hundred attempts; anything past this is not ours
MAX_TEXT = 300  # characters of a name or a line from S3 shown in a cell
LATEST_STAMP = 4102444800  # 2100-01-01: a time past this is not a pod's clock
CHECKPOINTS = contract.CHECKPOINTS_DIR
MANIFEST = contract.MANIFEST
PLOTTED_TAGS = ("train/loss", "val/loss")
# --plot downloads a run's event files into a temporary folder: their sizes come from S3. A pod's
# scalars take tens of bytes a step, so a run's files past this are not a pod's.
MAX_PLOT_BYTES = 1 << 30


class BadInput(Exception):
    """Fails the same way every time: exit 64."""


class Unavailable(Exception):
    """S3 could not be reached: exit 75."""


class Unreadable(Exception):
    """A run's object is not what the pod writes: the run shows as unreadable, the others as usual."""


def printable(text: str, limit: int | None = MAX_TEXT, keep: str = "") -> str:
    """TEXT for a terminal (contract.printable: control and format characters escaped), at most
    LIMIT characters."""
    shown = contract.printable(text, keep)
    return shown if limit is None or len(shown) <= limit else shown[:limit - 3] + "..."


# -- S3 -------------------------------------------------------------------------------------------

def parse_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix ending in / or empty)."""
    if fault := contract.s3_uri_fault(uri):
        raise BadInput(f"{uri!r} {fault}; give one, e.g. s3://my-bucket/gpt/runs/")
    bucket, _, prefix = uri[5:].partition("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def make_client():
    # Few, quick retries: a person is waiting, and an unreachable store should say so soon.
    config = Config(retries={"mode": "standard", "total_max_attempts": 3}, connect_timeout=5, read_timeout=30,
                    max_pool_connections=16)
    try:
        return boto3.client("s3", config=config)
    except ValueError as err:  # botocore rejects an endpoint without a scheme here
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        raise BadInput(f"AWS_ENDPOINT_URL={endpoint} is not a URL ({err}); "
                       "give it with its scheme, e.g. http://127.0.0.1:9000") from None
    except botocore.exceptions.BotoCoreError as err:
        raise BadInput(f"cannot make an S3 client: {err}; check AWS_ENDPOINT_URL and "
                       "AWS_DEFAULT_REGION") from None


def explained(err: Exception, bucket: str) -> Exception:
    """The error as BadInput or Unavailable, with one line that names the cause and the fix."""
    where = f"s3://{bucket}/"
    if isinstance(err, botocore.exceptions.NoCredentialsError):
        return BadInput(s3_errors.explain_code("NoCredentials", where, "local"))
    if isinstance(err, botocore.exceptions.ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        line = s3_errors.explain_code(code, where, "local")
        if line:
            return BadInput(line)
        if status < 500 and code not in ("SlowDown", "RequestTimeout", "Throttling"):
            return BadInput(f"S3 error {code}: {str(err).splitlines()[0][:200]}")
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    reason = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return Unavailable(f"S3 unreachable at {endpoint} ({reason}); "
                       "check the network, the VPN or AWS_ENDPOINT_URL, then try again")


class Store:
    """The few S3 reads this tool makes, with errors sorted into BadInput and Unavailable."""

    def __init__(self, bucket: str):
        self.bucket = bucket
        self.s3 = make_client()

    def guarded(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
            raise explained(err, self.bucket) from None

    def list_objects(self, prefix: str) -> list[dict]:
        def collect() -> list[dict]:
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            return [item for page in pages for item in page.get("Contents", [])]

        return self.guarded(collect)

    def read_json(self, key: str) -> dict | None:
        """The object parsed; None when it is gone (a listing is a moment ago). Anyone who may
        write the bucket may have put anything there: Unreadable, with why, when it is bigger than
        MAX_JSON_BYTES, not JSON, nested too deep for the parser, or not an object."""
        name = key.rsplit("/", 1)[-1]
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read(MAX_JSON_BYTES + 1)
        except botocore.exceptions.ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise explained(err, self.bucket) from None
        except botocore.exceptions.BotoCoreError as err:
            raise explained(err, self.bucket) from None
        if len(body) > MAX_JSON_BYTES:
            raise Unreadable(f"{name} is over {MAX_JSON_BYTES >> 20} MB")
        try:
            value = checkpoint.untrusted_json(body)
        except checkpoint.TooDeep:
            raise Unreadable(f"{name} is nested too deep") from None
        except ValueError:
            raise Unreadable(f"{name} is not JSON") from None
        if not isinstance(value, dict):
            raise Unreadable(f"{name} is a JSON {type(value).__name__}, not an object")
        return value

    def stream(self, key: str):
        """The object's bytes, a chunk at a time (a pod's log may be large)."""
        try:
            yield from self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].iter_chunks(1 << 16)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
            raise explained(err, self.bucket) from None

    def download(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.guarded(self.s3.download_file, self.bucket, key, str(path))


# -- what S3 holds --------------------------------------------------------------------------------

@dataclass
class RunFiles:
    """One run's objects, from a single listing of the prefix."""

    name: str
    prefix: str
    size: int = 0
    committed: set[int] = field(default_factory=set)
    event_files: list[str] = field(default_factory=list)
    event_bytes: int = 0
    keys: set[str] = field(default_factory=set)


def run_root(relative: str) -> str | None:
    """The run folder a key (relative to the prefix) marks as a run, or None."""
    parts = relative.split("/")
    if parts[-1] == "status.json":
        return "/".join(parts[:-1])
    if CHECKPOINTS in parts[:-1]:
        return "/".join(parts[:parts.index(CHECKPOINTS)])
    return None


def find_runs(objects: list[dict], prefix: str) -> dict[str, RunFiles]:
    """Runs by name (their path under the prefix; "" when the prefix is a run itself)."""
    marked = {r for o in objects if (r := run_root(o["Key"][len(prefix):])) is not None}
    # A run's own folders may hold anything: only the outermost marked folders are runs.
    roots = {r for r in marked if r == "" or _run_above(r, marked) is None}
    runs = {r: RunFiles(r, prefix + (r + "/" if r else "")) for r in roots}
    for item in objects:
        owner = _run_above(item["Key"][len(prefix):], roots)
        if owner is None:
            continue
        run = runs[owner]
        inner = item["Key"][len(run.prefix):]
        run.size += item["Size"]
        run.keys.add(inner)
        parts = inner.split("/")
        is_manifest = len(parts) == 3 and parts[0] == CHECKPOINTS and parts[2] == MANIFEST
        if is_manifest and checkpoint.parse_step(parts[1]) is not None:  # committed: its manifest is there
            run.committed.add(checkpoint.parse_step(parts[1]))
        if parts[0] == "tensorboard" and "tfevents" in parts[-1]:
            run.event_files.append(inner)
            run.event_bytes += item["Size"]
    return runs


def _run_above(path: str, roots: set[str]) -> str | None:
    """The outermost of `roots` that holds `path` (a key, or a folder without its slash)."""
    parts = path.split("/")[:-1]
    return next((folder for i in range(len(parts) + 1) if (folder := "/".join(parts[:i])) in roots), None)


# -- the state of a run ---------------------------------------------------------------------------

def summarize(store: Store, run: RunFiles, bucket: str, stale_after: float) -> dict:
    """The run's row; an unreadable one when an object it needs is not what the pod writes."""
    name = run.name or run.prefix.rstrip("/").rsplit("/", 1)[-1] or bucket
    try:
        return _summary(store, run, bucket, stale_after, name)
    except Unreadable as err:
        return unreadable_row(run, bucket, name, str(err))


def _summary(store: Store, run: RunFiles, bucket: str, stale_after: float, name: str) -> dict:
    status = Fields(store.read_json(run.prefix + "status.json") if "status.json" in run.keys else None, "status.json")
    now = time.time()  # after the read: a heartbeat written meanwhile is not in the future
    finished = "COMPLETE" in run.keys
    complete = Fields(store.read_json(run.prefix + "COMPLETE") if finished else None, "COMPLETE")
    progress = status.group("progress")
    newest = max(run.committed, default=None)
    meta = {}
    if newest is not None and progress.count("max_steps") is None:  # no trainer report: ask the checkpoint
        meta = manifest_meta(store, f"{run.prefix}{CHECKPOINTS}/{checkpoint.step_dir_name(newest)}/{MANIFEST}")
    heartbeat = status.stamp("heartbeat_at")
    attempts = [attempt_of(a, f"status.json attempts[{i}]") for i, a in enumerate(status.items("attempts"))]
    return {
        "run": name,
        "uri": f"s3://{bucket}/{run.prefix}",
        "state": state_of(status, attempts, finished, stale_after, now),
        "committed_step": newest,
        "max_steps": _first(progress.count("max_steps"), meta.get("max_steps"), complete.count("steps")),
        "step": progress.count("step"),
        "train_loss": _first(progress.real("train_loss"), complete.real("train_loss")),
        "val_loss": _first(progress.real("val_loss"), complete.real("val_loss"), meta.get("val_loss")),
        "best_val_loss": _first(complete.real("best_val_loss"), progress.real("best_val_loss"),
                                meta.get("best_val_loss")),
        "best_step": _first(complete.count("best_step"), progress.count("best_step"), meta.get("best_step")),
        "tokens_per_sec": progress.amount("tokens_per_sec"),
        "eta_seconds": progress.amount("eta_seconds"),
        "attempts": len(attempts) or complete.count("attempts") or 0,
        "pod": status.text("pod"),
        "heartbeat_at": heartbeat,
        "heartbeat_age_seconds": round(now - heartbeat, 1) if heartbeat else None,
        "size_bytes": run.size,
        "completed_at": complete.stamp("completed_at"),
        "last_error": attempts[-1].get("error") if attempts else None,
        "problem": None,
        "attempt_history": attempts,
    }


def manifest_meta(store: Store, key: str) -> dict:
    """What the newest checkpoint's manifest says of the run, for a trainer that reports nothing
    else; nothing when the manifest is damaged: the pod skips such a checkpoint, so does this."""
    try:
        meta = Fields(store.read_json(key), "manifest.json").group("meta")
        return {"max_steps": meta.count("max_steps"), "val_loss": meta.real("val_loss"),
                "best_val_loss": meta.real("best_val_loss"), "best_step": meta.count("best_step")}
    except Unreadable:
        return {}


def unreadable_row(run: RunFiles, bucket: str, name: str, problem: str) -> dict:
    row = {key: None for key in ("committed_step", "max_steps", "step", "train_loss", "val_loss", "best_val_loss",
                                 "best_step", "tokens_per_sec", "eta_seconds", "pod", "heartbeat_at",
                                 "heartbeat_age_seconds", "completed_at", "last_error")}
    row.update(run=name, uri=f"s3://{bucket}/{run.prefix}", state="unreadable", attempts=0, size_bytes=run.size,
               committed_step=max(run.committed, default=None), problem=problem, attempt_history=[])
    return row


class Fields:
    """A JSON object read from S3, one typed field at a time: a field of another type than the pod
    writes makes the run Unreadable (with its name), a missing or null one is None."""

    def __init__(self, value: dict | None, where: str):
        self.value, self.where = value or {}, where

    def _get(self, key: str, ok, kind: str):
        value = self.value.get(key)
        if value is None or ok(value):
            return value
        raise Unreadable(f"{self.where}: {key} is {_kind(value)}, not {kind}")

    def group(self, key: str) -> "Fields":
        return Fields(self._get(key, lambda v: isinstance(v, dict), "an object"), f"{self.where} {key}")

    def items(self, key: str) -> list:
        return self._get(key, lambda v: isinstance(v, list), "a list") or []

    def count(self, key: str) -> int | None:
        """A step, an attempt number, an exit code."""
        return self._get(key, lambda v: _is_int(v) and -(1 << 31) <= v < 1 << 53, "a whole number")

    def real(self, key: str) -> float | None:
        """A loss: any number (a diverged run's may be NaN)."""
        return self._get(key, lambda v: _is_real(v), "a number")

    def amount(self, key: str) -> float | None:
        """A rate or a duration: finite, not negative."""
        return self._get(key, lambda v: _is_real(v) and 0 <= v < 1e15, "a finite number of 0 or more")

    def stamp(self, key: str) -> float | None:
        """A Unix time a pod's clock can give."""
        return self._get(key, lambda v: _is_real(v) and 0 <= v < LATEST_STAMP, "a time (Unix seconds)")

    def text(self, key: str) -> str | None:
        return self._get(key, lambda v: isinstance(v, str), "text")

    def flag(self, key: str) -> bool | None:
        return self._get(key, lambda v: isinstance(v, bool), "true or false")


def attempt_of(value, where: str) -> dict:
    """One attempt of status.json, every field it shows checked."""
    if not isinstance(value, dict):
        raise Unreadable(f"{where} is {_kind(value)}, not an object")
    fields = Fields(value, where)
    return {"attempt": fields.count("attempt"), "pod": fields.text("pod"), "started_at": fields.stamp("started_at"),
            "heartbeat_at": fields.stamp("heartbeat_at"), "ended_at": fields.stamp("ended_at"),
            "exit_code": fields.count("exit_code"), "lost": fields.flag("lost"),
            "start_step": fields.count("start_step"), "end_step": fields.count("end_step"),
            "error": fields.text("error")}


def state_of(status: Fields, attempts: list[dict], complete: bool, stale_after: float, now: float) -> str:
    if complete:
        return "completed"
    if not status.value:
        return "unknown"
    state = status.text("state")
    if state in LIVE_STATES:
        heartbeat = status.stamp("heartbeat_at") or status.stamp("updated_at") or 0
        return "stale" if now - heartbeat > stale_after else state
    code = attempts[-1]["exit_code"] if attempts else None
    if state == "failed" or (code is not None and code != 0 and code not in STOPPED_BY_SIGNAL):
        return "failed"
    if state == "completed":
        return "incomplete"
    return state or "unknown"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A number a float holds (NaN too): JSON's integers have no bound, and one past float's overflows."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (isinstance(value, float) or abs(value) <= sys.float_info.max))


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "text", bool: "true or false"}.get(type(value), f"{value!r}"[:40])


def _first(*values):
    return next((v for v in values if v is not None), None)


# -- showing it -----------------------------------------------------------------------------------

COLUMNS = ("RUN", "STATE", "STEP", "BEST VAL", "ATTEMPTS", "HEARTBEAT", "SIZE")


def table_row(row: dict) -> tuple[str, ...]:
    step = "-" if row["committed_step"] is None else str(row["committed_step"])
    if row["max_steps"] is not None:
        step += f"/{row['max_steps']}"
    age = row["heartbeat_age_seconds"]
    return (printable(row["run"]), printable(row["state"]), step, _loss(row["best_val_loss"]), str(row["attempts"]),
            "-" if age is None else f"{human_seconds(age)} ago", human_bytes(row["size_bytes"]))


def notes(rows: list[dict]) -> list[str]:
    """Why each unreadable run is, and the last error of each failed one: a line each, under the table."""
    found = [(row["run"], row["problem"]) for row in rows if row["problem"]]
    found += [(row["run"], f"attempt {row['attempts']}: {row['last_error']}")
              for row in rows if row["state"] == "failed" and row["last_error"]]
    if not found:
        return []
    width = max(len(printable(name)) for name, _ in found)
    return ["", *(f"{printable(name).ljust(width)}  {printable(note, None)}" for name, note in found)]


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows])


def format_detail(row: dict) -> str:
    lines = [format_table(COLUMNS, [table_row(row)]), "", f"uri      {printable(row['uri'], None)}"]
    if row["problem"]:
        lines.append(f"problem  {printable(row['problem'], None)}")
    if row["step"] is not None:
        lines.append(f"trainer  {progress_line(row)}")
    if row["completed_at"]:
        lines.append(f"COMPLETE {_clock(row['completed_at'])}")
    attempts = row["attempt_history"]
    if attempts:
        header = ("ATTEMPT", "POD", "STARTED (UTC)", "DURATION", "EXIT", "STEPS")
        rows = [attempt_row(a, row["state"], last=i == len(attempts) - 1) for i, a in enumerate(attempts)]
        lines += ["", format_table(header, rows)]
        if all(a.get("end_step") is None for a in attempts):
            lines += ["", "STEPS are ? until the trainer writes progress.json (a trainer of your own may not: "
                          "docs/own-trainer.md#progressjson-and-complete)"]
        errors = [f"attempt {_or_q(a['attempt'])}: {printable(a['error'], None)}" for a in attempts if a["error"]]
        lines += ["", *errors] if errors else []
    return "\n".join(lines)


def progress_line(row: dict) -> str:
    parts = [f"step {row['step']}/{row['max_steps']}", f"train loss {_loss(row['train_loss'])}",
             f"val loss {_loss(row['val_loss'])}"]
    if row["best_step"] is not None:
        parts.append(f"best {_loss(row['best_val_loss'])} at step {row['best_step']}")
    if row["tokens_per_sec"]:
        parts.append(f"{row['tokens_per_sec']:,.0f} tok/s")
    if row["state"] in LIVE_STATES and row["eta_seconds"] is not None:
        parts.append(f"eta {human_seconds(row['eta_seconds'])}")
    return " | ".join(parts)


def attempt_row(attempt: dict, state: str, last: bool) -> tuple[str, ...]:
    started = attempt.get("started_at")
    end = attempt.get("ended_at") or attempt.get("heartbeat_at")
    if attempt.get("lost"):
        outcome = "lost"
    elif attempt.get("exit_code") is not None:
        outcome = str(attempt["exit_code"])
    elif last and state in ("running", "starting", "stale"):
        outcome = "running" if state != "stale" else "stale"
    else:
        outcome = "-"
    steps = f"{_or_q(attempt.get('start_step'))}→{_or_q(attempt.get('end_step'))}"
    duration = human_seconds(end - started) if started and end else "-"
    return (_or_q(attempt.get("attempt")), printable(attempt.get("pod") or "?"), _clock(started) if started else "-",
            duration, outcome, steps)


def human_seconds(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def human_bytes(size: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _or_q(value) -> str:
    return "?" if value is None else str(value)


def _clock(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stamp))


# -- the loss curves ------------------------------------------------------------------------------

def loss_curves(folder: Path) -> dict[str, tuple[list[int], list[float]]]:
    """tag -> (steps, values) from a run's event files, one per pod start. TensorBoard's own
    reader: a restarted pod's purge_step drops the steps the earlier pod logged past its last
    checkpoint, so a redone step counts once, with its newest value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = set(accumulator.Tags().get("scalars", []))
    curves = {}
    for tag in PLOTTED_TAGS:
        if tag in tags:
            events = accumulator.Scalars(tag)
            curves[tag] = ([e.step for e in events], [e.value for e in events])
    return curves


def plot(store: Store, runs: list[RunFiles], path: Path) -> int:
    """Draw the runs' curves into `path`; the number of runs drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The reader logs a warning for each restart it purges: expected here, not news.
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    figure, axes = plt.subplots(figsize=(10, 6))
    drawn = 0
    with tempfile.TemporaryDirectory(prefix="status-plot-") as temp:
        for index, run in enumerate(runs):
            if run.event_bytes > MAX_PLOT_BYTES:
                print(f"status: note: {printable(run.name or run.prefix)}: its event files hold "
                      f"{run.event_bytes / (1 << 30):.1f} GiB, more than --plot reads ({MAX_PLOT_BYTES >> 30} GiB); "
                      "not drawn (scripts/tensorboard.sh shows them)", file=sys.stderr)
                continue
            folder = Path(temp) / f"run-{index}"
            # TensorBoard reads a folder's event files in name order (the second each was opened):
            # numbered in that order, a name from S3 can be neither too long for the disk nor a clash.
            for number, key in enumerate(sorted(run.event_files, key=lambda k: Path(k).name)):
                store.download(run.prefix + key, folder / f"{number:06d}.tfevents")
            curves = loss_curves(folder) if run.event_files else {}
            if not curves:
                print(f"status: note: {printable(run.name or run.prefix)}: no loss in TensorBoard event files yet",
                      file=sys.stderr)
                continue
            color = f"C{drawn % 10}"
            name = printable(run.name or run.prefix.rstrip("/").rsplit("/", 1)[-1]).replace("$", r"\$")  # no mathtext
            if "train/loss" in curves:
                axes.plot(*curves["train/loss"], color=color, linewidth=1, label=f"{name} train")
            if "val/loss" in curves:
                axes.plot(*curves["val/loss"], color=color, linestyle="none", marker="o", markersize=4,
                          label=f"{name} val")
            drawn += 1
    try:
        if drawn:
            save(figure, axes, path)
    finally:
        plt.close(figure)
    return drawn


def save(figure, axes, path: Path) -> None:
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    axes.set_title("loss by step")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except OSError as err:
        raise BadInput(f"cannot write the plot to {path}: {err.strerror or err}; give a writable path") from None


# -- the pods' logs -------------------------------------------------------------------------------

LOG_FOLDER = re.compile(r"attempt-([0-9]+)-(.*)")
MAX_LINE = 1 << 20  # a "line" longer than this (no newline in a MB) is shown in pieces


def print_logs(uri: str, attempt: int | None, events: bool) -> None:
    """The run's pod logs from S3, attempt by attempt (or one), line by line, escaped."""
    bucket, prefix = parse_uri(uri)
    store = Store(bucket)
    logs = prefix + contract.LOGS_PREFIX
    folders = log_folders(store.list_objects(logs), logs)
    if not folders:
        raise BadInput(f"no pod logs under s3://{bucket}/{logs}; give one run's folder (status.py on the folder "
                       "above lists its runs)")
    if attempt is not None:
        numbers = sorted({number for number, _ in folders})
        folders = {name: keys for name, keys in folders.items() if name[0] == attempt}
        if not folders:
            raise BadInput(f"the run has no log of attempt {attempt}; --attempt takes one of "
                           f"{', '.join(map(str, numbers))}")
    hidden = 0
    for (number, pod), keys in sorted(folders.items()):
        print(f"== attempt {number}, pod {printable(pod)} ==", flush=True)
        for line in lines_of(store, keys):
            if not events and line.startswith(contract.EVENT_PREFIX):
                hidden += 1
                continue
            sys.stdout.write(printable(line, None, keep="\t") + "\n")
    sys.stdout.flush()
    if hidden:
        print(f"status: {hidden} EVENT lines (for tools) not shown; --events shows them", file=sys.stderr)


def log_folders(objects: list[dict], logs: str) -> dict[tuple[int, str], list[str]]:
    """(attempt, pod) -> its segments' keys in order, from a listing of logs/."""
    folders: dict[tuple[int, str], list[str]] = {}
    for item in objects:
        folder, _, segment = item["Key"][len(logs):].partition("/")
        match = LOG_FOLDER.fullmatch(folder)
        if match and segment.endswith(".log") and "/" not in segment:
            folders.setdefault((int(match[1]), match[2]), []).append(item["Key"])
    return {name: sorted(keys) for name, keys in folders.items()}


def lines_of(store: Store, keys: list[str]):
    """The text of the segments, one line at a time (without its newline); bytes that are not
    UTF-8 become U+FFFD, a line with no end in MAX_LINE characters comes in pieces."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    rest = ""
    for key in keys:
        for chunk in store.stream(key):
            *whole, rest = (rest + decoder.decode(chunk)).split("\n")
            yield from whole
            while len(rest) > MAX_LINE:
                yield rest[:MAX_LINE]
                rest = rest[MAX_LINE:]
    rest += decoder.decode(b"", final=True)
    if rest:
        yield rest


# -- main -----------------------------------------------------------------------------------------

def gather(uri: str, stale_after: float) -> tuple[Store, list[RunFiles], list[dict], bool]:
    """(store, runs, their summaries sorted by name, whether the URI is one run)."""
    bucket, prefix = parse_uri(uri)
    store = Store(bucket)
    objects = store.list_objects(prefix)
    runs = find_runs(objects, prefix)
    if not runs:
        what = "nothing" if not objects else f"{len(objects)} objects but no run (no status.json, no checkpoints/)"
        raise BadInput(f"{what} under s3://{bucket}/{prefix}; check the prefix (give the folder that holds "
                       "the runs, or one run's folder)")
    single = "" in runs
    ordered = [runs[""]] if single else [runs[name] for name in sorted(runs)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        rows = list(pool.map(lambda run: summarize(store, run, bucket, stale_after), ordered))
    return store, ordered, rows, single


def report(rows: list[dict], single: bool, as_json: bool) -> str:
    if as_json:
        if single:
            return json.dumps(rows[0], indent=1)
        return json.dumps([{k: v for k, v in row.items() if k != "attempt_history"} for row in rows], indent=1)
    if single:
        return format_detail(rows[0])
    return "\n".join([format_table(COLUMNS, [table_row(row) for row in rows]), *notes(rows)])


HELP = """States:
    completed    COMPLETE exists
    running      a pod trains it (starting: a pod restores it); heartbeat newer than --stale-after
    stale        status.json says running, but no heartbeat for --stale-after seconds: the pod
                 died without a word (SIGKILL, node lost) or cannot reach S3
    failed       the last pod ended with an exit code other than 0, 130 and 143
    interrupted  the last pod was stopped (SIGTERM or SIGINT, exit 143 or 130); the next one resumes
    incomplete   the last pod ended with 0 but COMPLETE is missing; the next pod writes it
    unknown      checkpoints but no status.json (a run the uploader never reported)
    unreadable   its status.json or COMPLETE is not what the pod writes (too big, nested too
                 deep, not JSON, a field of another type): why, under the table and as "problem"
                 (--json); the other runs show as usual. A damaged newest manifest is skipped, as
                 the pod skips it

A failed attempt shows the pod's last error line (status.json keeps it): under the table for a
failed run; for one run, under its attempts.

--json prints a list of runs with the same fields (one object, with attempt_history, for one run).

--logs prints one run's pod logs from S3 (logs/attempt-NNNN-POD/), each attempt under a header:
what `kubectl logs` showed, after the pod is gone. --attempt N: that attempt's alone. --events:
the EVENT lines for tools too. Control characters in them, and in every name and line read from
S3, are shown escaped (\\x1b), never sent to the terminal.

--plot reads the TensorBoard event files of the runs (steps that a restarted pod redid count
once, as in TensorBoard) and draws train/loss (lines) and val/loss (dots) per run; a run whose
event files hold more than 1 GiB is named and not drawn.

S3 is reached with boto3's usual credentials; AWS_ENDPOINT_URL points it at an S3-compatible
store. Exit codes: 0; 64 bad input (not an s3:// URI, no such bucket, no run under the prefix,
refused credentials); 75 S3 unreachable. Errors are one line on stderr.
"""


def main(argv: list[str] | None = None) -> int:
    parser = contract.BadFlagParser(prog="status.py", description=__doc__.splitlines()[0],
                                    formatter_class=argparse.RawDescriptionHelpFormatter,
                                    epilog="\n".join(__doc__.splitlines()[2:14]) + "\n" + HELP)
    parser.add_argument("uri", metavar="S3_PREFIX", help="s3://bucket/prefix/ holding runs, or one run")
    parser.add_argument("--json", action="store_true", help="print JSON (a list of runs; one object for one run)")
    parser.add_argument("--stale-after", type=float, default=600, metavar="SECONDS",
                        help="a running run without a heartbeat for this long is stale (default 600)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw the loss curves into this PNG")
    parser.add_argument("--logs", action="store_true", help="print the run's pod logs from S3 (S3_PREFIX: one run)")
    parser.add_argument("--attempt", type=int, metavar="N", help="with --logs: attempt N's log alone")
    parser.add_argument("--events", action="store_true", help="with --logs: the EVENT lines for tools too")
    args = parser.parse_args(argv)
    if (args.attempt is not None or args.events) and not args.logs:
        parser.error("--attempt and --events go with --logs")
    try:
        if args.logs:
            print_logs(args.uri, args.attempt, args.events)
            return 0
        store, runs, rows, single = gather(args.uri, args.stale_after)
        print(report(rows, single, args.json))
        if args.plot:
            drawn = plot(store, runs, args.plot)
            if not drawn:
                raise BadInput(f"no run under {args.uri} has a loss in TensorBoard event files yet; nothing to plot")
            print(f"status: loss curves of {drawn} run(s) in {args.plot}", file=sys.stderr)
    except BadInput as err:
        print(f"status: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Unavailable as err:
        print(f"status: error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except BrokenPipeError:  # `status.py --logs RUN | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
