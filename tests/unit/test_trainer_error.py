"""job/trainer_error.py reads torchrun's error file for script.sh: the worker's real exit code and
the first line of its message, and nothing it cannot trust."""

from __future__ import annotations

import json

import pytest

import trainer_error


def error_file(tmp_path, record) -> str:
    path = tmp_path / "error.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return str(path)


@pytest.mark.parametrize("record,expected", [
    ({"message": {"message": "config: unknown setting x\nTraceback...", "errorCode": 64}}, (64, "config: unknown setting x")),
    ({"message": {"message": "boom"}}, (None, "boom")),
    ({"message": {"message": "", "errorCode": 1}}, (1, trainer_error.NO_MESSAGE)),
    ({"message": {"message": "x" * 1000, "errorCode": 2}}, (2, "x" * trainer_error.MAX_MESSAGE)),
    ({"message": {"message": "m", "errorCode": "64; rm -rf /"}}, (None, "m")),   # not a number: ignored
    ({"message": {"message": "m", "errorCode": 99999}}, (None, "m")),            # no exit code is that
    ({"message": {"message": "m", "errorCode": True}}, (None, "m")),
    ({"message": "a string, not torchrun's shape"}, (None, trainer_error.NO_MESSAGE)),
    ({"other": 1}, (None, trainer_error.NO_MESSAGE)),
    ("{not json", (None, trainer_error.NO_MESSAGE)),
    ("[" * 100000, (None, trainer_error.NO_MESSAGE)),
])
def test_read(tmp_path, record, expected):
    assert trainer_error.read(error_file(tmp_path, record)) == expected


@pytest.mark.parametrize("message", ["RendezvousTimeoutError: ", "RendezvousClosedError: closed",
                                     "RendezvousConnectionError: The connection to the C10d store has failed"])
def test_a_group_that_never_formed_is_75_a_retry_may_pass(tmp_path, message):
    # torchrun's own exception, as its @record writes it (seen with join_timeout=5 and one node).
    code, text = trainer_error.read(error_file(tmp_path, {"message": {"message": message, "extraInfo": {}}}))
    assert code == 75
    assert "rendezvous failed" in text and message.split(":")[0] in text


def test_a_worker_code_wins_over_a_rendezvous_looking_message(tmp_path):
    record = {"message": {"message": "RendezvousTimeoutError in my own code", "errorCode": 1}}
    assert trainer_error.read(error_file(tmp_path, record))[0] == 1


def test_a_missing_file_says_see_the_traceback(tmp_path):
    assert trainer_error.read(str(tmp_path / "none.json")) == (None, trainer_error.NO_MESSAGE)


def test_main_prints_code_then_message(tmp_path, capsys):
    path = error_file(tmp_path, {"message": {"message": "bad\nmore", "errorCode": 64}})
    assert trainer_error.main([path]) == 0
    assert capsys.readouterr().out == "64\nbad\n"
