"""job/torchrun.py: torchrun as `python -m torch.distributed.run` runs it; a graceful stop (SIGTERM
to torchrun, as the pod forwards it) is one line in the pod's log instead of a 30-line traceback,
and everything else stays torchrun's: its exit code (1), its error file, its workers' stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ROOT / "job" / "torchrun.py"

WORKER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("worker stopped", flush=True), sys.exit(143)))
print("worker up", flush=True)
time.sleep(120)
"""


def test_a_sigterm_to_torchrun_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    error_file = tmp_path / "error.json"
    torchrun = subprocess.Popen([sys.executable, str(TORCHRUN), "--standalone", "--nproc_per_node=1", "worker.py"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    lines = []
    for line in torchrun.stdout:
        lines.append(line)
        if line.strip() == "worker up":
            torchrun.send_signal(signal.SIGTERM)
    code = torchrun.wait(timeout=60)
    output = "".join(lines)
    assert code == 1, output
    assert "Traceback" not in output and "SignalException" not in output, output
    assert "torchrun: stopped by SIGTERM; its workers were told to stop\n" in lines, output
    assert "worker stopped\n" in lines, output
    recorded = json.loads(error_file.read_text())["message"]["message"]
    assert recorded.startswith("SignalException: Process") and recorded.endswith("got signal: 15"), recorded

