"""Kill the pod anywhere, and prove that nothing is lost.

    sudo .venv/bin/python lab/chaos.py [--kills 24] [--sigterms 6] [--seed 1] [--nodes N]

Starts a local S3, stages a run, trains it once without interruption (the reference), then trains
it again while killing its pods, each time at a moment drawn (seeded) from a phase: code sync, data
sync, environment, lease, restore, training, checkpoint write, upload, final upload, writing
COMPLETE. A kill is SIGKILL to the pod's PID 1 (a lost node) or SIGTERM to the pod (a graceful
deletion). After each pod the Job's next pod starts, until one writes COMPLETE.

Checked after every pod: every checkpoint S3 shows as committed matches its manifest; the newest
committed step never goes back; nothing retention must keep is missing; a pod resumes only from a
checkpoint that was committed in S3 when it started; after a graceful deletion no step is redone.
At the end: the final model.pt is bitwise identical to the reference. Prints a table: moment,
phase, step resumed from, steps redone. Exit 0 when every check held, 1 otherwise.

--nodes N: a group of N pods, the Indexed Job scripts/submit.py renders (backoffLimit raised: the
Job's retries are not what is tested), its pods run side by side by lab/local_job.py. Each moment
also draws the pod it hits; a node k > 0 has its own phases (it waits for node 0 instead of taking
the lease; it never uploads). After each hit the Job brings the whole group back (the peers exit
138); the same checks hold, and the reference is one pod of N processes (the same world size).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from podlab import Pod, Run, local_s3, tool_env, write_config, write_corpus

# Phase: (the event that starts it, longest delay after that, in seconds): the runtime's events and,
# inside training, the trainer's (job/contract.py), never prose. A step of None is drawn per pod (trigger).
PHASES = {
    "code sync": (("phase", {"name": "sync code", "state": "start"}), 0.3),
    "data sync": (("phase", {"name": "sync data", "state": "start"}), 0.3),
    "environment": (("phase", {"name": "python environment", "state": "start"}), 0.5),
    "lease": (("phase", {"name": "take the run's lease", "state": "start"}), 0.2),
    "restore": (("phase", {"name": "restore checkpoint", "state": "start"}), 0.3),
    "training": (("step", {"step": None}), 0.02),
    "checkpoint write": (("step", {"step": None}), 0.01),  # a checkpoint step: its save follows
    "upload": (("checkpoint", {"state": "committed"}), 1.0),
    "final upload": (("phase", {"name": "final upload", "state": "start", "trainer_exit": 0}), 0.3),
    "writing COMPLETE": (("complete", {"state": "writing"}), 0.01),
}
LAST_PHASES = ("final upload", "writing COMPLETE")  # reached only once training is done
# What a node k > 0 of a group goes through; the trainer's and uploader's events come from node 0.
NODE_K_PHASES = ("code sync", "data sync", "environment", "wait for node 0", "restore", "training",
                 "checkpoint write")
GROUP_PHASES = {**PHASES, "wait for node 0": (("phase", {"name": "wait for node 0", "state": "start"}), 0.3)}
FROM_NODE_0 = ("training", "checkpoint write", "upload", "final upload", "writing COMPLETE")
GROUP_CHAOS_CONFIG = {"train__max_steps": 200, "checkpoint__interval": 5, "checkpoint__keep": 2, "eval__interval": 10,
                      "log__interval": 1}  # ~50 ms a step: a moment in training lands before the end
CHAOS_CONFIG = {"train__max_steps": 100, "checkpoint__interval": 5, "checkpoint__keep": 2, "eval__interval": 10,
                "model__n_embd": 64, "model__block_size": 64, "train__batch_size": 16}


@dataclass
class Moment:
    phase: str
    signal: str  # KILL or TERM
    delay: float
    index: int = 0  # the pod of a group it hits


@dataclass
class Row:
    moment: Moment | None
    hit: bool
    exit_code: int
    resumed_from: int | None
    last_step: int | None
    redone: int | None = None
    at: float = 0.0  # when the signal was sent (time.time(), the events' clock)


@dataclass
class Invariants:
    """What S3 has shown so far, to check each new state against."""

    keep: int
    ever_committed: set = field(default_factory=set)
    newest: int = -1

    def check(self, run: Run) -> list[int]:
        committed = run.committed_steps()
        for step in committed:
            problem = run.verify_in_s3(f"step-{step:08d}")
            assert problem is None, f"S3 shows a torn checkpoint as committed: {problem}"
        newest = committed[0] if committed else -1
        assert newest >= self.newest, f"the newest committed step went back: {self.newest} -> {newest}"
        self.newest = newest
        self.ever_committed |= set(committed)
        must_keep = sorted(self.ever_committed, reverse=True)[:self.keep]
        missing = set(must_keep) - set(committed)
        assert not missing, f"retention lost checkpoints it must keep: {sorted(missing)}"
        if "COMPLETE" in run.keys():
            assert newest == run.config["train__max_steps"], "COMPLETE without the last step committed"
        return committed


def schedule(kills: int, sigterms: int, seed: int) -> list[Moment]:
    """Moments spread over every phase (round robin, seeded order), final phases last."""
    rng = random.Random(seed)
    early = [p for p in PHASES if p not in LAST_PHASES]
    moments = [Moment(early[i % len(early)], "KILL", 0.0) for i in range(kills - 2 * len(LAST_PHASES))]
    moments += [Moment(early[(i * 3) % len(early)], "TERM", 0.0) for i in range(sigterms)]
    rng.shuffle(moments)
    moments += [Moment(p, "KILL", 0.0) for p in LAST_PHASES for _ in range(2)]
    for moment in moments:
        moment.delay = rng.uniform(0, PHASES[moment.phase][1])
    return moments


def trigger(pod: Pod, moment: Moment, rng: random.Random, max_steps: int) -> tuple[str, dict]:
    """The event to wait for; for training phases its step depends on where this pod resumed."""
    kind, fields = PHASES[moment.phase][0]
    if "step" not in fields or fields["step"] is not None:
        return kind, fields
    resumed = pod.wait_for_event("restore", timeout=180)["step"] or 0
    step = min(resumed + rng.randint(2, 9), max_steps - 1)
    checkpoint = min(max_steps - 1, (resumed // 5 + 1) * 5 + 5 * rng.randint(0, 1))
    return kind, {**fields, "step": checkpoint if moment.phase == "checkpoint write" else step}


def run_chaos(run: Run, moments: list[Moment], seed: int, say=print) -> list[Row]:
    rng = random.Random(seed + 1)
    max_steps = run.config["train__max_steps"]
    invariants = Invariants(keep=run.config["checkpoint__keep"])
    rows: list[Row] = []
    pending = list(moments)
    while True:
        before = set(run.committed_steps())
        moment = pending.pop(0) if pending else None
        pod = run.start()
        row = _drive(pod, moment, rng, max_steps)
        _check_resume(pod, row, before, rows)
        invariants.check(run)
        rows.append(row)
        say(_format_row(len(rows), row))
        if "COMPLETE" in run.keys():
            return rows  # moments still pending cannot happen any more: the run is finished
        if len(rows) > len(moments) + 10:
            raise AssertionError("the run does not finish")


def _drive(pod: Pod, moment: Moment | None, rng: random.Random, max_steps: int) -> Row:
    hit = False
    if moment:
        try:
            kind, fields = trigger(pod, moment, rng, max_steps)
            pod.wait_for_event(kind, timeout=180, **fields)
            time.sleep(moment.delay)
            hit = pod.proc.poll() is None
            if hit and moment.signal == "KILL":
                hit = pod.lose_node()
            elif hit:
                pod.delete()
        except AssertionError:
            hit = False  # the pod ended before that moment came
    code = pod.wait(timeout=300)
    steps = [e["step"] for e in pod.events if e["event"] == "step"]
    return Row(moment, hit, code, _resumed_from(pod), max(steps) if steps else None)


def _check_resume(pod: Pod, row: Row, committed_before: set, rows: list[Row]) -> None:
    if row.resumed_from is not None:
        assert row.resumed_from in committed_before, (
            f"resumed from step {row.resumed_from}, which S3 did not show as committed: {sorted(committed_before)}")
    previous = next((r for r in reversed(rows) if r.last_step is not None), None)
    if previous is None or row.resumed_from is None and row.last_step is None:
        return
    start = row.resumed_from or 0
    row.redone = max(0, previous.last_step - start)
    last = rows[-1] if rows else None
    if last and last.moment and last.moment.signal == "TERM" and last.hit and last.last_step is not None:
        assert row.redone == 0, f"{row.redone} steps redone after a graceful deletion"


def _resumed_from(pod: Pod) -> int | None:
    """The step restore brought back (the trainer goes on from it), None when it got no further."""
    return next((e["step"] for e in pod.events if e["event"] == "restore"), None)


def _format_row(number: int, row: Row) -> str:
    moment = row.moment
    what = f"SIG{moment.signal:<4} {moment.phase:<17} +{moment.delay * 1000:4.0f}ms" if moment else "(no kill)" + " " * 28
    if moment and moment.index:
        what += f" pod {moment.index}"
    hit = "hit " if row.hit else ("miss" if moment else "    ")
    return (f"{number:>3}  {what}  {hit}  exit {row.exit_code:>3}  resumed from {_show(row.resumed_from):>4}  "
            f"last step {_show(row.last_step):>4}  redone {_show(row.redone):>3}")


def _show(value) -> str:
    return "-" if value is None else str(value)


def summary(rows: list[Row]) -> str:
    hits = [r for r in rows if r.hit]
    phases = sorted({r.moment.phase for r in hits})
    kills = sum(1 for r in hits if r.moment.signal == "KILL")
    terms = sum(1 for r in hits if r.moment.signal == "TERM")
    redone = [r.redone for r in rows if r.redone is not None]
    return (f"{len(rows)} pods, {kills} SIGKILLs and {terms} SIGTERMs landed in {len(phases)} phases "
            f"({', '.join(phases)}); steps redone: total {sum(redone)}, most {max(redone, default=0)}")


# -- a group of pods ---------------------------------------------------------------------------

def group_schedule(kills: int, sigterms: int, seed: int, nodes: int) -> list[Moment]:
    """As schedule(), each moment also hitting a pod drawn (seeded); a node k > 0 only in its phases."""
    rng = random.Random(seed + 2)
    moments = schedule(kills, sigterms, seed)
    for moment in moments:
        moment.index = rng.randrange(nodes) if moment.phase in NODE_K_PHASES else 0
    return moments


def run_group_chaos(run: Run, moments: list[Moment], seed: int, nodes: int, say=print) -> list[Row]:
    rng = random.Random(seed + 1)
    max_steps = run.config["train__max_steps"]
    invariants = Invariants(keep=run.config["checkpoint__keep"])
    manifest = run.render_indexed(nodes, name="chaos")
    manifest.write_text(manifest.read_text().replace("backoffLimit: 6", "backoffLimit: 1000"))
    job = run.start_indexed(manifest)
    rows: list[Row] = []
    try:
        for moment in moments:
            if job.condition:
                break  # the run is finished: later moments cannot happen any more
            before = set(run.committed_steps())
            attempts = [job.attempts(i) for i in range(nodes)]
            row = _hit_group(job, moment, rng, max_steps)
            if row.hit:
                _wait_for_new_group(job, attempts, moment.index, row.at)
            _check_group_resume(job, row, before, rows)
            invariants.check(run)
            rows.append(row)
            say(_format_row(len(rows), row))
        state, reason = job.wait(timeout=900)
        assert state == "Complete", f"the Job ended {state} ({reason}); history {job.history}"
        invariants.check(run)
    finally:
        job.stop(grace=30)
        for index in range(nodes):  # every pod's output, to read what a row does not say
            for pod in job.pods(index):
                (run.folder / f"pod-{index}-{pod.attempt}.log").write_text(pod.output)
    say(f"the Job's pods: {job.history}; their output in {run.folder}/pod-INDEX-ATTEMPT.log")
    return rows


def _hit_group(job, moment: Moment, rng: random.Random, max_steps: int) -> Row:
    node0, target = job.pod(0), job.pod(moment.index)
    watched = node0 if moment.phase in FROM_NODE_0 else target
    kind, fields = GROUP_PHASES[moment.phase][0]
    if "step" in fields and fields["step"] is None:
        kind, fields = trigger(node0, moment, rng, max_steps)
    hit = False
    try:
        watched.wait_for_event(kind, timeout=300, **fields)
        time.sleep(moment.delay)
        hit = target.proc.poll() is None
        at = time.time()
        if hit and moment.signal == "KILL":
            hit = target.lose_node()
        elif hit:
            target.delete()
    except AssertionError:
        hit, at = False, 0.0  # that pod ended before the moment came
    steps = [e["step"] for e in node0.events if e["event"] == "step"]
    return Row(moment, hit, target.wait(timeout=600) if hit else -1, _resumed_from(node0),
               max(steps) if steps else None, at=at)


def _wait_for_new_group(job, attempts: list[int], index: int, hit_at: float) -> None:
    """Until the hit pod has a successor and the group trains again (node 0's trainer resumed
    after the hit), or the Job ended."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not job.condition:
        resumed = any(e["event"] == "resumed" and e["time"] > hit_at for e in job.pod(0).events)
        if job.attempts(index) > attempts[index] and resumed:
            return
        time.sleep(0.2)
    assert job.condition, f"the group did not come back in 600 s: history {job.history}"


def _check_group_resume(job, row: Row, committed_before: set, rows: list[Row]) -> None:
    """Node 0 resumed only from a step S3 showed as committed; none redone after a SIGTERM."""
    _check_resume(job.pod(0), row, committed_before | {None}, [])
    last = rows[-1] if rows else None
    if last and last.moment.signal == "TERM" and last.hit and last.last_step is not None:
        resumed = _resumed_from(job.pod(0))
        assert resumed is None or resumed >= last.last_step, (
            f"resumed from {resumed} after a graceful deletion at step {last.last_step}")


def group_reference(folder: Path, config: dict, nodes: int) -> bytes:
    """One pod of N processes, uninterrupted: what the group must end with, bit for bit."""
    import subprocess

    data, cfg, out = write_corpus(folder / "data"), folder / "cfg.yaml", folder / "out"
    write_config(cfg, **config)
    code = Path(__file__).resolve().parents[1] / "code"
    subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nodes}",
                    str(code / "train.py"), "--config", str(cfg), "--data_dir", str(data), "--output_dir", str(out)],
                   check=True, capture_output=True, env={**tool_env(), "OMP_NUM_THREADS": "1"}, timeout=900)
    return (out / "checkpoints" / f"step-{config['train__max_steps']:08d}" / "model.pt").read_bytes()


def group_chaos(s3, endpoint: str, kills: int, sigterms: int, seed: int, nodes: int) -> int:
    folder = Path(tempfile.mkdtemp(prefix="chaos-group-"))
    started = time.monotonic()
    run = Run(s3, endpoint, folder / "chaos", name="chaos", **GROUP_CHAOS_CONFIG).stage()
    reference = group_reference(folder / "reference", run.config, nodes)
    print(f"reference (1 pod x {nodes} processes) trained in {time.monotonic() - started:.0f}s; "
          f"chaos on {nodes} pods (seed {seed}):")
    try:
        rows = run_group_chaos(run, group_schedule(kills, sigterms, seed, nodes), seed, nodes)
        final = run.config["train__max_steps"]
        assert run.read(f"checkpoints/step-{final:08d}/model.pt") == reference, "the final model differs"
    except AssertionError as err:
        print(f"FAILED: {err}")
        return 1
    print(summary(rows))
    print(f"final model.pt bitwise identical to 1 pod x {nodes} processes; {time.monotonic() - started:.0f}s in all")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--sigterms", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1, help="pods in the group (default 1: one pod per Job)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("chaos.py: error: the local pod runner needs root; run it with sudo", file=sys.stderr)
        return 64

    import boto3
    with local_s3() as endpoint:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        if args.nodes > 1:
            return group_chaos(s3, endpoint, args.kills, args.sigterms, args.seed, args.nodes)
        return reference_then_chaos(s3, endpoint, args.kills, args.sigterms, args.seed)


def reference_then_chaos(s3, endpoint: str, kills: int, sigterms: int, seed: int) -> int:
    """The reference run, then the run under chaos; 0 when every check held."""
    folder = Path(tempfile.mkdtemp(prefix="chaos-"))
    started = time.monotonic()
    reference = Run(s3, endpoint, folder / "reference", name="reference", **CHAOS_CONFIG).stage()
    code, pod = reference.run()
    if code != 0:
        print(pod.output[-3000:])
        return 1
    run = Run(s3, endpoint, folder / "chaos", name="chaos", **CHAOS_CONFIG).stage()
    print(f"reference trained in {time.monotonic() - started:.0f}s; chaos (seed {seed}):")
    try:
        rows = run_chaos(run, schedule(kills, sigterms, seed), seed)
        final = CHAOS_CONFIG["train__max_steps"]
        assert run.model_sha(final) == reference.model_sha(final), "the final model differs from the reference"
    except AssertionError as err:
        print(f"FAILED: {err}")
        return 1
    print(summary(rows))
    print(f"final model.pt bitwise identical to the uninterrupted run; {time.monotonic() - started:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
