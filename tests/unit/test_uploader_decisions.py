"""The uploader's pure decisions: what a status.json read from S3 is worth, which attempt a
(re)started uploader carries on, and which step COMPLETE stands for."""

from __future__ import annotations

import threading

import pytest

import checkpoint_sync
import completion
import run_status
import uploader

GOOD = {"attempt": 1, "pod": "p-1", "started_at": 100.0, "heartbeat_at": 110.0, "ended_at": None,
        "exit_code": None, "start_step": None, "end_step": 5}


@pytest.mark.parametrize("status, attempts", [
    (None, []),                                         # no status.json yet: a first pod
    ({}, []),
    ({"state": "running", "attempts": []}, []),
    ({"attempts": [GOOD]}, [GOOD]),
    ({"attempts": [{**GOOD, "ended_at": 120, "exit_code": 143}]}, [{**GOOD, "ended_at": 120, "exit_code": 143}]),
    ([], None),                                         # JSON, but not an object
    ("x", None),
    (3, None),
    ({"attempts": "x"}, None),
    ({"attempts": None}, None),
    ({"attempts": [1]}, None),
    ({"attempts": [GOOD, "x"]}, None),
    ({"attempts": [{**GOOD, "started_at": "yesterday"}]}, None),
    ({"attempts": [{**GOOD, "started_at": True}]}, None),
    ({"attempts": [{**GOOD, "started_at": 10 ** 400}]}, None),   # JSON's integers have no bound; a float's do
    ({"attempts": [{**GOOD, "ended_at": float("inf")}]}, None),
    ({"attempts": [{**GOOD, "ended_at": "x"}]}, None),
    ({"attempts": [{**GOOD, "heartbeat_at": [1]}]}, None),
    ({"attempts": [{k: v for k, v in GOOD.items() if k != "started_at"}]}, None),
])
def test_attempts_in_a_status_read_from_s3(status, attempts):
    assert run_status.attempts_in(status) == attempts


@pytest.mark.parametrize("saved, pod, carried_on", [
    (None, "p-1", False),                                   # nothing saved: begin one
    ([], "p-1", False),
    ([GOOD], "p-1", True),                                  # the uploader restarted in the same pod
    ([GOOD], "p-2", False),                                 # a WORK_DIR an earlier pod left behind
    ([{**GOOD, "ended_at": 120.0}], "p-1", False),          # that attempt ended already
    ({"attempts": [GOOD]}, "p-1", False),                   # not what the uploader writes
    (["x"], "p-1", False),
])
def test_a_restarted_uploader_carries_on_only_this_pods_open_attempt(saved, pod, carried_on):
    assert (run_status.open_attempts(saved, pod) is not None) == carried_on


@pytest.mark.parametrize("progress, newest_local, step", [
    ({"step": 60, "max_steps": 60}, 60, 60),            # our trainer, at its last step
    ({"step": 40, "max_steps": 60}, 40, None),          # exit 0 before the last step: not complete
    ({"step": 60, "max_steps": 60}, 55, 60),            # what S3 must hold is step 60, whatever is local
    ({"step": 70, "max_steps": 60}, 70, 70),            # restored past a lowered max_steps: done at 70
    ({}, 7, 7),                                         # a trainer that writes no progress.json
    ({"step": 3}, 7, 7),                                # one that reports no max_steps
    ({"step": "x", "max_steps": "y"}, 7, 7),            # nor usable ones
    ({"step": True, "max_steps": True}, 7, 7),
    ({}, None, None),                                   # nothing committed at all
])
def test_the_step_complete_stands_for(progress, newest_local, step):
    assert completion.step_to_complete(progress, newest_local)[0] == step


def test_a_failing_chore_backs_off_alone_and_the_others_run_every_round():
    calls = {"checkpoints": 0, "status": 0}

    def checkpoints():
        calls["checkpoints"] += 1

    def status():
        calls["status"] += 1
        raise ValueError("status.json is damaged")

    chores = [uploader.Chore("checkpoints", checkpoints, 0.0), uploader.Chore("status.json", status, 0.0)]
    for _ in range(3):
        for chore in chores:
            chore.run_if_due()
    assert calls == {"checkpoints": 3, "status": 1}, "the failing one waits out its backoff; the other does not"
    assert chores[1].backoff == 2.0 and chores[0].backoff == 0.0


@pytest.mark.parametrize("failures, backoff", [(1, 2.0), (2, 4.0), (3, 8.0), (6, 60.0), (9, 60.0)])
def test_a_chores_backoff_doubles_up_to_a_minute(failures, backoff):
    chore = uploader.Chore("logs and events", lambda: 1 / 0, 0.0)
    for _ in range(failures):
        chore.due = 0.0  # as if its backoff had passed
        chore.run_if_due()
    assert chore.backoff == backoff


def test_a_chore_that_succeeds_again_drops_its_backoff():
    results = iter([OSError("reset"), OSError("reset"), None])

    def flaky():
        error = next(results)
        if error:
            raise error

    chore = uploader.Chore("status.json", flaky, 5.0)
    for _ in range(3):
        chore.due = 0.0
        chore.run_if_due()
    assert chore.backoff == 0.0


def test_a_lost_lease_is_not_a_chores_failure_it_stops_the_watcher():
    def taken():
        raise uploader.LeaseLost("another pod holds the lease")

    with pytest.raises(uploader.LeaseLost):
        uploader.Chore("checkpoints", taken, 0.0).run_if_due()


def test_s3_unreachable_stops_the_round_and_every_chore_waits_it_out():
    ran = []

    def unreachable():
        ran.append("status")
        raise uploader.s3lib.Unavailable("upload: S3 still unreachable after retrying for 30s")

    chores = [uploader.Chore("checkpoints", lambda: ran.append("checkpoints"), 0.0),
              uploader.Chore("status.json", unreachable, 0.0),
              uploader.Chore("logs and events", lambda: ran.append("logs"), 0.0)]
    pause = uploader.run_round(chores)
    assert ran == ["checkpoints", "status"], "the rest would only wait out the same retries"
    assert pause >= uploader.POLL_SECONDS and chores[1].backoff == 2.0


def test_a_damaged_file_does_not_stop_the_round():
    ran = []

    def damaged():
        raise ValueError("Expecting value: line 1 column 1")

    chores = [uploader.Chore("status.json", damaged, 0.0),
              uploader.Chore("checkpoints", lambda: ran.append("checkpoints"), 0.0)]
    assert uploader.run_round(chores) == uploader.POLL_SECONDS
    assert ran == ["checkpoints"]


def test_a_stop_asked_for_mid_round_ends_the_round():
    stopping = threading.Event()
    ran = []
    chores = [uploader.Chore("checkpoints", lambda: (ran.append("checkpoints"), stopping.set()), 0.0),
              uploader.Chore("status.json", lambda: ran.append("status"), 0.0)]
    uploader.run_round(chores, stopping)
    assert ran == ["checkpoints"], "the final upload does the rest"


@pytest.mark.parametrize("meta,keep", [
    ({"keep": 2}, 2), ({}, 3), ({"keep": 0}, 3), ({"keep": -1}, 3), ({"keep": "2"}, 3), ({"keep": True}, 3),
    ({"keep": 2.5}, 3),
])
def test_keep_comes_from_the_manifest_when_it_makes_sense(tmp_path, meta, keep):
    # A trainer of one's own may record anything: 0 would upload no checkpoint at all.
    import checkpoint

    with checkpoint.stage(tmp_path / "step-00000005") as staged:
        with staged.open("model.pt") as file:
            file.write(b"w")
        staged.commit(meta=meta)
    assert checkpoint_sync.keep_of(tmp_path / "step-00000005") == keep


@pytest.mark.parametrize("written,kept", [
    (None, None),  # the pod said no error
    (b"", None),
    (b"the trainer failed with exit 1: ZeroDivisionError: division by zero\n",
     "the trainer failed with exit 1: ZeroDivisionError: division by zero"),
    (b"a\nsecond line\tand a tab", "a second line and a tab"),  # one line
    (b"escape \x1b[2J bell \x07 here", "escape \\x1b[2J bell \\x07 here"),  # nothing for a terminal to obey
    (b"\xff not utf-8", "\ufffd not utf-8"),
    (b"x" * 5000, "x" * 297 + "..."),
])
def test_a_failed_attempt_keeps_the_pods_last_error_line_bounded_and_escaped(tmp_path, written, kept):
    if written is not None:
        (tmp_path / "last-error.txt").write_bytes(written)
    assert run_status.last_error(tmp_path) == kept
