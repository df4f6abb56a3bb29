"""A group of pods: node 0 says which checkpoint everyone resumes from (job/group.py), and a
collective that fails because a peer went away is told apart from the trainer's own fault
(code/config.py). No root, no S3: node 0's answer over a real local HTTP server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import checkpoint
import config
import group

RUN = "s3://bucket/runs/a/"
JOB = Path(__file__).resolve().parents[2] / "job"
SECRET = "a-group-secret-of-this-run-0123456789"
NNODES = 3


@pytest.mark.parametrize("state,problem", [
    ({"run": RUN, "state": "restored", "step": "step-00000020"}, None),
    ({"run": RUN, "state": "restored", "step": None}, None),
    ({"run": RUN, "state": "waiting", "step": None}, None),
    ({"run": RUN, "state": "complete", "step": None}, None),
    ({"run": "s3://bucket/runs/b/", "state": "restored", "step": None}, "node 0 serves run"),
    ({"run": RUN, "state": "restored", "step": "../../train.py"}, "named no checkpoint folder"),
    ({"run": RUN, "state": "restored", "step": "best"}, "named no checkpoint folder"),
    ({"run": RUN, "state": "restored", "step": 20}, "named no checkpoint folder"),
    ({"run": RUN, "state": "done"}, "not a group state"),
    (["restored"], "not a group state"),
    ("restored", "not a group state"),
])
def test_what_node_0_says_is_checked_before_it_is_used(state, problem):
    found = group.state_problem(state, RUN)
    assert (found is None) if problem is None else (problem in found)
    # Another run is the one problem no retry fixes: `wait` exits 64 on its type, not its text.
    assert isinstance(found, group.OtherRun) == (problem == "node 0 serves run")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_env(secret: str | None = SECRET, **more: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GROUP_SECRET", "CHECKPOINT_HMAC_KEY")}
    return {**env, **({"GROUP_SECRET": secret} if secret else {}), **more}


def start_node0(tmp_path: Path, secret: str = SECRET) -> tuple[str, Path, subprocess.Popen]:
    port, state = free_port(), tmp_path / "group.json"
    group.say(state, RUN, "waiting")
    server = subprocess.Popen([sys.executable, str(JOB / "group.py"), "serve", str(port), str(state), RUN,
                               str(NNODES)], env=group_env(secret), stderr=subprocess.PIPE, text=True)
    endpoint = f"127.0.0.1:{port}"
    for _ in range(100):  # listening
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    return endpoint, state, server


@pytest.fixture
def node0(tmp_path):
    """Node 0's server, as script.sh starts it: `group.py serve PORT STATE_FILE RUN NNODES`."""
    endpoint, state, server = start_node0(tmp_path)
    yield endpoint, state
    server.kill()
    server.wait()


def wait_in_background(endpoint: str, seconds: float, run: str = RUN, node: str = "1", pod: str = "p1",
                       secret: str = SECRET) -> dict:
    result = {}

    def ask():
        done = subprocess.run([sys.executable, str(JOB / "group.py"), "wait", endpoint, run, str(seconds), node, pod],
                              capture_output=True, text=True, env=group_env(secret))
        result.update(code=done.returncode, out=done.stdout, err=done.stderr)

    thread = threading.Thread(target=ask)
    thread.start()
    result["thread"] = thread
    return result


def test_a_node_waits_while_node_0_waits_for_the_lease_then_takes_its_step(node0, tmp_path):
    endpoint, state = node0
    asking = wait_in_background(endpoint, seconds=2)
    time.sleep(3.5)  # longer than the node's limit: "waiting" is an answer, node 0 is alive
    assert asking["thread"].is_alive()
    out = tmp_path / "out"
    committed = out / "checkpoints" / "step-00000020"
    with checkpoint.stage(committed) as staged:  # the protocol's own commit: manifest last
        with staged.open("model.pt") as handle:
            handle.write(b"weights")
        staged.commit(meta={})
    step = subprocess.run([sys.executable, str(JOB / "group.py"), "say", str(state), RUN, "restored", str(out)],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert step == "step-00000020"
    asking["thread"].join(20)
    assert asking["code"] == 0 and asking["out"].strip() == "step-00000020"


def test_node_0_starting_from_step_0_is_an_empty_answer(node0, tmp_path):
    endpoint, state = node0
    group.say(state, RUN, "restored", None)
    asking = wait_in_background(endpoint, seconds=10)
    asking["thread"].join(20)
    assert asking["code"] == 0 and asking["out"] == "\n"


def test_node_0_that_found_the_run_complete_ends_the_others_with_3(node0):
    endpoint, state = node0
    group.say(state, RUN, "complete")
    asking = wait_in_background(endpoint, seconds=10)
    asking["thread"].join(20)
    assert asking["code"] == 3


def test_node_0_of_another_run_is_bad_input(node0):
    endpoint, _ = node0
    asking = wait_in_background(endpoint, seconds=10, run="s3://bucket/runs/other/")
    asking["thread"].join(20)
    assert asking["code"] == 64
    assert "serves run" in asking["err"] and "same settings" in asking["err"]


def test_no_node_0_at_all_is_75_after_the_limit():
    asking = wait_in_background(f"127.0.0.1:{free_port()}", seconds=2)
    asking["thread"].join(20)
    assert asking["code"] == 75
    assert "did not say which checkpoint" in asking["err"] and "RDZV_TIMEOUT_SECONDS" in asking["err"]


def test_the_newest_committed_step_is_named_not_a_torn_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step, whole in ((10, True), (20, True), (30, False)):
        folder = root / checkpoint.step_dir_name(step)
        with checkpoint.stage(folder) as staged:
            with staged.open("model.pt") as handle:
                handle.write(b"w" * step)
            if whole:
                staged.commit(meta={})
    (root / "step-00000020" / "model.pt").write_bytes(b"short")  # damaged after its commit
    assert group.newest_committed(tmp_path) == "step-00000010"


GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55455: "
              "Connection reset by peer. This is typically caused by a remote worker hanging")


class DistBackendError(RuntimeError):
    """Named as torch.distributed's: the rule reads the class name, not torch."""


@pytest.mark.parametrize("err,trained,code", [
    (RuntimeError(GLOO_RESET), True, 138),  # seen: the peer's pod SIGKILLed mid-step
    (RuntimeError(GLOO_RESET), False, 138),  # the peer was there and died before the first step
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv"), False, 75),
    (RuntimeError("[gloo/transport/tcp/pair.cc:311] Connection refused [10.0.0.2]:4000"), False, None),
    (RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [10.0.0.2]:1"), True, 138),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv"), True, 138),
    (DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, remote process exited"), True, 138),
    (RuntimeError("CUDA out of memory"), True, None),  # the trainer's own: its traceback, its code
    (RuntimeError("Connection reset by peer"), True, None),  # not a collective's (an HTTP client, say)
    (ValueError("gloo Connection reset by peer"), True, None),
    (KeyError("step"), True, None),
])
def test_a_lost_peer_is_told_apart_from_the_trainers_own_fault(err, trained, code):
    assert config.group_failure_code(err, trained) == code


def test_record_exit_writes_torchrun_s_error_file_without_a_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    config.record_exit(143, "stopped after SIGTERM")
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == "stopped after SIGTERM"
    assert capsys.readouterr() == ("", "")


def finish_in_background(endpoint: str, seconds: float) -> dict:
    result = {}

    def ask():
        done = subprocess.run([sys.executable, str(JOB / "group.py"), "finish", endpoint, RUN, str(seconds), "1", "p1"],
                              capture_output=True, text=True, env=group_env())
        result.update(code=done.returncode, err=done.stderr)

    result["thread"] = threading.Thread(target=ask)
    result["thread"].start()
    return result


def test_a_trained_node_stays_while_node_0_uploads_and_ends_when_it_wrote_complete(node0):
    endpoint, state = node0
    group.say(state, RUN, "restored", "step-00000020")
    finishing = finish_in_background(endpoint, seconds=2)
    time.sleep(3.5)  # past the limit: "restored" is node 0 alive in its final upload
    assert finishing["thread"].is_alive()
    group.say(state, RUN, "complete")
    finishing["thread"].join(20)
    assert finishing["code"] == 0


def test_node_0_that_started_again_means_it_died_in_its_final_upload_138(node0):
    endpoint, state = node0  # "waiting": what a replacement of node 0 says first
    finishing = finish_in_background(endpoint, seconds=10)
    finishing["thread"].join(20)
    assert finishing["code"] == 138 and "died in its final upload" in finishing["err"]


def test_node_0_gone_before_complete_is_138():
    finishing = finish_in_background(f"127.0.0.1:{free_port()}", seconds=2)
    finishing["thread"].join(20)
    assert finishing["code"] == 138 and "went away before it wrote COMPLETE" in finishing["err"]


def test_node_0_gives_its_choice_to_one_pod_per_rank_and_tells_a_replacement_to_wait(node0):
    # The replacement of a node whose group is gone must not take the old node 0's choice: that
    # node 0 may still upload a newer step before it dies, and the next node 0 would choose that one.
    endpoint, state = node0
    group.say(state, RUN, "restored", "step-00000020")
    first = wait_in_background(endpoint, seconds=10, node="1", pod="first-pod")
    first["thread"].join(20)
    assert first["code"] == 0 and first["out"].strip() == "step-00000020"
    again = wait_in_background(endpoint, seconds=10, node="1", pod="first-pod")  # the same pod asking again
    again["thread"].join(20)
    assert again["code"] == 0 and again["out"].strip() == "step-00000020"
    other_rank = wait_in_background(endpoint, seconds=10, node="2", pod="rank-2-pod")
    other_rank["thread"].join(20)
    assert other_rank["code"] == 0
    assert not group.broken_marker(state).exists()
    replacement = subprocess.Popen([sys.executable, str(JOB / "group.py"), "wait", endpoint, RUN, "2", "1",
                                    "second-pod"], stdout=subprocess.PIPE, text=True, env=group_env())
    time.sleep(3.5)  # longer than its limit: "waiting" keeps it asking, it takes no step
    assert replacement.poll() is None
    replacement.kill()
    assert replacement.communicate()[0] == ""
    assert group.broken_marker(state).read_text() == "1", "node 0 learns that its group is gone"


@pytest.mark.parametrize("state,given,node,pod,expected", [
    ({"state": "restored", "step": "step-00000005"}, {}, "1", "a", "restored"),
    ({"state": "restored", "step": "step-00000005"}, {"1": "a"}, "1", "a", "restored"),
    ({"state": "restored", "step": "step-00000005"}, {"1": "a"}, "1", "b", "waiting"),
    ({"state": "restored", "step": "step-00000005"}, {"1": "a"}, "2", "b", "restored"),
    ({"state": "waiting", "step": None}, {}, "1", "a", "waiting"),
    ({"state": "complete", "step": None}, {"1": "a"}, "1", "b", "complete"),  # the run is done for anyone
])
def test_answers_table(state, given, node, pod, expected):
    answers = group.Answers()
    answers.given.update(given)
    answer = answers.answer({"run": RUN, **state}, node, pod)
    assert answer["state"] == expected
    assert answer["step"] == (state["step"] if expected == "restored" else None)


def impostor(body: bytes, sign_with: bytes | None = None):
    """Something that answers on node 0's port with `body` (signed with `sign_with`, if given,
    over the asker's nonce, as node 0 signs)."""
    import http.server
    import urllib.parse

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            if sign_with:
                nonce = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["nonce"][0]
                self.send_header(group.AUTH_HEADER, group.answer_mac(sign_with, nonce, body))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("body", [b"[" * 4000, b"not json", b'{"run": 1}' * 1000, b"\xff\xfe"])
def test_an_answer_that_is_no_state_counts_as_no_answer(tmp_path, body):
    # Whatever answers on node 0's port is read like anything from the network, signed or not.
    server = impostor(body, sign_with=SECRET.encode())
    try:
        state, problem = group.Asker(f"127.0.0.1:{server.server_address[1]}", SECRET.encode(), "1", "p1").ask()
        assert (state is None and problem) or group.state_problem(state, RUN)
    finally:
        server.shutdown()


# -- the door: only the group's pods may ask, only node 0 may answer ---------------------------------

def raw_get(endpoint: str, query: str, headers: dict | None = None) -> int:
    """An attacker's request: the HTTP status node 0 answers with."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{endpoint}/?{query}", headers=headers or {}),
                                    timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code


def test_a_request_without_the_groups_secret_changes_nothing(node0):
    # Seen before: any pod sending node=1&pod=x stopped the group (exit 138), over and over.
    endpoint, state = node0
    group.say(state, RUN, "restored", "step-00000020")
    first = wait_in_background(endpoint, seconds=10, node="1", pod="first-pod")
    first["thread"].join(20)
    assert first["code"] == 0 and first["out"].strip() == "step-00000020"
    forged_mac = group.request_mac(b"not the group's secret!", "", "1", "evil", "0" * 32)
    for query, headers in [("node=1&pod=evil", {}), (f"node=1&pod=evil&nonce={'0' * 32}", {group.AUTH_HEADER: forged_mac}),
                           ("node=1&pod=evil&nonce=" + "0" * 32, {group.AUTH_HEADER: "0" * 64})]:
        assert raw_get(endpoint, query, headers) == 401
    assert not group.broken_marker(state).exists(), "an unauthenticated request broke the group"
    again = wait_in_background(endpoint, seconds=10, node="1", pod="first-pod")
    again["thread"].join(20)
    assert again["code"] == 0 and again["out"].strip() == "step-00000020"


def test_a_pod_with_another_secret_is_refused_and_says_so_after_the_limit(node0):
    endpoint, state = node0
    group.say(state, RUN, "restored", "step-00000020")
    asking = wait_in_background(endpoint, seconds=2, secret="another-secret-of-16-bytes-or-more")
    asking["thread"].join(20)
    assert asking["code"] == 75 and "do not hold the same GROUP_SECRET" in asking["err"], asking
    assert not group.broken_marker(state).exists()


def test_an_answer_not_signed_by_node_0_is_not_believed():
    # An impostor saying "complete" would otherwise end node k with exit 0 (its index done for good).
    server = impostor(json.dumps({"run": RUN, "state": "complete", "step": None}).encode())
    try:
        asking = wait_in_background(f"127.0.0.1:{server.server_address[1]}", seconds=2)
        asking["thread"].join(20)
    finally:
        server.shutdown()
    assert asking["code"] == 75 and "not signed with the group's secret" in asking["err"], asking


def test_a_group_without_a_secret_is_refused_with_64(tmp_path):
    for argv in (["wait", "127.0.0.1:9", RUN, "2", "1", "p1"], ["serve", "0", str(tmp_path / "s"), RUN, "2"]):
        done = subprocess.run([sys.executable, str(JOB / "group.py"), *argv], capture_output=True, text=True,
                              env=group_env(None), timeout=20)
        assert done.returncode == 64 and "needs GROUP_SECRET" in done.stderr and len(done.stderr.splitlines()) == 1


def test_without_group_secret_the_key_comes_from_the_signing_key_and_differs_per_run():
    signing = {"CHECKPOINT_HMAC_KEY": "k" * 32}
    assert group.group_key(RUN, {}) is None
    assert group.group_key(RUN, {"GROUP_SECRET": SECRET}) == SECRET.encode()
    assert group.group_key(RUN, signing) == group.group_key(RUN, dict(signing))
    assert group.group_key(RUN, signing) not in (group.group_key("s3://bucket/runs/b/", signing), b"k" * 32)


def signed_query(door: group.Door, node: str, pod: str, nonce: str = "ab" * 16, key: bytes = SECRET.encode()):
    return f"node={node}&pod={pod}&nonce={nonce}", group.request_mac(key, door.nonce, node, pod, nonce)


@pytest.mark.parametrize("node,pod,admitted", [
    ("1", "p1", True), ("2", "a-B-9", True), ("2", "p" * 64, True),
    ("0", "p1", False),  # node 0 does not ask itself
    ("3", "p1", False), ("99999999999", "p1", False), ("01", "p1", False), ("-1", "p1", False), ("", "p1", False),
    ("1", "", False), ("1", "p" * 65, False), ("1", "p/1", False), ("1", "p\n1", False), ("1", "p%0A", False),
])
def test_the_door_admits_signed_requests_for_a_node_of_the_group_with_a_bounded_pod_token(node, pod, admitted):
    door = group.Door(SECRET.encode(), NNODES)
    query, mac = signed_query(door, node, pod)
    assert (door.admit(query, mac) is not None) == admitted


@pytest.mark.parametrize("change", ["no mac", "other key", "other server", "extra field", "twice", "bad nonce"])
def test_the_door_refuses_a_request_that_is_not_exactly_what_was_signed(change):
    door = group.Door(SECRET.encode(), NNODES)
    query, mac = signed_query(door, "1", "p1")
    if change == "no mac":
        mac = None
    elif change == "other key":
        query, mac = signed_query(door, "1", "p1", key=b"another key, 16 bytes or more")
    elif change == "other server":  # recorded for an earlier node 0: its nonce was another
        query, mac = signed_query(group.Door(SECRET.encode(), NNODES), "1", "p1")
    elif change == "extra field":
        query += "&step=step-99999999"
    elif change == "twice":
        query += "&node=2"
    elif change == "bad nonce":
        query, mac = signed_query(door, "1", "p1", nonce="x" * 32)
    assert door.admit(query, mac) is None


def test_what_node_0_remembers_stays_bounded_whatever_is_asked(tmp_path):
    # Seen before: 2,000 requests with distinct node= values grew node 0 from 23 to 176 MB.
    state = tmp_path / "group.json"
    group.say(state, RUN, "restored", "step-00000020")
    server = group.make_server(0, state, SECRET.encode(), NNODES, host="127.0.0.1")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    try:
        for number in range(300):
            raw_get(endpoint, f"node={number}{'x' * 2000}&pod=p")
            asker = group.Asker(endpoint, SECRET.encode(), str(number), f"pod-{number}")
            asker.ask()
        assert set(server.answers.given) <= {"1", "2"}, "only nodes 1..NNODES-1 are remembered"
    finally:
        server.shutdown()
        server.server_close()


def test_something_on_node_0s_port_that_does_not_speak_http_is_no_answer():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def babble():
            connection, _ = listener.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

        threading.Thread(target=babble, daemon=True).start()
        state, problem = group.Asker(f"127.0.0.1:{listener.getsockname()[1]}", SECRET.encode(), "1", "p1").ask()
    assert state is None and problem.startswith("no answer ("), problem
