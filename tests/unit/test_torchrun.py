"""job/torchrun.py: torchrun as `python -m torch.distributed.run` runs it; a graceful stop (SIGTERM
to torchrun, as the pod forwards it) is one line in the pod's log instead of a 30-line traceback,
and everything else stays torchrun's: its exit code (1), its error file, its workers' stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ROOT / "job" / "torchrun.py"

WORKER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("worker stopped", flush=True), sys.exit(143)))
print("worker up", flush=True)
time.sleep(120)
"""


def stop_when_up(tmp_path, worker: str, **env) -> tuple[int, str]:
    """torchrun.py on WORKER, SIGTERM once the worker is up: its exit code and output."""
    (tmp_path / "worker.py").write_text(worker)
    torchrun = subprocess.Popen([sys.executable, str(TORCHRUN), "--standalone", "--nproc_per_node=1", "worker.py"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env})
    lines = []
    for line in torchrun.stdout:
        lines.append(line)
        if line.strip() == "worker up":
            torchrun.send_signal(signal.SIGTERM)
    return torchrun.wait(timeout=60), "".join(lines)


def test_a_sigterm_to_torchrun_is_one_line_not_a_traceback(tmp_path):
    error_file = tmp_path / "error.json"
    code, output = stop_when_up(tmp_path, WORKER, TORCHELASTIC_ERROR_FILE=str(error_file))
    assert code == 1, output
    assert "Traceback" not in output and "SignalException" not in output, output
    lines = output.splitlines()
    assert "torchrun: stopped by SIGTERM; its workers were told to stop" in lines, output
    assert "worker stopped" in lines, output
    recorded = json.loads(error_file.read_text())["message"]["message"]
    assert recorded.startswith("SignalException: Process") and recorded.endswith("got signal: 15"), recorded


SLOW_SAVER = """
import signal, sys, time
def save(*_):
    print("saving", flush=True)
    time.sleep(8)
    print("saved", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, save)
print("worker up", flush=True)
time.sleep(120)
"""


def test_torch_elastic_shutdown_timeout_is_how_long_a_stopped_worker_may_save(tmp_path):
    # 2 s where torchrun's own default is 30: the 8 s save is cut short by SIGKILL. torch 2.11's
    # torchrun does not read the variable; through torchrun.py it counts there too (docs/lab.md).
    code, output = stop_when_up(tmp_path, SLOW_SAVER, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2")
    assert code == 1, output
    assert "saving\n" in output and "saved\n" not in output, output


def test_a_shutdown_timeout_that_is_not_whole_seconds_is_one_line_and_64(tmp_path):
    result = subprocess.run([sys.executable, str(TORCHRUN), "--standalone", "--nproc_per_node=1", "worker.py"],
                            cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2m"})
    assert result.returncode == 64, result.stderr
    assert result.stderr == ("torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be whole seconds (e.g. 120), not '2m': "
                             "fix the pod's env\n")


def test_a_lost_rendezvous_store_leaves_the_workers_time_to_report_the_lost_peer_then_fails_as_before():
    # node 0's pod died with the store: the survivors' workers exit 138 at their next collective,
    # unless torchrun's own check for new nodes fails first (75, counted by the Job)
    sys.path.insert(0, str(ROOT / "job"))
    import torchrun
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    class Handler:
        store_gone = False

        def num_nodes_waiting(self):
            if self.store_gone:
                raise RendezvousConnectionError("The connection to the C10d store has failed.")
            return 2

    assert torchrun.tolerate_a_lost_store(Handler, grace_s=0.5)
    handler = Handler()
    assert handler.num_nodes_waiting() == 2, "a live store answers as it did"
    handler.store_gone = True
    assert handler.num_nodes_waiting() == 0 and handler.num_nodes_waiting() == 0, "within the grace"
    time.sleep(0.6)
    with pytest.raises(RendezvousConnectionError):
        handler.num_nodes_waiting()


class Failure:
    """What torchrun.record_the_exit_code reads of a ChildFailedError."""

    def __init__(self, exitcode: int):
        self.exitcode = exitcode

    def get_first_failure(self):
        return 0, self


# A worker's exit 2 with no error file of its own is recorded (through torchrun and the pod:
# tests/test_bad_input.py, "TRAIN_ARGS that a trainer's argparse refuses"); a worker's own error
# file and a worker ended by a signal stay as they were.
@pytest.mark.parametrize("exitcode,exists,expected", [(-9, False, None), (64, True, 1), (2, False, 2)])
def test_torchrun_records_the_exit_code_of_a_worker_that_left_no_error_file(tmp_path, exitcode, exists, expected):
    sys.path.insert(0, str(ROOT / "job"))
    import torchrun
    import trainer_error
    path = tmp_path / "error.json"
    if exists:  # the worker's own (train.py records its code; torchrun copies it here)
        path.write_text(json.dumps({"message": {"message": "ConfigError: bad", "errorCode": 1}}))
    assert torchrun.record_the_exit_code(Failure(exitcode), str(path)) == (expected == exitcode)
    assert trainer_error.read(str(path))[0] == expected
    assert not torchrun.record_the_exit_code(Failure(3), None), "no TORCHELASTIC_ERROR_FILE: nothing to write"
