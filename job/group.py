"""A group of N pods resumes from one checkpoint: the one node 0 chose.

    python3 group.py serve PORT STATE_FILE            # node 0, in the background: answers GET /
    python3 group.py say STATE_FILE RUN STATE [OUTPUT_DIR]   # node 0: waiting | restored | complete
    python3 group.py wait HOST:PORT RUN SECONDS NODE POD   # node k > 0: prints the step to restore
    python3 group.py finish HOST:PORT RUN SECONDS     # node k > 0, trained: until node 0 wrote COMPLETE

Node 0 alone holds the run's lease, so only it knows when nothing else writes the run any more
and which committed step is the newest then. The others must take that step and no other: one a
step newer (a dying pod's final upload landing meanwhile) or older would leave the processes of
one group loading different weights. So node 0 says its choice, and a node k asks node 0 for it
directly, over HTTP on the rendezvous port + 1: the answer comes from the pod that holds the lease
now, never from an object an earlier group left in S3.

State (node 0's STATE_FILE): {"run": S3_OUTPUT_URI, "state": "waiting" (for the lease), "restored"
(with "step": the checkpoint folder's name, null for step 0) or "complete"}.

One group, one answer: node 0 gives its choice to one pod per node rank (NODE, and POD: a token
each pod draws at its start). A second pod of that rank is a replacement: its group is gone, this
node 0 only has yet to notice (its collective fails within seconds) and may still be uploading a
newer step. Told "waiting", the new pod asks again until the next node 0 answers. And this node 0
learns from it that its group is gone: the server touches STATE_FILE.broken, and script.sh stops
the trainer (exit 138), which would otherwise wait out the rendezvous's timeout for a pod that died
between its answer and its torchrun.

`wait` exit codes: 0 (the step's name printed, an empty line for step 0), 3 (node 0 found the run
COMPLETE), 64 (node 0 serves another run: the pods' settings differ), 75 (node 0 did not answer
for SECONDS; a node 0 that answers "waiting" is alive and waits for the lease, so that counts as
an answer). What node 0 says is checked like anything from the network: a step name must be one.

`finish`: a node whose trainer ended well must not end before node 0 has put the last step in S3
and written COMPLETE. Were it to exit 0 first and node 0 then die in its final upload, the Job
would replace node 0 alone (that index has not succeeded), and a group of one could never meet
again. Exit 0 once node 0 says "complete"; 138 (the group restarts) when node 0 is unreachable for
SECONDS or answers as a new pod would ("waiting"): it died meanwhile.

Standard library only: the image's python3 runs it.
"""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
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


class Answers:
    """Which pod of each node rank was given node 0's choice (a pod asks every second)."""

    def __init__(self, on_replacement=lambda node: None):
        self.given: dict[str, str] = {}
        self.lock = threading.Lock()
        self.on_replacement = on_replacement

    def answer(self, state: dict, node: str, pod: str) -> dict:
        if state.get("state") != "restored":
            return state
        with self.lock:
            if self.given.setdefault(node, pod) == pod:
                return state
        self.on_replacement(node)
        return {**state, "state": "waiting", "step": None}  # a replacement: for the next node 0


def broken_marker(path: Path) -> Path:
    return path.with_name(path.name + ".broken")


def serve(port: int, path: Path) -> None:
    answers = Answers(on_replacement=lambda node: broken_marker(path).write_text(node))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            try:
                state = json.loads(path.read_bytes())
            except (OSError, ValueError):
                state = {}
            state = answers.answer(state, query.get("node", [""])[0], query.get("pod", [""])[0])
            body = json.dumps(state).encode()
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
    except (OSError, ValueError, RecursionError, urllib.error.URLError):  # RecursionError: "[[[[..." nesting
        return None


def wait(endpoint: str, run: str, seconds: float, node: str = "", pod: str = "") -> int:
    url = f"http://{endpoint}/?" + urllib.parse.urlencode({"node": node, "pod": pod})
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


def finish(endpoint: str, run: str, seconds: float) -> int:
    url = f"http://{endpoint}/"
    deadline = time.monotonic() + seconds
    while True:
        state = ask(url)
        if state is not None and state_problem(state, run) is None:
            if state["state"] == "complete":
                return 0
            if state["state"] == "waiting":
                print("node 0 started again: it died in its final upload; the group restarts", file=sys.stderr)
                return contract.EXIT_PEER_LOST
            deadline = time.monotonic() + seconds  # "restored": node 0 is alive, still uploading
        if time.monotonic() >= deadline:
            print(f"node 0 ({endpoint}) went away before it wrote COMPLETE (no answer for {seconds:.0f}s); "
                  f"the group restarts", file=sys.stderr)
            return contract.EXIT_PEER_LOST
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
    if argv[:1] == ["wait"] and len(argv) == 6:
        return wait(argv[1], argv[2], float(argv[3]), argv[4], argv[5])
    if argv[:1] == ["finish"] and len(argv) == 4:
        return finish(argv[1], argv[2], float(argv[3]))
    print(f"usage:\n{usage}", file=sys.stderr)
    return contract.EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
