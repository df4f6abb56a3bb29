#!/usr/bin/env python3
"""Where every training run stands, from S3 alone (what job/uploader.py writes there).

Usage:
    python scripts/status.py s3://bucket/gpt/runs/                  # one line per run under the prefix
    python scripts/status.py s3://bucket/gpt/runs/my-run/           # one run: summary and every attempt
    python scripts/status.py s3://bucket/gpt/runs/ --json           # the same, as JSON, for machines
    python scripts/status.py s3://bucket/gpt/runs/ --plot loss.png  # train/val loss of the runs
    python scripts/status.py s3://bucket/gpt/runs/ --stale-after 300

A run is a folder holding status.json or checkpoints/, at any depth under the prefix; a URI that
holds them itself is one run. Columns: state, newest step committed in S3 / max steps, best
validation loss, attempts (pods) so far, time since the trainer's last heartbeat, bytes in S3.

States:
    completed    COMPLETE exists
    running      a pod trains it (starting: a pod restores it); heartbeat newer than --stale-after
    stale        status.json says running, but no heartbeat for --stale-after seconds: the pod
                 died without a word (SIGKILL, node lost) or cannot reach S3
    failed       the last pod ended with an exit code other than 0, 130 and 143
    interrupted  the last pod was stopped (SIGTERM or SIGINT, exit 143 or 130); the next one resumes
    incomplete   the last pod ended with 0 but COMPLETE is missing; the next pod writes it
    unknown      checkpoints but no status.json (a run the uploader never reported)

--json prints a list of runs with the same fields (one object, with attempt_history, for one run).

--plot reads the TensorBoard event files of the runs (steps that a restarted pod redid count
once, as in TensorBoard) and draws train/loss (lines) and val/loss (dots) per run.

S3 is reached with boto3's usual credentials; AWS_ENDPOINT_URL points it at an S3-compatible
store. Exit codes: 0; 64 bad input (not an s3:// URI, no such bucket, no run under the prefix,
refused credentials); 75 S3 unreachable. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
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
CHECKPOINTS = contract.CHECKPOINTS_DIR
MANIFEST = contract.MANIFEST
PLOTTED_TAGS = ("train/loss", "val/loss")


class BadInput(Exception):
    """Fails the same way every time: exit 64."""


class Unavailable(Exception):
    """S3 could not be reached: exit 75."""


# -- S3 -------------------------------------------------------------------------------------------

def parse_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix ending in / or empty)."""
    if not uri.startswith("s3://") or len(uri) <= 5 or uri[5] == "/":
        raise BadInput(f"{uri!r} is not an s3://bucket/prefix/ URI; give one, e.g. s3://my-bucket/gpt/runs/")
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
        """The object parsed; None when it is gone (a listing is a moment ago) or not JSON."""
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except botocore.exceptions.ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise explained(err, self.bucket) from None
        except botocore.exceptions.BotoCoreError as err:
            raise explained(err, self.bucket) from None
        try:
            value = json.loads(body)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None  # anyone may write the bucket: shape first

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
    return runs


def _run_above(path: str, roots: set[str]) -> str | None:
    """The outermost of `roots` that holds `path` (a key, or a folder without its slash)."""
    parts = path.split("/")[:-1]
    return next((folder for i in range(len(parts) + 1) if (folder := "/".join(parts[:i])) in roots), None)


# -- the state of a run ---------------------------------------------------------------------------

def summarize(store: Store, run: RunFiles, bucket: str, stale_after: float) -> dict:
    status = (store.read_json(run.prefix + "status.json") if "status.json" in run.keys else None) or {}
    now = time.time()  # after the read: a heartbeat written meanwhile is not in the future
    finished = "COMPLETE" in run.keys
    complete = (store.read_json(run.prefix + "COMPLETE") if finished else None) or {}
    progress = _mapping(status.get("progress"))
    newest = max(run.committed, default=None)
    meta = {}
    if newest is not None and progress.get("max_steps") is None:  # no trainer report: ask the checkpoint
        manifest = store.read_json(f"{run.prefix}{CHECKPOINTS}/{checkpoint.step_dir_name(newest)}/{MANIFEST}") or {}
        meta = _mapping(manifest.get("meta"))
    heartbeat = _number(status.get("heartbeat_at"))
    attempts = [a for a in status.get("attempts") or [] if isinstance(a, dict)] \
        if isinstance(status.get("attempts"), list) else []
    return {
        "run": run.name or run.prefix.rstrip("/").rsplit("/", 1)[-1] or bucket,
        "uri": f"s3://{bucket}/{run.prefix}",
        "state": state_of(status, finished, stale_after, now),
        "committed_step": newest,
        "max_steps": _first(progress.get("max_steps"), meta.get("max_steps"), complete.get("steps")),
        "step": progress.get("step"),
        "train_loss": _first(progress.get("train_loss"), complete.get("train_loss")),
        "val_loss": _first(progress.get("val_loss"), complete.get("val_loss"), meta.get("val_loss")),
        "best_val_loss": _first(complete.get("best_val_loss"), progress.get("best_val_loss"),
                                meta.get("best_val_loss")),
        "best_step": _first(complete.get("best_step"), progress.get("best_step"), meta.get("best_step")),
        "tokens_per_sec": progress.get("tokens_per_sec"),
        "eta_seconds": progress.get("eta_seconds"),
        "attempts": len(attempts) or complete.get("attempts") or 0,
        "pod": status.get("pod"),
        "heartbeat_at": heartbeat,
        "heartbeat_age_seconds": round(now - heartbeat, 1) if heartbeat else None,
        "size_bytes": run.size,
        "completed_at": complete.get("completed_at"),
        "attempt_history": attempts,
    }


def state_of(status: dict, complete: bool, stale_after: float, now: float) -> str:
    if complete:
        return "completed"
    if not status:
        return "unknown"
    state = status.get("state") if isinstance(status.get("state"), str) else None
    if state in LIVE_STATES:
        heartbeat = _number(status.get("heartbeat_at")) or _number(status.get("updated_at")) or 0
        return "stale" if now - heartbeat > stale_after else state
    attempts = status.get("attempts")
    last = _mapping(attempts[-1]) if isinstance(attempts, list) and attempts else {}
    code = last.get("exit_code")
    if state == "failed" or (code is not None and code != 0 and code not in STOPPED_BY_SIGNAL):
        return "failed"
    if state == "completed":
        return "incomplete"
    return state or "unknown"


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _first(*values):
    return next((v for v in values if v is not None), None)


# -- showing it -----------------------------------------------------------------------------------

COLUMNS = ("RUN", "STATE", "STEP", "BEST VAL", "ATTEMPTS", "HEARTBEAT", "SIZE")


def table_row(row: dict) -> tuple[str, ...]:
    step = "-" if row["committed_step"] is None else str(row["committed_step"])
    if row["max_steps"] is not None:
        step += f"/{row['max_steps']}"
    age = row["heartbeat_age_seconds"]
    return (row["run"], row["state"], step, _loss(row["best_val_loss"]), str(row["attempts"]),
            "-" if age is None else f"{human_seconds(age)} ago", human_bytes(row["size_bytes"]))


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows])


def format_detail(row: dict) -> str:
    lines = [format_table(COLUMNS, [table_row(row)]), "", f"uri      {row['uri']}"]
    if row["step"] is not None:
        lines.append(f"trainer  {progress_line(row)}")
    if row["completed_at"]:
        lines.append(f"COMPLETE {_clock(row['completed_at'])}")
    attempts = row["attempt_history"]
    if attempts:
        header = ("ATTEMPT", "POD", "STARTED (UTC)", "DURATION", "EXIT", "STEPS")
        rows = [attempt_row(a, row["state"], last=i == len(attempts) - 1) for i, a in enumerate(attempts)]
        lines += ["", format_table(header, rows)]
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
    return (str(attempt.get("attempt", "?")), str(attempt.get("pod", "?")), _clock(started) if started else "-",
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
            folder = Path(temp) / f"run-{index}"
            for key in run.event_files:
                store.download(run.prefix + key, folder / Path(key).name)
            curves = loss_curves(folder) if run.event_files else {}
            if not curves:
                print(f"status: note: {run.name or run.prefix}: no loss in TensorBoard event files yet",
                      file=sys.stderr)
                continue
            color = f"C{drawn % 10}"
            name = run.name or run.prefix.rstrip("/").rsplit("/", 1)[-1]
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
    return format_table(COLUMNS, [table_row(row) for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("uri", metavar="S3_PREFIX", help="s3://bucket/prefix/ holding runs, or one run")
    parser.add_argument("--json", action="store_true", help="print JSON (a list of runs; one object for one run)")
    parser.add_argument("--stale-after", type=float, default=600, metavar="SECONDS",
                        help="a running run without a heartbeat for this long is stale (default 600)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw the loss curves into this PNG")
    args = parser.parse_args(argv)
    try:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
