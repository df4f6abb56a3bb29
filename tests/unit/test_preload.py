"""job/preload.py: the worker imports torch, waits at the gate, then runs the trainer as Python
would have run it (as __main__, its argv, its folder first on sys.path, its exit code), so no
trainer can tell it was preloaded; and it runs nothing until the gate says "go"."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import contract

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ROOT / "job" / "preload.py"

TRAINER = """
import json, multiprocessing, os, sys
import helper  # next to this file: found only if this folder is first on sys.path

def square(x):
    return x * x

if __name__ == "__main__":
    # a spawned process re-imports this file as its __main__, as async_save's save process does
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        squares = pool.map(square, [3])
    import contract
    print("REPORT " + json.dumps({"argv": sys.argv, "file": __file__, "path0": sys.path[0],
                                  "helper": helper.NAME, "contract": getattr(contract, "MINE", None),
                                  "torch_loaded": "torch" in sys.modules, "squares": squares}), flush=True)
    sys.exit(int(os.environ.get("TRAINER_EXIT", "0")))
"""


def trainer_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "trainer.py").write_text(TRAINER)
    (folder / "helper.py").write_text("NAME = 'the trainer helper'\n")
    (folder / "contract.py").write_text("MINE = 'the trainer contract'\n")  # shadows the runtime's
    return folder


def start(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    gate = tmp_path / "gate"
    return subprocess.Popen([sys.executable, str(PRELOAD), str(gate), str(tmp_path / "code" / "trainer.py"), *args],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "job"), "RANK": "0", **(env or {})})


def test_runs_nothing_until_the_gate_says_go_then_the_trainer_as_python_would(tmp_path):
    trainer_folder(tmp_path)
    worker = start(tmp_path, "--config", "a b.yaml", "--set", "x=1")
    time.sleep(3)  # torch imported by now on most machines; the trainer must still not have run
    (tmp_path / "gate").write_text("not yet\n")
    time.sleep(0.5)
    assert worker.poll() is None
    (tmp_path / "gate").write_text("go\n")
    output, _ = worker.communicate(timeout=120)
    assert worker.returncode == 0, output
    events = [e for e in map(contract.parse_event, output.splitlines()) if e]
    assert [e["event"] for e in events] == ["preloaded"] and events[0]["seconds"] > 0
    assert output.index("EVENT ") < output.index("REPORT ")
    report = json.loads(output.split("REPORT ", 1)[1].splitlines()[0])
    trainer = str(tmp_path / "code" / "trainer.py")
    assert report["argv"] == [trainer, "--config", "a b.yaml", "--set", "x=1"]
    assert report["file"] == trainer and report["path0"] == str(tmp_path / "code")
    assert report["helper"] == "the trainer helper"
    assert report["contract"] == "the trainer contract"  # not the runtime's, left under its name
    assert report["torch_loaded"] and report["squares"] == [9]


def test_the_trainers_exit_code_is_the_workers_and_only_rank_0_says_preloaded(tmp_path):
    trainer_folder(tmp_path)
    (tmp_path / "gate").write_text("go\n")
    worker = start(tmp_path, env={"TRAINER_EXIT": "64", "RANK": "1"})
    output, _ = worker.communicate(timeout=120)
    assert worker.returncode == 64, output
    assert "EVENT " not in output and "REPORT " in output


def test_a_worker_stopped_at_the_gate_ends_without_running_the_trainer(tmp_path):
    trainer_folder(tmp_path)
    worker = start(tmp_path)
    time.sleep(1)
    worker.terminate()
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == -15 and "REPORT " not in output


def test_an_exception_the_trainer_lets_through_is_recorded_for_torchrun_and_still_printed(tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "trainer.py").write_text("def step():\n    raise ValueError('the loss is a string')\n\nstep()\n")
    (tmp_path / "gate").write_text("go\n")
    error_file = tmp_path / "error.json"
    worker = start(tmp_path, env={"TORCHELASTIC_ERROR_FILE": str(error_file)})
    output, _ = worker.communicate(timeout=120)
    assert worker.returncode == 1, output
    assert "Traceback" in output and output.rstrip().endswith("ValueError: the loss is a string")
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "ValueError: the loss is a string"
    assert "in step" in recorded["extraInfo"]["py_callstack"]
