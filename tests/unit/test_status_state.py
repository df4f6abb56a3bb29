"""scripts/status.py's pure parts: which objects make a run, and the state a status.json means,
including status.json files that someone else wrote into the bucket."""

from __future__ import annotations

import pytest

import status

NOW = 1_000_000.0
STALE = 300.0


@pytest.mark.parametrize("case,record,complete,expected", [
    ("finished", {}, True, "completed"),
    ("nothing yet", {}, False, "unknown"),
    ("running, fresh heartbeat", {"state": "running", "heartbeat_at": NOW - 10}, False, "running"),
    ("running, old heartbeat", {"state": "running", "heartbeat_at": NOW - 900}, False, "stale"),
    ("starting, no heartbeat, updated lately", {"state": "starting", "updated_at": NOW - 5}, False, "starting"),
    ("interrupted by SIGTERM", {"state": "interrupted", "attempts": [{"exit_code": 143}]}, False, "interrupted"),
    ("a crash", {"state": "interrupted", "attempts": [{"exit_code": 1}]}, False, "failed"),
    ("failed", {"state": "failed"}, False, "failed"),
    ("exit 0 without COMPLETE", {"state": "completed", "attempts": [{"started_at": NOW, "exit_code": 0}]}, False,
     "incomplete"),
    # Anyone who may write the bucket may write these: a field of another type makes the run
    # "unreadable" (the table says why), never a crash that hides the other runs.
    ("state not a string", {"state": ["running"]}, False, "unreadable"),
    ("heartbeat not a number", {"state": "running", "heartbeat_at": "soon"}, False, "unreadable"),
    ("heartbeat past 2100", {"state": "running", "heartbeat_at": 1e300}, False, "unreadable"),
    ("attempts not a list", {"state": "interrupted", "attempts": "many"}, False, "unreadable"),
    ("an attempt not a mapping", {"state": "interrupted", "attempts": [7]}, False, "unreadable"),
    ("an exit code not a number", {"state": "interrupted", "attempts": [{"exit_code": "1"}]}, False, "unreadable"),
])
def test_state_of_a_run(case, record, complete, expected):
    assert state(record, complete) == expected


def state(record: dict, complete: bool) -> str:
    try:
        fields = status.Fields(record, "status.json")
        attempts = [status.attempt_of(a, "attempt") for a in fields.items("attempts")]
        return status.state_of(fields, attempts, complete, STALE, NOW)
    except status.Unreadable:
        return "unreadable"


@pytest.mark.parametrize("text,shown", [
    ("run-1", "run-1"),
    ("evil\x1b]0;title\x07", "evil\\x1b]0;title\\x07"),
    ("rtl\u202eexe.txt", "rtl\\u202eexe.txt"),
    ("tab\there", "tab\\there"),
    ("é ü 日本", "é ü 日本"),
    ("x" * 400, "x" * 297 + "..."),
])
def test_what_comes_from_s3_is_printable(text, shown):
    assert status.printable(text) == shown


def objects(*keys: str) -> list[dict]:
    return [{"Key": key, "Size": 10} for key in keys]


def test_runs_are_the_outermost_folders_with_a_status_or_checkpoints():
    runs = status.find_runs(objects(
        "runs/a/status.json",
        "runs/a/checkpoints/step-00000010/model.pt",
        "runs/a/checkpoints/step-00000010/manifest.json",
        "runs/a/checkpoints/step-00000020/model.pt",          # no manifest: not committed
        "runs/a/tensorboard/events.out.tfevents.1.pod",
        "runs/a/logs/nested/status.json",                      # inside a run: not a run of its own
        "runs/b/checkpoints/step-00000005/manifest.json",
        "runs/stray.txt",
    ), "runs/")
    assert sorted(runs) == ["a", "b"]
    assert runs["a"].committed == {10}
    assert runs["a"].event_files == ["tensorboard/events.out.tfevents.1.pod"]
    assert runs["b"].committed == {5}
    assert runs["a"].size == 60  # every object under the run, its nested folders included


def test_a_runs_event_files_past_what_plot_reads_are_named_and_never_downloaded(tmp_path, capsys):
    # their sizes come from S3: a crafted 100 GB "event file" must not fill the laptop's disk
    listing = [{"Key": "r/status.json", "Size": 10},
               {"Key": "r/tensorboard/events.out.tfevents.1.pod", "Size": status.MAX_PLOT_BYTES},
               {"Key": "r/tensorboard/events.out.tfevents.2.pod", "Size": 1}]
    runs = status.find_runs(listing, "")
    assert runs["r"].event_bytes == status.MAX_PLOT_BYTES + 1

    class NoDownloads:
        def download(self, key, path):
            raise AssertionError(f"downloaded {key}")

    assert status.plot(NoDownloads(), [runs["r"]], tmp_path / "loss.png") == 0
    assert "r: its event files hold 1.0 GiB, more than --plot reads (1 GiB); not drawn" in capsys.readouterr().err
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("name", ["step-00000010\n", "step-0000001٠", "step-+0000010", "step-", "best"])
def test_only_plain_step_folders_count_as_committed_steps(name):
    runs = status.find_runs(objects(f"r/checkpoints/{name}/manifest.json", "r/status.json"), "")
    assert runs["r"].committed == set()
