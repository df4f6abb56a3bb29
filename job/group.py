"""A group of N pods resumes from one checkpoint: the one node 0 chose.

    python3 group.py serve PORT STATE_FILE            # node 0, in the background: answers GET /
    python3 group.py say STATE_FILE RUN STATE [OUTPUT_DIR]   # node 0: waiting | restored | complete
    python3 group.py wait HOST:PORT RUN SECONDS       # node k > 0: prints the step to restore

Node 0 alone holds the run's lease, so only it knows when nothing else writes the run any more
and which committed step is the newest then. The others must take that step and no other: one a
step newer (a dying pod's final upload landing meanwhile) or older would leave the processes of
one group loading different weights. So node 0 says its choice, and a node k asks node 0 for it
directly, over HTTP on the rendezvous port + 1: the answer comes from the pod that holds the lease
now, never from an object an earlier group left in S3.

State (node 0's STATE_FILE, served as it is): {"run": S3_OUTPUT_URI, "state": "waiting" (for the
lease), "restored" (with "step": the checkpoint folder's name, null for step 0) or "complete"}.

`wait` exit codes: 0 (the step's name printed, an empty line for step 0), 3 (node 0 found the run
COMPLETE), 64 (node 0 serves another run: the pods' settings differ), 75 (node 0 did not answer
for SECONDS; a node 0 that answers "waiting" is alive and waits for the lease, so that counts as
an answer). What node 0 says is checked like anything from the network: a step name must be one.

Standard library only: the image's python3 runs it.
"""

from __future__ import annotations

import http.server
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import checkpoint
import contract

STATES = ("waiting", "restored", "complete")
POLL_SECONDS = 1.0
MAX_ANSWER = 4096


def state_problem(state, run: str) -> str | None:
    """None when node 0's answer can be acted on, else why not (a different run is bad input)."""
    if not isinstance(state, dict) or state.get("state") not in STATES:
        return "not a group state"
    if state.get("run") != run:
        return f"node 0 serves run {str(state.get('run'))[:200]!r}, this pod's S3_OUTPUT_URI is {run!r}"
    step = state.get("step")
    if state["state"] == "restored" and step is not None and (
            not checkpoint.is_file_name(step) or checkpoint.parse_step(step) is None):
        return f"node 0 named no checkpoint folder: {str(step)[:80]!r}"
    return None


def say(path: Path, run: str, state: str, step: str | None = None) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps({"run": run, "state": state, "step": step}))
    os.replace(temp, path)  # a reader sees the old state or the new one, never half


def newest_committed(output_dir: Path) -> str | None:
    """The step the trainer will resume from: the newest committed one here, sizes checked (the
    trainer hashes it; one that fails there fails the group's agreement, not silently)."""
    for _, folder in checkpoint.committed_steps(output_dir / contract.CHECKPOINTS_DIR):
        if checkpoint.verify(folder, full=False) is None:
            return folder.name
    return None


def serve(port: int, path: Path) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            try:
                body = path.read_bytes()
            except OSError:
                body = b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per poll of every node would drown the pod's log
            pass

    http.server.ThreadingHTTPServer(("", port), Handler).serve_forever()


def ask(url: str):
    """Node 0's state, or None while it cannot be reached (not scheduled yet, no DNS record yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return json.loads(answer.read(MAX_ANSWER))
    except (OSError, ValueError, urllib.error.URLError):
        return None


def wait(endpoint: str, run: str, seconds: float) -> int:
    url = f"http://{endpoint}/"
    deadline = time.monotonic() + seconds
    while True:
        state = ask(url)
        problem = state_problem(state, run) if state is not None else "no answer"
        if problem is None:
            if state["state"] == "restored":
                print(state.get("step") or "")
                return 0
            if state["state"] == "complete":
                return contract.EXIT_COMPLETE_FOUND
            deadline = time.monotonic() + seconds  # "waiting": node 0 is alive, waiting for the lease
        elif problem.startswith("node 0 serves run"):
            print(f"{problem}; give every pod of the group the same settings (scripts/submit.py does)",
                  file=sys.stderr)
            return contract.EXIT_BAD_INPUT
        if time.monotonic() >= deadline:
            print(f"node 0 ({endpoint}) did not say which checkpoint to resume from within {seconds:.0f}s "
                  f"(RDZV_TIMEOUT_SECONDS; last: {problem})", file=sys.stderr)
            return contract.EXIT_UNAVAILABLE
        time.sleep(POLL_SECONDS)


def main(argv: list[str]) -> int:
    usage = __doc__.split("\n\n")[1]
    if argv[:1] == ["serve"] and len(argv) == 3:
        serve(int(argv[1]), Path(argv[2]))
        return 0
    if argv[:1] == ["say"] and len(argv) in (4, 5) and argv[3] in STATES:
        step = newest_committed(Path(argv[4])) if argv[3] == "restored" else None
        say(Path(argv[1]), argv[2], argv[3], step)
        print(step or "")
        return 0
    if argv[:1] == ["wait"] and len(argv) == 4:
        return wait(argv[1], argv[2], float(argv[3]))
    print(f"usage:\n{usage}", file=sys.stderr)
    return contract.EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
