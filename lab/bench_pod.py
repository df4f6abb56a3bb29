"""What a pod's life costs, through the real job.yaml (lab/local_pod.py, local S3), in one run:

pod A trains; after a few steps its PID 1 gets SIGTERM (a deleted pod): sigterm_to_exit_s is the
time to the pod's exit, with the step it stopped at committed in S3, beside `s5cmd cp` of that
step's files to the same S3. Pod B starts (A let go of the lease): pod_start_to_first_step_s is
the time from its start to the first training step after it resumed, beside a bare `torchrun` of
a script that only imports torch. Then B's PID 1 gets SIGKILL (a lost node: the lease stays in S3)
and pod C starts at once: kill_to_training_s, SIGKILL to C's first resumed step
(lab/measure_lease.py's measure), beside B's start as its floor.

The trainer's progress is read from its EVENT lines (job/contract.py: `resumed`, `step`,
`stopped`, `checkpoint`), or from its log lines where a trainer prints no events yet.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_report import figure, unmeasured
from bench_transfer import delete_prefix, timed
from measure_lease import restart_after_lost_node
from podlab import BUCKET, ROOT, VENV_BIN, Run, checkpoint, contract, tool_env

LONG = ("--set train.max_steps=100000 --set log.interval=1 --set checkpoint.interval=100000 "
        "--set eval.interval=100000")
DEFAULT_TTL = "30"  # job/script.sh's LEASE_TTL_SECONDS
# GPT-2 124M's shape (config/conf.yaml) with a short context and one sequence a step: a CPU step in seconds.
MODEL_124M = {"model__n_layer": 12, "model__n_head": 12, "model__n_embd": 768, "model__vocab_size": 50304,
              "model__block_size": 64, "train__batch_size": 1, "train__grad_accum_steps": 1, "eval__steps": 1}
PROSE_STEP = re.compile(r" train: step (\d+)/")
PROSE_RESUMED = re.compile(r" train: resumed from \S+ \(step (\d+)\)")
PROSE_COMMITTED = re.compile(r" train: checkpoint (step-\d+) committed")
PROSE_SAVE = re.compile(r"committed: [\d.]+ MB in ([\d.]+)s")


def trainer_mark(line: str) -> tuple[str, dict] | None:
    """(kind, fields) for a trainer's progress line: its event, or its log line where it has none."""
    record = contract.parse_event(line)
    if record is not None:
        if record.get("event") in ("step", "resumed", "stopped", "checkpoint", "done") and "step" in record:
            return record["event"], record
        return None
    for kind, pattern in (("step", PROSE_STEP), ("resumed", PROSE_RESUMED)):
        found = pattern.search(line)
        if found:
            return kind, {"step": int(found.group(1))}
    found = PROSE_COMMITTED.search(line)
    if found:
        return "checkpoint", {"name": found.group(1), "step": int(found.group(1).split("-")[1])}
    return None


def wait_for_mark(pod, accept, timeout: float) -> dict:
    """Poll the pod's lines until `accept(kind, fields, seen_before)` holds; return the fields with
    `at` (time.monotonic() when seen). `seen_before` lists the earlier marks."""
    deadline = time.monotonic() + timeout
    seen: list[tuple[str, dict]] = []
    index = 0
    while time.monotonic() < deadline:
        lines = pod.lines[index:]
        index += len(lines)
        for line in lines:
            mark = trainer_mark(line)
            if mark is None:
                continue
            if accept(mark[0], mark[1], seen):
                return {**mark[1], "at": time.monotonic()}
            seen.append(mark)
        if pod.proc.poll() is not None and index == len(pod.lines):
            break
        time.sleep(0.05)
    raise AssertionError(f"the trainer never got there; output:\n{pod.output[-3000:]}")


def first_resumed_step(pod, timeout: float) -> dict:
    return wait_for_mark(pod, lambda kind, _, seen: kind == "step" and any(k == "resumed" for k, _ in seen), timeout)


def stopped_step(pod) -> int | None:
    """The step the trainer committed on its way out (its `stopped` event, else its last commit)."""
    marks = [m for m in map(trainer_mark, pod.lines) if m]
    for kind, fields in reversed(marks):
        if kind in ("stopped", "checkpoint"):
            return fields["step"]
    return None


def phase_seconds(pod) -> dict[str, float]:
    """The pod's phases (job/script.sh's `phase` events) that finished, and their seconds."""
    return {e["name"]: e["seconds"] for e in pod.events if e.get("event") == "phase" and e.get("state") == "done"}


def resume_moments(pod, started_wall: float) -> dict[str, float]:
    """When the trainer said `resumed` (seconds after the pod's start) and how long its load took."""
    resumed = next((e for e in pod.events if e.get("event") == "resumed" and "time" in e), None)
    if resumed is None:
        return {}
    return {"resumed_at_s": resumed["time"] - started_wall, "resume_load_s": resumed.get("seconds")}


def last_save_seconds(pod) -> float | None:
    """Seconds of the trainer's last commit (its `checkpoint` event, else its log line)."""
    for line in reversed(pod.lines):
        mark = trainer_mark(line)
        if mark and mark[0] == "checkpoint":
            if "seconds" in mark[1]:
                return mark[1]["seconds"]
            found = PROSE_SAVE.search(line)
            return float(found.group(1)) if found else None
    return None


def sigterm_moments(pod, step: int | None, signalled_at: float) -> dict[str, float]:
    """Seconds from the SIGTERM to each event of the way out: the trainer's last step, its commit,
    the step in S3, the pod's exit line."""
    wanted = {"last_step_at_s": ("step", step), "stopped_at_s": ("stopped", step), "uploaded_at_s": ("uploaded", step),
              "exit_line_at_s": ("exit", None)}
    found = {}
    for key, (kind, at_step) in wanted.items():
        times = [e["time"] for e in pod.events if e.get("event") == kind and (at_step is None or e.get("step") == at_step)]
        if times:
            found[key] = round(times[-1] - signalled_at, 2)
    return found


def plain_upload_seconds(s3, run: Run, name: str, folder: Path) -> float:
    """The floor of a stop: `s5cmd cp` of the same checkpoint from this disk to the same S3. Its
    bytes come from S3 first (the pod's emptyDir went with it), so they sit in the page cache, as
    a save's bytes do."""
    s5cmd, env = str(VENV_BIN / "s5cmd"), {**tool_env(), "S3_ENDPOINT_URL": run.endpoint}
    local, floor_prefix = folder / "sigterm-floor", f"bench/sigterm-floor/{name}/"
    try:
        timed([s5cmd, "cp", f"s3://{BUCKET}/{run.prefix}checkpoints/{name}/*", f"{local}/"], env)
        return timed([s5cmd, "cp", f"{local}/*", f"s3://{BUCKET}/{floor_prefix}"], env)
    finally:
        shutil.rmtree(local, ignore_errors=True)
        delete_prefix(s3, floor_prefix)  # moto holds every byte in this process


def bare_torchrun(folder: Path, reps: int) -> float:
    """Median seconds from `torchrun --standalone --nproc_per_node=1` to its worker having imported
    torch (not to torchrun's exit: the pod's figure stops at a step, with torchrun still running)."""
    script = folder / "import_torch.py"
    script.write_text("import torch\nprint('imported', flush=True)\n")
    env = {**tool_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    times = []
    for _ in range(reps):
        started = time.monotonic()
        proc = subprocess.Popen(["torchrun", "--standalone", "--nproc_per_node=1", str(script)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            if line.strip() == "imported":
                times.append(time.monotonic() - started)
        if proc.wait() != 0 or len(times) != _ + 1:
            raise RuntimeError("a bare torchrun of `import torch` failed")
    return statistics.median(times)


def measure(s3, endpoint: str, folder: Path, full: bool) -> dict[str, dict]:
    model = MODEL_124M if full else {}
    which = "GPT-2 124M's shape (12 layers of 768, vocab 50304, context 64)" if full else \
        "the tests' pod model (2 layers of 64)"
    run = Run(s3, endpoint, folder / "pod", name="bench-pod", **model).stage()
    env = {"LEASE_TTL_SECONDS": DEFAULT_TTL, "TRAIN_ARGS": LONG}
    figures: dict[str, dict] = {}
    pod_a = run.start(**env)
    try:
        wait_for_mark(pod_a, lambda kind, fields, _: kind == "step" and fields["step"] >= 3, 900)
    except AssertionError:
        pod_a.delete()
        pod_a.wait(timeout=300)
        raise
    signalled, signalled_at = time.monotonic(), time.time()
    pod_a.delete()
    code = pod_a.wait(timeout=300)
    took = time.monotonic() - signalled
    step = stopped_step(pod_a)
    moments = sigterm_moments(pod_a, step, signalled_at)
    in_s3 = step is not None and step in run.committed_steps()
    floor, floor_problem = None, (None if in_s3 else "the step is not in S3")
    if in_s3:
        try:
            floor = plain_upload_seconds(s3, run, checkpoint.step_dir_name(step), folder)
        except RuntimeError as error:  # the pod's figures still count
            floor_problem = str(error)[:300]
    figures["sigterm_to_exit_s"] = figure(
        "sigterm_to_exit_s", took, f"SIGTERM to a training pod's PID 1 to the pod's exit ({which}), the step it "
        f"stopped at committed in S3: {in_s3}; floor: `s5cmd cp` of that step's files from a local disk to the "
        f"same S3", floor, floor_problem=floor_problem, exit_code=code, step=step, manifest_in_s3=in_s3,
        save_s=last_save_seconds(pod_a), final_upload_s=phase_seconds(pod_a).get("final upload"), **moments)
    if not in_s3:
        figures["sigterm_to_exit_s"]["meets_aim"] = False

    started, started_wall = time.monotonic(), time.time()
    pod_b = run.start(**env)
    try:
        first = first_resumed_step(pod_b, 600)
        start_s = first["at"] - started
        bare = bare_torchrun(folder, 3)
        figures["pod_start_to_first_step_s"] = figure(
            "pod_start_to_first_step_s", start_s, f"a pod's start (local runner) to its first training step after "
            f"resuming step {step} ({which}); floor: a bare `torchrun` to its worker having imported torch (median of 3)", bare,
            ready_s=next((e["seconds"] for e in pod_b.events if e.get("event") == "ready"), None),
            **resume_moments(pod_b, started_wall), first_step_ms=first.get("ms_per_step"),
            **{f"phase {name}": seconds for name, seconds in phase_seconds(pod_b).items()})
        figures["pod_start_to_first_step_minus_bare_torchrun_s"] = figure(
            "pod_start_to_first_step_minus_bare_torchrun_s", start_s - bare,
            "pod_start_to_first_step_s minus the bare torchrun start: what the pod adds")
        took, waited = restart_after_lost_node(run, pod_b, int(DEFAULT_TTL), train_args=LONG,
                                              first_resumed_step=first_resumed_step)
        figures["kill_to_training_s"] = figure(
            "kill_to_training_s", took, f"SIGKILL of a training pod's PID 1 to the next pod's first resumed step "
            f"(LEASE_TTL_SECONDS={DEFAULT_TTL}, the default; lease wait {waited:.1f} s); floor: a pod start without "
            f"a lost lease (pod_start_to_first_step_s)", start_s, lease_wait_s=round(waited, 2))
    finally:
        if pod_b.proc.poll() is None:
            pod_b.delete()
            pod_b.wait(timeout=300)
    return figures


def not_run(why: str) -> dict[str, dict]:
    keys = ("sigterm_to_exit_s", "pod_start_to_first_step_s", "pod_start_to_first_step_minus_bare_torchrun_s",
            "kill_to_training_s")
    return {key: unmeasured(key, why) for key in keys}


if __name__ == "__main__":
    sys.exit("run through lab/benchmark.py all")
