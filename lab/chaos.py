"""Kill the pod anywhere, and prove that nothing is lost.

    sudo .venv/bin/python lab/chaos.py [--kills 24] [--sigterms 6] [--seed 1]

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

from podlab import Pod, Run, local_s3

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
CHAOS_CONFIG = {"train__max_steps": 100, "checkpoint__interval": 5, "checkpoint__keep": 2, "eval__interval": 10,
                "model__n_embd": 64, "model__block_size": 64, "train__batch_size": 16}


@dataclass
class Moment:
    phase: str
    signal: str  # KILL or TERM
    delay: float


@dataclass
class Row:
    moment: Moment | None
    hit: bool
    exit_code: int
    resumed_from: int | None
    last_step: int | None
    redone: int | None = None


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--sigterms", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("chaos.py: error: the local pod runner needs root; run it with sudo", file=sys.stderr)
        return 64

    import boto3
    with local_s3() as endpoint:
        s3 = boto3.client("s3", endpoint_url=endpoint)
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
