"""scripts/status.py on what a writer of the bucket may put there: objects too big, nested too
deep or of other types than the pod writes, and names and lines with terminal escape codes. One
hostile run must never hide the others: it shows as unreadable (with why), the others as usual,
exit 0; nothing read from S3 reaches the terminal unescaped. And --logs, the pods' logs from S3.

No pods: the objects are written as the uploader would (or would never) write them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from podlab import BUCKET, ROOT

STATUS = ROOT / "scripts" / "status.py"
RUNS = f"s3://{BUCKET}/runs/"
NOW = time.time()
ATTEMPT = {"attempt": 1, "pod": "gpt-train-a", "started_at": NOW - 60, "heartbeat_at": NOW - 5, "ended_at": NOW - 5,
           "exit_code": 1, "start_step": 0, "end_step": 7}
GOOD_STATUS = {"state": "failed", "attempt": 1, "pod": "gpt-train-a", "started_at": NOW - 60, "heartbeat_at": NOW - 5,
               "updated_at": NOW - 5, "progress": {"step": 7, "max_steps": 10, "best_val_loss": 2.5},
               "committed_step": 5, "attempts": [ATTEMPT]}
DEEP = b"[" * 100_000 + b"]" * 100_000
ESCAPE = "\x1b]0;pwned\x07\x1b[2J"


def status_with(**changes) -> bytes:
    status = json.loads(json.dumps(GOOD_STATUS))
    for path, value in changes.items():
        *parents, last = path.split("__")
        target = status
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[int(last) if isinstance(target, list) else last] = value
    return json.dumps(status).encode()


# name -> (objects under runs/NAME/, what status.py says of it)
HOSTILE = {
    "deep-status": ({"status.json": DEEP}, "status.json is nested too deep"),
    "deep-complete": ({"status.json": status_with(), "COMPLETE": DEEP}, "COMPLETE is nested too deep"),
    "huge-status": ({"status.json": b'{"pad": "' + b"x" * (2 << 20) + b'"}'}, "status.json is over 1 MB"),
    "loss-text": ({"status.json": status_with(progress__best_val_loss="low")},
                  "status.json progress: best_val_loss is text, not a number"),
    "start-text": ({"status.json": status_with(attempts__0__started_at="noon")},
                   "status.json attempts[0]: started_at is text, not a time (Unix seconds)"),
    "start-far": ({"status.json": status_with(attempts__0__started_at=1e300)},
                  "status.json attempts[0]: started_at is 1e+300, not a time (Unix seconds)"),
    "loss-huge": ({"status.json": status_with(progress__best_val_loss=10 ** 400)},  # past a float: not shown as one
                  "status.json progress: best_val_loss is 1" + "0" * 39 + ", not a number"),
    "attempts-text": ({"status.json": status_with(attempts="many")}, "status.json: attempts is text, not a list"),
    "rate-text": ({"status.json": status_with(progress__tokens_per_sec="fast")},
                  "status.json progress: tokens_per_sec is text, not a finite number of 0 or more"),
    "complete-time-text": ({"status.json": status_with(), "COMPLETE": b'{"steps": 10, "completed_at": "yesterday"}'},
                           "COMPLETE: completed_at is text, not a time (Unix seconds)"),
    "complete-list": ({"status.json": status_with(), "COMPLETE": b"[1, 2]"}, "COMPLETE is a JSON list, not an object"),
    "status-not-json": ({"status.json": b"{not json"}, "status.json is not JSON"),
}


@pytest.fixture
def bucket(s3, tool_path):
    def put(name: str, objects: dict) -> None:
        for key, body in objects.items():
            s3.put_object(Bucket=BUCKET, Key=f"runs/{name}/{key}", Body=body)

    put("good", {"status.json": status_with(attempts__0__error="the trainer failed with exit 1: ValueError: nan"),
                 "checkpoints/step-00000005/manifest.json": b'{"files": {}}'})
    return put


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STATUS), *args], capture_output=True, text=True, timeout=120)


def test_every_hostile_run_shows_as_unreadable_and_the_others_as_usual(bucket):
    for name, (objects, _) in HOSTILE.items():
        bucket(name, objects)
    bucket("damaged-manifest", {"checkpoints/step-00000005/manifest.json": b'{"files": {}, "meta": {"best_val_loss": "x"}}'})
    result = status(RUNS)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    table, notes = result.stdout.split("\n\n")
    cells = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert cells["good"][1:3] == ["failed", "5/10"] and cells["good"][3] == "2.5000"
    assert cells["damaged-manifest"][1:4] == ["unknown", "5", "-"], "a damaged checkpoint says nothing: skipped"
    assert {name: cells[name][1] for name in HOSTILE} == {name: "unreadable" for name in HOSTILE}
    said = dict(line.split(None, 1) for line in notes.splitlines())
    assert {name: said[name] for name in HOSTILE} == {name: why for name, (_, why) in HOSTILE.items()}
    assert said["good"] == "attempt 1: the trainer failed with exit 1: ValueError: nan"
    rows = {row["run"]: row for row in json.loads(status(RUNS, "--json").stdout)}
    assert rows["good"]["state"] == "failed" and rows["good"]["problem"] is None
    assert {name: rows[name]["problem"] for name in HOSTILE} == {name: why for name, (_, why) in HOSTILE.items()}


@pytest.mark.parametrize("name", HOSTILE)
def test_one_hostile_run_alone_says_why_in_one_line_and_exit_0(bucket, name):
    objects, why = HOSTILE[name]
    bucket(name, objects)
    result = status(f"{RUNS}{name}/")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.splitlines()[1].split()[:2] == [name, "unreadable"]
    assert f"problem  {why}" in result.stdout


def test_names_pods_and_error_lines_with_escape_codes_never_reach_the_terminal(bucket):
    bucket(f"evil{ESCAPE}", {"status.json": status_with(pod=f"pod{ESCAPE}", attempts__0__pod=f"pod{ESCAPE}",
                                                        attempts__0__error=f"boom{ESCAPE}")})
    for args in ((RUNS,), (f"{RUNS}evil{ESCAPE}/",), (RUNS, "--json")):
        result = status(*args)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout, result.stdout
    table = status(RUNS).stdout
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J" in table and "boom\\x1b]0;pwned" in table
    detail = status(f"{RUNS}evil{ESCAPE}/").stdout
    assert "pod\\x1b]0;pwned" in detail and "attempt 1: boom\\x1b]0;pwned\\x07\\x1b[2J" in detail


def test_logs_print_each_attempts_log_escaped_without_events_unless_asked(s3, tool_path):
    def put(key: str, body: bytes) -> None:
        s3.put_object(Bucket=BUCKET, Key=f"runs/r/logs/{key}", Body=body)

    put("attempt-0001-gpt-train-a/00000000.log", b"2026 script: starting\nEVENT {\"event\": \"ready\"}\n")
    put("attempt-0001-gpt-train-a/00000001.log", b"2026 train: step 1\t|\n")
    put("attempt-0002-gpt-train-b/00000000.log", b"2026 script: error: \x1b[31mred\x1b[0m \xff\n")
    result = status("--logs", f"{RUNS}r/")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("== attempt 1, pod gpt-train-a ==\n2026 script: starting\n2026 train: step 1\t|\n"
                             "== attempt 2, pod gpt-train-b ==\n2026 script: error: \\x1b[31mred\\x1b[0m \ufffd\n")
    assert "1 EVENT lines (for tools) not shown; --events shows them" in result.stderr
    second = status("--logs", f"{RUNS}r/", "--attempt", "1", "--events")
    assert second.stdout == ("== attempt 1, pod gpt-train-a ==\n2026 script: starting\nEVENT {\"event\": \"ready\"}\n"
                             "2026 train: step 1\t|\n")
    missing = status("--logs", f"{RUNS}r/", "--attempt", "3")
    assert missing.returncode == 64 and "no log of attempt 3; --attempt takes one of 1, 2" in missing.stderr
    none = status("--logs", RUNS)
    assert none.returncode == 64 and f"no pod logs under {RUNS}logs/" in none.stderr


def test_plot_reads_event_files_whatever_their_names(s3, tool_path, tmp_path):
    # Two pods' files (the second resumed at step 5: purge_step), under names of 300 characters, each
    # name in two folders: the download must neither fail on the name nor let one file replace another.
    from torch.utils.tensorboard import SummaryWriter

    for number, (purge, steps, offset) in enumerate(((None, range(1, 9), 0.0), (6, range(6, 11), 100.0))):
        folder = tmp_path / str(number)
        writer = SummaryWriter(str(folder), purge_step=purge)
        for step in steps:
            writer.add_scalar("train/loss", offset + step, step)
        writer.close()
        written = next(folder.iterdir()).read_bytes()
        for inner in ("", "again/"):
            name = f"events.out.tfevents.{1000 + number}.pod" + "x" * 300
            s3.put_object(Bucket=BUCKET, Key=f"runs/long/tensorboard/{inner}{name}", Body=written)
    s3.put_object(Bucket=BUCKET, Key="runs/long/status.json", Body=status_with())
    png = tmp_path / "loss.png"
    result = status(f"{RUNS}long/", "--plot", str(png))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert png.stat().st_size > 0 and "no loss" not in result.stderr, result.stderr


def tensorboard_says(uri: str) -> str:
    """tensorboard.sh's lines about the runs (said before it starts TensorBoard, which is then stopped)."""
    from podlab import free_ports

    board = subprocess.Popen([str(ROOT / "scripts" / "tensorboard.sh"), uri, "--port", str(free_ports())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = []
    try:
        for line in board.stderr:
            said.append(line)
            if line.startswith(("tensorboard.sh: runs under", "tensorboard.sh: run ", "tensorboard.sh: error")):
                break
    finally:
        board.kill()
        board.wait()
    return "".join(said)


def test_tensorboard_sh_shows_run_names_with_escape_codes_escaped(s3, tool_path):
    for name in (f"evil{ESCAPE}\u202egnp.exe", "good"):
        s3.put_object(Bucket=BUCKET, Key=f"runs/{name}/tensorboard/events.out.tfevents.1.pod", Body=b"")
    said = tensorboard_says(RUNS)
    assert "\x1b" not in said and "\x07" not in said and "\u202e" not in said, said
    assert f"runs under {RUNS}: evil?]0;pwned??[2J?gnp.exe, good" in said
    one = tensorboard_says(f"{RUNS}evil{ESCAPE}\u202egnp.exe/")
    assert "\x1b" not in one and "\u202e" not in one and "tensorboard.sh: run evil?]0;pwned??[2J?gnp.exe: " in one, one
