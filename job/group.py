"""A group of N pods resumes from one checkpoint: the one node 0 chose.

    python3 group.py serve PORT STATE_FILE RUN NNODES      # node 0, in the background: answers GET /
    python3 group.py say STATE_FILE RUN STATE [OUTPUT_DIR]  # node 0: waiting | restored | complete
    python3 group.py wait HOST:PORT RUN SECONDS NODE POD    # node k > 0: prints the step to restore
    python3 group.py finish HOST:PORT RUN SECONDS NODE POD  # node k > 0, trained: until node 0 wrote COMPLETE

Node 0 alone holds the run's lease, so only it knows when nothing else writes the run any more
and which committed step is the newest then; every node must load that step and no other. So a
node k asks node 0 directly, over HTTP on the rendezvous port + 1, never an object an earlier
group left in S3. Questions and answers are signed with GROUP_SECRET (HMAC-SHA256 over both sides'
nonces); anything else gets 401 and changes nothing. One answer per node rank: a second pod of a
rank is a replacement, which tells node 0 its group is gone (STATE_FILE.broken: script.sh exits 138).

`wait` exits 0 (the step's name printed, an empty line for step 0), 3 (COMPLETE), 64 (node 0 serves
another run, or no secret), 75 (no answer for SECONDS); `finish` exits 0 once node 0 says
"complete", 138 when it goes silent. docs/multi-node.md has the whole protocol and why.

Standard library only: the image's python3 runs it.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import http.server
import json
import os
import re
import secrets
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
SECRET_ENV = "GROUP_SECRET"
AUTH_HEADER = "X-Group-Auth"    # a request's HMAC, and node 0's over its answer
NONCE_HEADER = "X-Group-Nonce"  # node 0's, on every refusal: what a request's HMAC covers
NODE = re.compile(r"[1-9][0-9]{0,8}")
POD_TOKEN = re.compile(r"[A-Za-z0-9-]{1,64}")
NONCE = re.compile(r"[0-9a-f]{32}")
DIGEST = re.compile(r"[0-9a-f]{64}")
REFUSALS_LOG_SECONDS = 60.0  # at most one line a minute about refused requests: a flood is not a log


def group_key(run: str, environ=None) -> bytes | None:
    """GROUP_SECRET, else a key derived from CHECKPOINT_HMAC_KEY for this run, else None."""
    environ = os.environ if environ is None else environ
    if environ.get(SECRET_ENV):
        return environ[SECRET_ENV].encode()
    signing = environ.get(checkpoint.HMAC_KEY_ENV, "")
    if signing:
        return hmac.new(signing.encode(), b"group-key\n" + run.encode(), hashlib.sha256).digest()
    return None


def request_mac(key: bytes, server_nonce: str, node: str, pod: str, client_nonce: str) -> str:
    message = "\n".join(("group-request", server_nonce, node, pod, client_nonce)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def answer_mac(key: bytes, client_nonce: str, body: bytes) -> str:
    return hmac.new(key, b"group-answer\n" + client_nonce.encode() + b"\n" + body, hashlib.sha256).hexdigest()


class OtherRun(str):
    """Why node 0's answer cannot be used, when no retry will help: it serves another run (the pods'
    settings differ). A type, so the caller decides by it, not by the text."""


def state_problem(state, run: str) -> str | None:
    """None when node 0's answer can be acted on, else why not (a different run is bad input)."""
    if not isinstance(state, dict) or state.get("state") not in STATES:
        return "not a group state"
    if state.get("run") != run:
        return OtherRun(f"node 0 serves run {str(state.get('run'))[:200]!a}, this pod's S3_OUTPUT_URI is {run!a}")
    step = state.get("step")
    if state["state"] == "restored" and step is not None and (
            not checkpoint.is_file_name(step) or checkpoint.parse_step(step) is None):
        return f"node 0 named no checkpoint folder: {str(step)[:80]!a}"
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
    """Which pod of each node rank was given node 0's choice (a pod asks every second). Only the
    Door's askers reach it, so it holds at most NNODES - 1 entries."""

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


class Door:
    """Who node 0 answers: a pod of this group (the request's HMAC), for a node 1..NNODES-1, with a
    bounded pod token. Its nonce is drawn per server: a request recorded for another node 0 fails."""

    def __init__(self, key: bytes, nnodes: int):
        self.key, self.nnodes = key, nnodes
        self.nonce = secrets.token_hex(16)

    def admit(self, query: str, mac: str | None) -> tuple[str, str, str] | None:
        """(node, pod, the asker's nonce) of a request that passes, else None."""
        try:
            fields = urllib.parse.parse_qs(query, strict_parsing=True, max_num_fields=3)
        except ValueError:
            return None
        if sorted(fields) != ["node", "nonce", "pod"] or any(len(v) != 1 for v in fields.values()):
            return None
        node, pod, nonce = fields["node"][0], fields["pod"][0], fields["nonce"][0]
        if not (NODE.fullmatch(node) and int(node) < self.nnodes and POD_TOKEN.fullmatch(pod)
                and NONCE.fullmatch(nonce) and isinstance(mac, str) and DIGEST.fullmatch(mac)):
            return None
        if not hmac.compare_digest(mac, request_mac(self.key, self.nonce, node, pod, nonce)):
            return None
        return node, pod, nonce


class Refusals:
    """Counts refused requests; says so on the pod's log at most once a minute."""

    def __init__(self):
        self.count, self.said, self.lock = 0, -REFUSALS_LOG_SECONDS, threading.Lock()

    def note(self, address: str) -> None:
        with self.lock:
            self.count += 1
            if time.monotonic() - self.said < REFUSALS_LOG_SECONDS:
                return
            count, self.count, self.said = self.count, 0, time.monotonic()
        print(f"group: refused {count} request(s) without the group's secret or for no node of the group, "
              f"the last from {address!a}", file=sys.stderr, flush=True)


def make_server(port: int, path: Path, key: bytes, nnodes: int, host: str = "") -> http.server.ThreadingHTTPServer:
    door, refusals = Door(key, nnodes), Refusals()
    answers = Answers(on_replacement=lambda node: broken_marker(path).write_text(node))

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 10  # a connection that sends nothing holds a thread no longer

        def do_GET(self):  # noqa: N802 - http.server's name
            asker = door.admit(urllib.parse.urlsplit(self.path).query, self.headers.get(AUTH_HEADER))
            if asker is None:
                refusals.note(self.client_address[0])
                self.reply(401, b"", {NONCE_HEADER: door.nonce})
                return
            node, pod, nonce = asker
            try:
                state = json.loads(path.read_bytes())
            except (OSError, ValueError):
                state = {}
            body = json.dumps(answers.answer(state, node, pod)).encode()
            self.reply(200, body, {"Content-Type": "application/json", AUTH_HEADER: answer_mac(key, nonce, body)})

        def reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per poll of every node would drown the pod's log
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.answers = answers
    return server


def broken_marker(path: Path) -> Path:
    return path.with_name(path.name + ".broken")


class Asker:
    """A node k's questions to node 0, signed; node 0's answers, checked."""

    def __init__(self, endpoint: str, key: bytes, node: str, pod: str):
        self.url, self.key, self.node, self.pod = f"http://{endpoint}/", key, node, pod
        self.server_nonce = ""  # learnt from node 0's first refusal, kept while it serves

    def ask(self) -> tuple[dict | None, str]:
        """(node 0's state, "") or (None, why not): not reachable yet (not scheduled, no DNS record),
        refused, or an answer that is not node 0's."""
        for _ in range(2):  # the second time with node 0's nonce, if the first had none or an old one
            nonce = secrets.token_hex(16)
            query = urllib.parse.urlencode({"node": self.node, "pod": self.pod, "nonce": nonce})
            mac = request_mac(self.key, self.server_nonce, self.node, self.pod, nonce)
            request = urllib.request.Request(self.url + "?" + query, headers={AUTH_HEADER: mac})
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    body = answer.read(MAX_ANSWER + 1)
                    signed = answer.headers.get(AUTH_HEADER) or ""
            except urllib.error.HTTPError as refused:
                offered = refused.headers.get(NONCE_HEADER) or ""
                if refused.code == 401 and NONCE.fullmatch(offered) and offered != self.server_nonce:
                    self.server_nonce = offered
                    continue
                return None, (f"node 0 refused this pod's requests (HTTP {refused.code}): the group's pods do not "
                              f"hold the same {SECRET_ENV} (scripts/submit.py makes one per run)")
            except (OSError, ValueError, http.client.HTTPException) as err:  # URLError, timeouts, resets, not HTTP
                return None, f"no answer ({type(err).__name__})"
            if len(body) > MAX_ANSWER or not hmac.compare_digest(signed, answer_mac(self.key, nonce, body)):
                return None, "an answer not signed with the group's secret"
            try:
                return json.loads(body), ""
            except (ValueError, RecursionError):  # RecursionError: "[[[[..." nesting
                return None, "an answer that is not JSON"
        return None, "node 0 changed its nonce twice in a row"


def wait(asker: Asker, run: str, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while True:
        state, problem = asker.ask()
        problem = state_problem(state, run) if state is not None else problem
        if problem is None:
            if state["state"] == "restored":
                print(state.get("step") or "")
                return 0
            if state["state"] == "complete":
                return contract.EXIT_COMPLETE_FOUND
            deadline = time.monotonic() + seconds  # "waiting": node 0 is alive, waiting for the lease
        elif isinstance(problem, OtherRun):
            print(f"{problem}; give every pod of the group the same settings (scripts/submit.py does)",
                  file=sys.stderr)
            return contract.EXIT_BAD_INPUT
        if time.monotonic() >= deadline:
            print(f"node 0 ({asker.url}) did not say which checkpoint to resume from within {seconds:.0f}s "
                  f"(RDZV_TIMEOUT_SECONDS; last: {problem})", file=sys.stderr)
            return contract.EXIT_UNAVAILABLE
        time.sleep(POLL_SECONDS)


def finish(asker: Asker, run: str, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while True:
        state, _ = asker.ask()
        if state is not None and state_problem(state, run) is None:
            if state["state"] == "complete":
                return 0
            if state["state"] == "waiting":
                print("node 0 started again: it died in its final upload; the group restarts", file=sys.stderr)
                return contract.EXIT_PEER_LOST
            deadline = time.monotonic() + seconds  # "restored": node 0 is alive, still uploading
        if time.monotonic() >= deadline:
            print(f"node 0 ({asker.url}) went away before it wrote COMPLETE (no answer for {seconds:.0f}s); "
                  f"the group restarts", file=sys.stderr)
            return contract.EXIT_PEER_LOST
        time.sleep(POLL_SECONDS)


def keyed(run: str) -> bytes:
    key = group_key(run)
    if key is None:
        print(f"a group needs {SECRET_ENV} (or {checkpoint.HMAC_KEY_ENV}) in every pod: node 0 answers only "
              f"the group's pods; render the group with scripts/submit.py, which makes the Secret", file=sys.stderr)
        raise SystemExit(contract.EXIT_BAD_INPUT)
    return key


def main(argv: list[str]) -> int:
    usage = __doc__.split("\n\n")[1]
    if argv[:1] == ["serve"] and len(argv) == 5 and argv[4].isdigit():
        make_server(int(argv[1]), Path(argv[2]), keyed(argv[3]), int(argv[4])).serve_forever()
        return 0
    if argv[:1] == ["say"] and len(argv) in (4, 5) and argv[3] in STATES:
        step = newest_committed(Path(argv[4])) if argv[3] == "restored" else None
        say(Path(argv[1]), argv[2], argv[3], step)
        print(step or "")
        return 0
    if argv[:1] in (["wait"], ["finish"]) and len(argv) == 6:
        asker = Asker(argv[1], keyed(argv[2]), argv[4], argv[5])
        return (wait if argv[0] == "wait" else finish)(asker, argv[2], float(argv[3]))
    print(f"usage:\n{usage}", file=sys.stderr)
    return contract.EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
