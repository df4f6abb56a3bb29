"""Watching runs: scripts/status.py and scripts/tensorboard.sh on what the real job.yaml's pods
(through the local pod runner) leave in the local S3, with a real TensorBoard queried over HTTP.

Pods are few, so the module tells one story: a run trained to the end ("done"), then a long run
("live") watched while it trains (status.py says running; TensorBoard shows its points as they
come, and the lag is measured) and deleted, resumed by its next pod (TensorBoard follows it into
the new event file) and deleted again (interrupted). "crashed" and "stalled" are copies of the
live run whose real status.json is edited as dead pods leave it: failed (exit 1 after a lost
attempt) and stale (still "running", heartbeat an hour old). "misconfigured" is a real failure: its
trainer finds its data too short for its model once the pod holds the lease.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from podlab import BUCKET, ROOT, Run, free_ports, tool_env, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]

STATUS = ROOT / "scripts" / "status.py"
TENSORBOARD = ROOT / "scripts" / "tensorboard.sh"
RUNS = f"s3://{BUCKET}/runs/"
LIVE_MAX_STEPS = 100000
# Checkpoints and evals rarely: two cores serve the trainer, the uploader, the S3 and TensorBoard.
LIVE_ARGS = f"--set train.max_steps={LIVE_MAX_STEPS} --set checkpoint.interval=50 --set eval.interval=50"
MEASURE_SECONDS = 12
SETTLE_SECONDS = 5  # steps logged this close to the window's end may not be served within it
STEP_LINE = re.compile(r"train: step (\d+)/\d+ \| loss ([0-9.]+)")
HOUR = 3600


# -- the lab: a local S3 for the whole module ------------------------------------------------------

@dataclass
class Lab:
    s3: object
    endpoint: str
    folder: Path


@pytest.fixture(scope="module")
def lab(module_s3, s3_endpoint, tmp_path_factory):
    return Lab(module_s3, s3_endpoint, tmp_path_factory.mktemp("watch"))


@pytest.fixture(scope="module")
def done(lab):
    """A run one pod trained to the end; beside it, a run whose trainer rejects its data (it exits 64
    after the pod took the lease, so the uploader reports it failed, with the pod's last error line)."""
    run = Run(lab.s3, lab.endpoint, lab.folder / "done", name="done").stage()
    (lab.folder / "misconfigured").mkdir()
    misconfigured = Run(lab.s3, lab.endpoint, lab.folder / "misconfigured", name="misconfigured")
    failing = misconfigured.start(TRAIN_ARGS="--set model.block_size=10000000")
    code, pod = run.run()
    assert code == 0, pod.output
    assert failing.wait() == 64, failing.output
    return run


# -- the live run, watched while it trains ----------------------------------------------------------

@dataclass
class Watch:
    run: Run
    logged: dict[int, tuple[float, float]]  # step -> (when its log line came, loss), both pods
    served_at: dict[int, float]  # step -> when TensorBoard first served it, while the first pod trained
    first_served: set[int]  # what TensorBoard served on its first answer
    final_served: dict[int, float]  # step -> loss, once both pods had ended
    lags: list[float]
    exit_codes: list[int]
    status_json: list[dict]  # status.py while the first pod trained
    status_detail: str
    status_stale_now: list[dict]
    tensorboard_runs: list[str]
    resumed_from: int  # the step the second pod resumed from
    second_pod_steps: set[int]
    served_while_second_pod_trained: set[int]
    pod_output: str = field(repr=False)


class StepClock:
    """When each `step N/M | loss X` line of a pod's output came (polled every 20 ms)."""

    def __init__(self, pod):
        self.pod = pod
        self.logged: dict[int, tuple[float, float]] = {}
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._scan()
            self._stop.wait(0.02)

    def _scan(self) -> None:
        lines = self.pod.lines
        while self._seen < len(lines):
            match = STEP_LINE.search(lines[self._seen])
            if match:
                self.logged.setdefault(int(match[1]), (time.monotonic(), float(match[2])))
            self._seen += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._scan()


class TensorBoard:
    """scripts/tensorboard.sh as a process, and TensorBoard's HTTP API."""

    def __init__(self, uri: str, *args: str, env: dict | None = None):
        self.port = free_ports()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(TENSORBOARD), uri, "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env or tool_env())
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()

    def get(self, path: str):
        with urllib.request.urlopen(self.base + path, timeout=10) as answer:
            return json.load(answer)

    def runs(self) -> list[str]:
        return self.get("/data/runs")

    def scalars(self, run: str, tag: str) -> dict[int, float]:
        query = urllib.parse.urlencode({"run": run, "tag": tag})
        try:
            return {step: value for _, step, value in self.get(f"/data/plugin/scalars/scalars?{query}")}
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            return {}  # the run or tag is not loaded yet, or a slow answer on a loaded machine: ask again

    def wait_for_runs(self, *names: str, timeout: float = 60) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "".join(self.output)
            try:
                runs = self.runs()
                if set(names) <= set(runs):
                    return runs
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                pass  # not listening yet, or a slow answer on a loaded machine (as scalars): ask again
            time.sleep(0.25)
        raise AssertionError(f"TensorBoard shows no {names}; output:\n{''.join(self.output)}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # the script exec'd tensorboard: this is its PID
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def watched(lab, done):
    """The live run, with one TensorBoard throughout: its pod trains and is deleted, then the run's
    next pod resumes it (a new event file) and is deleted in turn."""
    (lab.folder / "live").mkdir()
    run = Run(lab.s3, lab.endpoint, lab.folder / "live", name="live")  # code and data: done's
    pods, clocks, board = [run.start(TRAIN_ARGS=LIVE_ARGS)], [], None
    try:
        pods[0].wait_for_event("step", step=5)
        clocks.append(StepClock(pods[0]))
        board = TensorBoard(run.output_uri, "--reload_interval", "1", "--samples_per_plugin", "scalars=100000")
        board.wait_for_runs("live/tensorboard")
        served_at, first_served = follow(board, "live/tensorboard", MEASURE_SECONDS)
        ready = min(served_at.values())
        window_end = ready + MEASURE_SECONDS
        logged = clocks[0].logged
        measured = [s for s, (at, _) in logged.items() if ready + 1 <= at <= window_end - SETTLE_SECONDS]
        lags = [served_at.get(s, window_end) - logged[s][0] for s in measured]
        pods[0].wait_for_event("uploaded", step=50)  # for committed_step >= 50
        status_json = status_of(RUNS, "--json")
        status_detail = status_of(run.output_uri)
        stale_now = status_of(RUNS, "--json", "--stale-after", "0")
        exit_codes = [stop(pods[0], clocks[0])]

        pods.append(run.start(TRAIN_ARGS=LIVE_ARGS))
        clocks.append(StepClock(pods[1]))
        resumed = pods[1].wait_for_event("resumed", source="train")["step"]
        pods[1].wait_for_event("step", step=resumed + 20)
        served_while_next_pod_trained = wait_for_step(board, "live/tensorboard", resumed + 20)
        exit_codes.append(stop(pods[1], clocks[1]))
        logged = {**clocks[0].logged, **clocks[1].logged}
        final = wait_for_step(board, "live/tensorboard", max(logged))
        return Watch(run, logged, served_at, first_served, final, lags, exit_codes, status_json, status_detail,
                     stale_now, board.runs(), resumed, set(clocks[1].logged), set(served_while_next_pod_trained),
                     "".join(pod.output for pod in pods))
    finally:
        for clock in clocks:
            clock.stop()
        if board:
            board.stop()
        for pod in pods:
            if pod.proc.poll() is None:
                pod.delete()
                pod.wait()


def stop(pod, clock: StepClock) -> int:
    """Delete the pod (SIGTERM) and wait until it and its output end; its exit code."""
    pod.delete()
    code = pod.wait()
    pod.wait_for("local_pod: exit code")
    clock.stop()
    return code


def follow(board: TensorBoard, run: str, seconds: float) -> tuple[dict[int, float], set[int]]:
    """When each step first appeared in TensorBoard (polled 4 times a second), from its first
    answer with points for `seconds`; and the steps of that first answer."""
    served_at: dict[int, float] = {}
    first: set[int] = set()
    end = None
    give_up = time.monotonic() + 60
    while end is None or time.monotonic() < end:
        now = time.monotonic()
        assert end or now < give_up, f"TensorBoard served no train/loss of {run}:\n{''.join(board.output)}"
        steps = board.scalars(run, "train/loss")
        for step in steps:
            served_at.setdefault(step, now)
        if steps and end is None:
            first, end = set(steps), now + seconds
        time.sleep(0.25)
    return served_at, first


def wait_for_step(board: TensorBoard, run: str, step: int, timeout: float = 30) -> dict[int, float]:
    def reached() -> dict[int, float]:
        served = board.scalars(run, "train/loss")
        return served if served and max(served) >= step else {}
    served = wait_until(reached, timeout, interval=0.5)
    assert served, f"TensorBoard never showed step {step} of {run}"
    return served


def test_tensorboard_serves_every_train_loss_step_the_trainer_logged(watched):
    assert watched.exit_codes == [143, 143], watched.pod_output[-3000:]
    logged = {step: loss for step, (_, loss) in watched.logged.items()}
    assert len(logged) > 50
    assert sorted(watched.final_served) == sorted(logged), "every logged step, none else"
    for step, loss in logged.items():
        assert watched.final_served[step] == pytest.approx(loss, abs=6e-5), f"step {step}"
    assert watched.tensorboard_runs == ["live/tensorboard"], "one run, under its name"


def test_points_logged_later_appear_without_restarting_tensorboard(watched):
    later = set(watched.final_served) - watched.first_served
    assert watched.first_served and len(later) > 50
    assert min(later) > max(watched.first_served)


def test_tensorboard_follows_the_runs_next_pod_into_its_new_event_file(watched):
    assert min(watched.second_pod_steps) == watched.resumed_from + 1
    assert watched.resumed_from + 20 in watched.served_while_second_pod_trained, "live, not at the pod's end"
    assert watched.second_pod_steps <= set(watched.final_served)
    keys = watched.run.keys()
    event_files = {k.rsplit(".", 1)[0] for k in keys if k.startswith("tensorboard/events.out.tfevents")}
    assert len(event_files) == 2, "one per pod (each in segments: FILE.NNNNNNNN)"


def test_tensorboard_lag_from_trainer_log_line_to_served_point(watched):
    lags = sorted(watched.lags)
    assert len(lags) > 20, "steps measured"
    median, p90 = statistics.median(lags), lags[int(0.9 * (len(lags) - 1))]
    print(f"\nTensorBoard lag (SYNC_INTERVAL_SECONDS=2, --reload_interval 1, {len(lags)} steps): "
          f"median {median:.1f}s, p90 {p90:.1f}s, min {lags[0]:.1f}s, max {lags[-1]:.1f}s")


def test_status_shows_a_training_pod_as_running(watched):
    by_name = {row["run"]: row for row in watched.status_json}
    live = by_name["live"]
    assert live["state"] == "running" and live["attempts"] == 1
    assert live["max_steps"] == LIVE_MAX_STEPS and live["committed_step"] >= 50
    assert live["heartbeat_age_seconds"] < 60
    assert by_name["done"]["state"] == "completed"
    assert "live" in watched.status_detail and re.search(r"^1 .* running .*\d+→\d+$", watched.status_detail, re.M)
    assert {row["run"]: row["state"] for row in watched.status_stale_now}["live"] == "stale", "--stale-after 0"


# -- every state, after the live run ---------------------------------------------------------------

@pytest.fixture(scope="module")
def states(lab, watched):
    """crashed and stalled: the live run copied, its real status.json edited as dead pods leave it."""
    status = watched.run.json("status.json")
    crashed = json.loads(json.dumps(status))
    lost = dict(crashed["attempts"][0], attempt=1, lost=True, exit_code=None)
    lost["ended_at"] = lost["heartbeat_at"]
    failing = dict(crashed["attempts"][0], attempt=2, pod="gpt-train-crash", exit_code=1,
                   started_at=lost["ended_at"] + 5, ended_at=lost["ended_at"] + 65, start_step=lost["end_step"])
    crashed.update(state="failed", attempt=2, pod="gpt-train-crash", attempts=[lost, failing])
    stalled = json.loads(json.dumps(status))
    stalled.update(state="running", heartbeat_at=status["heartbeat_at"] - HOUR)
    stalled["attempts"][-1].update(ended_at=None, exit_code=None, heartbeat_at=stalled["heartbeat_at"])
    for name, edited in (("crashed", crashed), ("stalled", stalled)):
        for key in watched.run.keys():
            lab.s3.copy_object(Bucket=BUCKET, Key=f"runs/{name}/{key}",
                               CopySource={"Bucket": BUCKET, "Key": f"{watched.run.prefix}{key}"})
        lab.s3.put_object(Bucket=BUCKET, Key=f"runs/{name}/status.json", Body=json.dumps(edited).encode())
    return {"done": "completed", "crashed": "failed", "live": "interrupted", "misconfigured": "failed",
            "stalled": "stale"}


def test_status_table_shows_each_runs_state_sorted_by_name(states, done, watched):
    result = run_status(RUNS)
    assert result.returncode == 0, result.stderr
    print("\n" + result.stdout)
    table, notes = result.stdout.split("\n\n")
    header, *rows = table.splitlines()
    assert header.split() == ["RUN", "STATE", "STEP", "BEST", "VAL", "ATTEMPTS", "HEARTBEAT", "SIZE"]
    cells = {row.split()[0]: row.split() for row in rows}
    assert [row.split()[0] for row in rows] == sorted(states)
    assert {name: cell[1] for name, cell in cells.items()} == states
    assert cells["done"][2] == "60/60" and cells["done"][4] == "1"
    assert cells["live"][2] == f"{watched.run.committed_steps()[0]}/{LIVE_MAX_STEPS}"
    assert cells["stalled"][5:7] == ["1h", "ago"] and cells["crashed"][4] == "2"
    assert cells["done"][8] == "MB"
    assert cells["misconfigured"][2:4] == ["-", "-"], "no step committed, no loss"
    assert re.fullmatch(r"misconfigured +attempt 1: the trainer stopped on bad input: \S+/train\.bin holds \d+ "
                        r"tokens, fewer than model\.block_size\+2 \(10000002\); give more data or a smaller block_size",
                        notes.strip()), "why the failed run failed, under the table"


def test_status_json_gives_the_same_for_machines(states, done):
    result = run_status(RUNS, "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["run"] for r in rows] == sorted(states)
    assert {r["run"]: r["state"] for r in rows} == states
    row = rows[0]
    assert row["run"] == "crashed" and row["uri"] == f"{RUNS}crashed/"
    listed = done.s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/done/")["Contents"]
    done_row = next(r for r in rows if r["run"] == "done")
    assert done_row["size_bytes"] == sum(o["Size"] for o in listed)
    assert done_row["committed_step"] == done.committed_steps()[0] == 60
    assert done_row["best_val_loss"] == done.json("COMPLETE")["best_val_loss"]


def test_status_of_one_run_shows_each_attempt(states, done):
    result = run_status(f"{RUNS}crashed")
    assert result.returncode == 0, result.stderr
    print("\n" + result.stdout)
    assert result.stdout.splitlines()[1].split()[:2] == ["crashed", "failed"]
    first, second = attempt_rows(result.stdout)
    assert first.split()[0] == "1" and " lost " in first
    assert re.match(r"2 +gpt-train-crash .* 1m +1 +(\d+)→\1$", second)
    misconfigured = run_status(f"{RUNS}misconfigured")
    (only,) = attempt_rows(misconfigured.stdout)
    assert re.match(r"1 +gpt-train-\w+ .* 64 +\?→\?$", only), "exit 64 before any step"
    assert "STEPS are ? until the trainer writes progress.json" in misconfigured.stdout
    assert "STEPS are ?" not in result.stdout
    assert misconfigured.stdout.splitlines()[-1].startswith("attempt 1: the trainer stopped on bad input: ")
    assert "fewer than model.block_size+2" in json.loads(run_status(f"{RUNS}misconfigured", "--json").stdout)[
        "attempt_history"][0]["error"]
    detail = json.loads(run_status(done.output_uri, "--json").stdout)
    assert detail["state"] == "completed" and detail["attempt_history"][0]["exit_code"] == 0


def attempt_rows(detail: str) -> list[str]:
    lines = detail.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("ATTEMPT")) + 1:]
    return rows[:rows.index("")] if "" in rows else rows


def test_status_logs_print_the_pods_log_from_s3_as_kubectl_logs_showed_it(done):
    result = run_status(done.output_uri, "--logs")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"== attempt 1, pod gpt-train-\w+ ==", lines[0])
    assert " script: pod gpt-train-" in lines[1] and " starting: code " in lines[1]
    assert "train: step 60/60 | loss" in result.stdout and " script: final upload (trainer exit 0)..." in result.stdout
    assert not any(line.startswith("EVENT ") for line in lines), "the events stay out, as in kubectl logs"
    assert re.search(r"status: \d+ EVENT lines \(for tools\) not shown; --events shows them", result.stderr)


def test_status_plot_draws_every_runs_loss_curves_into_a_png(states, tmp_path):
    png = tmp_path / "loss.png"
    result = run_status(RUNS, "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000
    assert "loss curves of 4 run(s)" in result.stderr, "misconfigured never logged a step"
    assert "misconfigured: no loss in TensorBoard event files yet" in result.stderr


def test_plot_counts_a_step_redone_after_a_restart_once(tmp_path):
    """Two pods' event files as the trainer writes them: the second resumed from step 5 and its
    purge_step hides the steps 6..8 the first logged; they count with the second's values."""
    from torch.utils.tensorboard import SummaryWriter

    import status

    for purge, steps, offset in ((None, range(1, 9), 0.0), (6, range(6, 11), 100.0)):
        writer = SummaryWriter(str(tmp_path), purge_step=purge, filename_suffix=f".{offset:.0f}")
        for step in steps:
            writer.add_scalar("train/loss", offset + step, step)
        writer.close()
        if purge is None:
            time.sleep(1.1)  # event file names carry the second they were opened: the order of pods
    steps, values = status.loss_curves(tmp_path)["train/loss"]
    assert steps == list(range(1, 11))
    assert values == [1, 2, 3, 4, 5, 106, 107, 108, 109, 110]


@pytest.mark.parametrize("uri, cause", [
    ("runs/", "is not an s3://bucket/prefix/ URI"),
    ("s3://no-such-bucket/runs/", "bucket no-such-bucket does not exist"),
    (f"s3://{BUCKET}/nothing-here/", "nothing under"),
    (f"s3://{BUCKET}/code/", "but no run (no status.json, no checkpoints/)"),
])
def test_status_names_bad_input_in_one_line_and_exits_64(lab, uri, cause):
    result = run_status(uri)
    assert result.returncode == 64 and result.stdout == ""
    assert cause in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "testing" not in result.stderr, "credentials are never printed"


def test_status_exits_75_when_s3_is_unreachable(lab):
    result = run_status(RUNS, env={**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_ports()}"})
    assert result.returncode == 75
    assert "S3 unreachable" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# -- tensorboard.sh ----------------------------------------------------------------------------------

def test_tensorboard_on_a_prefix_shows_each_run_by_name(states, lab):
    env = {k: v for k, v in tool_env().items() if k != "AWS_ENDPOINT_URL"}
    env["S3_ENDPOINT"] = lab.endpoint  # TensorBoard's own variable works as well
    board = TensorBoard(RUNS, "--reload_interval", "1", env=env)
    try:
        names = [f"{name}/tensorboard" for name in states if name != "misconfigured"]
        assert sorted(board.wait_for_runs(*names)) == sorted(names)
        # A run is listed as soon as its folder is found; its events load on a later reload.
        assert wait_until(lambda: board.scalars("done/tensorboard", "train/loss"), timeout=60), \
            "".join(board.output)
    finally:
        board.stop()


def test_tensorboard_on_a_run_without_event_files_says_so_and_serves_it(states, lab, tmp_path):
    # "misconfigured" failed before its first step: a status.json, no tensorboard/ (yet, for a live run)
    fake = tmp_path / "tensorboard"
    fake.write_text("#!/bin/sh\necho \"$@\"\n")
    fake.chmod(0o755)
    env = {**tool_env(), "PATH": f"{tmp_path}:{tool_env()['PATH']}"}
    said = {name: subprocess.run([str(TENSORBOARD), f"{RUNS}{name}/"], capture_output=True, text=True, env=env,
                                 timeout=60) for name in ("misconfigured", "done")}
    assert [result.returncode for result in said.values()] == [0, 0], said
    assert f"--logdir_spec=misconfigured:{RUNS}misconfigured/" in said["misconfigured"].stdout
    assert f"no event files in {RUNS}misconfigured/tensorboard/ yet" in said["misconfigured"].stderr
    assert "no event files" not in said["done"].stderr


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "S3_ENDPOINT"])
def test_tensorboard_refuses_an_endpoint_without_its_scheme(lab, variable):
    env = {**tool_env(), variable: lab.endpoint.removeprefix("http://")}
    result = subprocess.run([str(TENSORBOARD), RUNS], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 64
    assert result.stderr.count("\n") == 1 and f"{variable}=127.0.0.1:" in result.stderr
    assert "no http:// or https:// scheme" in result.stderr


# The pod's one table of S3 errors (job/s3_errors.py), with a local user's fix: the same cause in
# the same words from status.py and tensorboard.sh.
BAD_S3 = [
    ("no bucket", {}, "s3://no-such-bucket/runs/", "bucket no-such-bucket does not exist; create it or fix the URI"),
    ("no credentials", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_EC2_METADATA_DISABLED": "true"},
     RUNS, "no AWS credentials; set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
]


@pytest.mark.parametrize("case,env,uri,line", BAD_S3, ids=[c[0] for c in BAD_S3])
@pytest.mark.parametrize("tool", ["status", "tensorboard"])
def test_status_and_tensorboard_explain_s3_errors_from_the_one_table(lab, tool, case, env, uri, line):
    env = {**tool_env(), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent", **env}
    if tool == "status":
        result = run_status(uri, env=env)
    else:
        result = subprocess.run([str(TENSORBOARD), uri], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 64, result.stderr
    assert line in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr

def run_status(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STATUS), *args], capture_output=True, text=True,
                          env=env or dict(os.environ), timeout=60)


def status_of(*args: str):
    result = run_status(*args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if "--json" in args else result.stdout
