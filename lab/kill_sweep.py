"""SIGKILL train.py at many moments and check that every resume is exact, tensor by tensor.

    .venv/bin/python lab/kill_sweep.py [--kills 100] [--seed 1] [--hog 2] [--threads unset|N]
        [--config config/smoke.yaml] [--set group.key=value]... [--keep-dir DIR] [--json FILE]
    .venv/bin/python lab/kill_sweep.py --tiny --kills 3      # the test's few-second version

Trains the config once without interruption in one process (the reference; every checkpoint it
commits is kept), then runs the same command again and again, each process SIGKILLed (alone, or with
its process group) at a moment drawn from the seed: the first steps, anywhere in training, while a
background save is in flight, during an evaluation, while best/ is linked. After every process, each
checkpoint it committed is compared with the reference's of the same step (model.pt, state.pt: every
tensor's bytes and every other value); the final step and best/ too. A difference counts against the
resume that started the process (or, in a run's first process, against no resume at all).
--hog N keeps N busy processes running throughout; --threads sets OMP_NUM_THREADS for the trainer
("unset": torch's default, as in a user's shell), --reference-threads for the reference alone. The
first runs that differ are kept (every process's log, the checkpoints, the reference) in --keep-dir.
Prints a line per kill and a summary; exit 0 when every checkpoint matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from podlab import ROOT, TINY_CONFIG, write_corpus

sys.path.insert(0, str(ROOT / "job"))
import checkpoint  # noqa: E402
import contract  # noqa: E402

TRAIN = ROOT / "code" / "train.py"
# Where a kill is aimed; each kind has its trigger (an event of the trainer or a folder appearing)
# and the longest delay after it, in steps of the reference's speed.
KINDS = ("first steps", "training", "background save", "evaluation", "best/ update")
TINY = {**TINY_CONFIG, "train": {**TINY_CONFIG["train"], "max_steps": 40},
        "checkpoint": {"interval": 5, "keep": 3}, "eval": {"interval": 10, "steps": 2}}


@dataclass
class Kill:
    kind: str
    delay_steps: float  # after the trigger, in reference step times
    group: bool  # SIGKILL the process group (trainer and save process at once), else the trainer alone


@dataclass
class Outcome:
    number: int
    run: int
    kind: str
    group: bool
    delay_s: float
    hit: bool = False  # False: the process ended (or the trigger never came) before the kill
    last_step: int | None = None  # the newest step event seen before the kill
    saving: bool = False  # a step's staging folder existed at the kill
    linking_best: bool = False  # best/'s staging folder existed at the kill
    committed: int | None = None  # the newest committed step at the kill
    resumed_from: int | None = None  # where the next process started
    differences: list = field(default_factory=list)


# -- comparing checkpoints ---------------------------------------------------------------------

def state_differences(a, b, path: str = "") -> list[str]:
    """Where two loaded checkpoints differ: every tensor by dtype, shape and bytes, every other
    value by ==. Pickle's memo (which strings are the same object) is not compared: it changes
    the bytes of a file, not what it loads as."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: a tensor and a {type(b if isinstance(a, torch.Tensor) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        if _tensor_bytes(a) != _tensor_bytes(b):
            return [f"{path}: {_how_far(a, b)}"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} in one only"]
        return [d for key in a for d in state_differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in state_differences(x, y, f"{path}/{i}")]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} vs {b!r}"]  # a != a: NaN


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _how_far(a: torch.Tensor, b: torch.Tensor) -> str:
    if not a.is_floating_point():
        return f"{int((a != b).sum())} of {a.numel()} values differ"
    diff = (a.double() - b.double()).abs()
    return f"{int((a != b).sum())} of {a.numel()} values differ, the largest by {diff.max().item():.3g}"


def checkpoint_differences(folder: Path, reference: Path) -> list[str]:
    """Where a committed checkpoint differs from the reference's of the same step."""
    found = []
    for name in ("model.pt", "state.pt"):
        if not (reference / name).exists():
            continue
        mine = torch.load(folder / name, map_location="cpu", weights_only=True)
        theirs = torch.load(reference / name, map_location="cpu", weights_only=True)
        found += [f"{folder.name}/{name}{d}" for d in state_differences(mine, theirs)]
    return found


# -- running the trainer -------------------------------------------------------------------------

class Trainer:
    """One train.py process: its output read as it comes (events parsed), killed on request."""

    started: list["Trainer"] = []  # every one, so that a stopped sweep leaves none behind

    def __init__(self, command: list[str], env: dict, log: Path):
        self.log = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.events: list[dict] = []
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        Trainer.started.append(self)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()  # a failing run's log is read while the sweep goes on
            event = contract.parse_event(line)
            if event:
                self.events.append(event)

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self, group: bool) -> bool:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL) if group else self.proc.kill()
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout: float = 3600) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(30)
        self.log.close()
        return code

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.events) if e["event"] == kind), None)


class Sweep:
    """The reference run, then runs killed and resumed until `--kills` kills were drawn."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.data = write_corpus(work / "data")
        self.config = self._config_file()
        self.env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env = with_threads(self.env, args.threads)
        self.reference_env = with_threads(self.env, args.reference_threads or args.threads)
        self.step_seconds = 0.05
        self.max_steps = 0
        self.reference = work / "reference"
        self.unresumed: list[str] = []  # differences in a run's first process, which resumed nothing

    def _config_file(self) -> Path:
        if not self.args.tiny:
            return Path(self.args.config).resolve()
        path = self.work / "tiny.yaml"
        path.write_text(yaml.safe_dump(TINY))
        return path

    def command(self, out: Path) -> list[str]:
        overrides = [arg for item in self.args.set for arg in ("--set", item)]
        return [sys.executable, str(TRAIN), "--config", str(self.config), "--data_dir", str(self.data),
                "--output_dir", str(out), *overrides]

    # -- the reference: every committed step kept as it appears --------------------------------

    def run_reference(self) -> None:
        out, kept = self.reference / "out", self.reference / "kept"
        kept.mkdir(parents=True)
        started = time.monotonic()
        trainer = Trainer(self.command(out), self.reference_env, self.reference / "train.log")
        while trainer.running():  # retention keeps `keep` intervals' time: ample for a 20 ms poll
            keep_new_steps(out / "checkpoints", kept)
            time.sleep(0.02)
        code = trainer.wait()
        keep_new_steps(out / "checkpoints", kept)
        if code != 0:
            raise SystemExit(f"kill_sweep: the reference run failed (exit {code}); see {self.reference}/train.log")
        resumed, done = trainer.last("resumed"), trainer.last("done")
        self.max_steps = done["step"]
        self.step_seconds = (done["time"] - resumed["time"]) / self.max_steps  # training alone, not the start
        print(f"reference: {self.max_steps} steps, {self.step_seconds * 1000:.0f} ms a step, "
              f"{time.monotonic() - started:.1f}s in all, {len(list(kept.iterdir()))} checkpoints kept", flush=True)

    # -- the kills --------------------------------------------------------------------------------

    def run(self) -> list[Outcome]:
        rng = random.Random(self.args.seed)
        outcomes: list[Outcome] = []
        run_number = 0
        while len(outcomes) < self.args.kills:
            run_number += 1
            kills = [draw_kill(rng) for _ in range(rng.randint(1, 4))][: self.args.kills - len(outcomes)]
            outcomes += self.one_run(self.work / "runs" / f"run-{run_number:03d}", run_number, kills, len(outcomes))
            if self.args.stop_at_first and (self.unresumed or any(o.differences for o in outcomes)):
                break
        return outcomes

    def one_run(self, folder: Path, run_number: int, kills: list[Kill], before: int) -> list[Outcome]:
        """Start, kill, start again... until the run completes. After each process, the steps it
        committed are compared with the reference's; a difference is the resume's that started it
        (the kill before), or, in a run's first process, a difference without any resume."""
        out = folder / "out"
        out.mkdir(parents=True)
        outcomes: list[Outcome] = []
        compared: set[str] = set()
        pending, previous = list(kills), None
        unplaced: list[Outcome] = []  # kills whose next process was killed before it said where it resumed
        for segment in range(1, len(kills) + 2):
            trainer = Trainer(self.command(out), self.env, folder / f"segment-{segment:02d}.log")
            kill = pending.pop(0) if pending else None
            outcome = Outcome(before + len(outcomes) + 1, run_number, kill.kind, kill.group, 0.0) if kill else None
            if outcome:
                self.aim(trainer, out, kill, outcome)
            code = trainer.wait()
            if code not in (0, -signal.SIGKILL):
                raise SystemExit(f"kill_sweep: train.py exited {code}; see {folder}/segment-{segment:02d}.log")
            resumed = next((e for e in trainer.events if e["event"] == "resumed"), None)
            differences = self.compare(out, compared) + (self.compare_final(out) if code == 0 else [])
            if previous:
                previous.differences += differences
                unplaced.append(previous)
                if resumed is not None or code != -signal.SIGKILL:
                    # a process killed before its `resumed` event (repairing best/, say) trained nothing:
                    # it resumed where the next one says it resumed
                    for placed in unplaced:
                        placed.resumed_from = resumed["step"] if resumed else None
                        print(format_outcome(placed), flush=True)
                    unplaced = []
            elif differences:
                self.unresumed += differences
                print(f"  run {run_number}: differs without a resume: {'; '.join(differences[:3])}", flush=True)
            if differences:
                self.keep_failure(folder, differences)
            if outcome:
                outcomes.append(outcome)
            if code == 0:  # finished; kills still pending had no moment left to land in
                if outcome and outcome is not previous and not outcome.hit:
                    print(format_outcome(outcome), flush=True)
                return outcomes
            previous = outcome
        raise SystemExit(f"kill_sweep: run {run_number} did not finish after its kills; see {folder}")

    def aim(self, trainer: Trainer, out: Path, kill: Kill, outcome: Outcome) -> None:
        """Wait for the kill's trigger, then its delay, then SIGKILL; record where it landed."""
        ckpts = out / "checkpoints"
        if not wait_for_trigger(trainer, ckpts, kill.kind, self.args.eval_interval):
            return
        delay = kill.delay_steps * self.step_seconds
        if kill.kind == "training":  # a fraction of what is left of the run
            resumed = trainer.last("resumed")
            delay *= self.max_steps - (resumed["step"] if resumed else 0)
        time.sleep(delay)
        outcome.delay_s = delay
        staging = [p.name for p in ckpts.glob(f"{checkpoint.STAGING_PREFIX}*")] if ckpts.is_dir() else []
        outcome.saving = any(n.startswith(f"{checkpoint.STAGING_PREFIX}step-") for n in staging)
        outcome.linking_best = any(n.startswith(f"{checkpoint.STAGING_PREFIX}best") for n in staging)
        committed = checkpoint.committed_steps(ckpts)
        outcome.committed = committed[0][0] if committed else None
        step = trainer.last("step")
        outcome.last_step = step["step"] if step else None
        outcome.hit = trainer.running() and trainer.kill(kill.group)

    def compare(self, out: Path, compared: set[str]) -> list[str]:
        """Differences in the committed steps not compared yet (each is committed once)."""
        found = []
        for _, folder in checkpoint.committed_steps(out / "checkpoints"):
            reference = self.reference / "kept" / folder.name
            if folder.name not in compared and reference.is_dir():
                compared.add(folder.name)
                found += checkpoint_differences(folder, reference)
        return found

    def compare_final(self, out: Path) -> list[str]:
        final = out / "checkpoints" / checkpoint.step_dir_name(self.max_steps)
        if not checkpoint.is_committed(final):
            return [f"{final.name} is not committed after exit 0"]
        best, reference_best = out / "checkpoints" / "best", self.reference / "out" / "checkpoints" / "best"
        if reference_best.is_dir():
            mine, theirs = checkpoint.read_manifest(best), checkpoint.read_manifest(reference_best)
            if not mine or mine["files"] != theirs["files"] or mine["meta"].get("step") != theirs["meta"].get("step"):
                return ["best/ is not the reference's best/"]
        return []

    def keep_failure(self, folder: Path, differences: list[str]) -> None:
        """The run's folder (every process's log, its checkpoints) and the reference, for the first few."""
        keep = Path(self.args.keep_dir)
        kept = sorted(keep.glob("failure-*")) if keep.is_dir() else []
        if len(kept) >= 3 or any(k.name.endswith(folder.name) for k in kept):
            return
        target = keep / f"failure-{len(kept) + 1}-{folder.name}"
        shutil.copytree(folder, target / folder.name)
        shutil.copytree(self.reference, target / "reference")
        (target / "differences.txt").write_text("\n".join(differences) + "\n")
        print(f"  kept the failing run in {target}", flush=True)


def with_threads(env: dict, threads: str) -> dict:
    env = dict(env)
    env.pop("OMP_NUM_THREADS", None)
    return env if threads == "unset" else {**env, "OMP_NUM_THREADS": threads}


def keep_new_steps(ckpts: Path, kept: Path) -> None:
    """Hard links of each newly committed step folder (retention deletes them later)."""
    for _, folder in checkpoint.committed_steps(ckpts):
        target = kept / folder.name
        if target.exists():
            continue
        try:
            staging = kept / f".{folder.name}"
            staging.mkdir()
            for path in folder.iterdir():
                os.link(path, staging / path.name)
            staging.rename(target)
        except OSError:
            shutil.rmtree(kept / f".{folder.name}", ignore_errors=True)  # pruned meanwhile: missed


def draw_kill(rng: random.Random) -> Kill:
    kind = rng.choice(KINDS)
    spread = {"first steps": 5.0, "training": 0.0, "background save": 0.3, "evaluation": 1.0, "best/ update": 0.05}
    return Kill(kind, rng.uniform(0, spread[kind]) if kind != "training" else rng.random(), rng.random() < 0.5)


def wait_for_trigger(trainer: Trainer, ckpts: Path, kind: str, eval_interval: int) -> bool:
    """Block until the moment the kind aims at begins; False if the process ended first."""
    while trainer.running():
        resumed = trainer.last("resumed")
        if kind in ("first steps", "training") and resumed:
            return True
        staging = [p.name for p in ckpts.glob(f"{checkpoint.STAGING_PREFIX}*")] if ckpts.is_dir() else []
        if kind == "background save" and any(n.startswith(f"{checkpoint.STAGING_PREFIX}step-") for n in staging):
            return True
        if kind == "best/ update" and any(n.startswith(f"{checkpoint.STAGING_PREFIX}best") for n in staging):
            return True
        step = trainer.last("step")
        if kind == "evaluation" and step and eval_interval and step["step"] % eval_interval == 0 and \
                resumed and step["step"] > resumed["step"]:
            return True
        time.sleep(0.002)
    return False


def format_outcome(o: Outcome) -> str:
    where = (f"last step {o.last_step if o.last_step is not None else '-':>4}, committed "
             f"{o.committed if o.committed is not None else '-':>4}{', save in flight' if o.saving else ''}"
             f"{', linking best/' if o.linking_best else ''}")
    result = "DIFFERS: " + "; ".join(o.differences[:3]) if o.differences else "exact"
    return (f"{o.number:>4}  run {o.run:>3}  {o.kind:<15} {'group' if o.group else 'trainer':<7} "
            f"+{o.delay_s * 1000:6.0f}ms  {'hit ' if o.hit else 'miss'}  {where}  -> {result}")


def summary(outcomes: list[Outcome], unresumed: list[str]) -> dict:
    hit = [o for o in outcomes if o.hit]
    return {
        "kills": len(outcomes), "hit": len(hit),
        "by_kind": {k: sum(1 for o in hit if o.kind == k) for k in KINDS},
        "during_background_save": sum(1 for o in hit if o.saving),
        "while_linking_best": sum(1 for o in hit if o.linking_best),
        "before_first_commit": sum(1 for o in hit if o.committed is None),
        "differing": sum(1 for o in outcomes if o.differences),
        "differing_without_resume": len(unresumed),
    }


class Hog:
    """N busy processes, each a loop of its own, stopped by their ids."""

    def __init__(self, count: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hog", type=int, default=0, metavar="N", help="busy processes beside the trainer")
    parser.add_argument("--threads", default="unset", help="OMP_NUM_THREADS for train.py, or 'unset'")
    parser.add_argument("--config", default=str(ROOT / "config" / "smoke.yaml"))
    parser.add_argument("--reference-threads", help="OMP_NUM_THREADS for the reference alone (default: "
                        "--threads); another value shows what a thread count changes")
    parser.add_argument("--set", action="append", default=[], metavar="GROUP.KEY=VALUE")
    parser.add_argument("--tiny", action="store_true", help="a 40-step model (a few seconds a run)")
    parser.add_argument("--keep-dir", default="kill-sweep-failures", help="where failing runs are kept")
    parser.add_argument("--work", help="the sweep's folder (default: a temporary one, removed after)")
    parser.add_argument("--json", help="write the outcomes and the summary here")
    parser.add_argument("--stop-at-first", action="store_true", help="stop after the first run that differs")
    args = parser.parse_args(argv)
    for threads in (args.threads, args.reference_threads):
        if threads not in (None, "unset") and not threads.isdigit():
            parser.error("--threads and --reference-threads take a number or 'unset'")
    return args


def eval_interval_of(args) -> int:
    """The eval steps a step event announces (one comes at each log.interval), else 0."""
    sys.path.insert(0, str(ROOT / "code"))
    import config as train_config

    cfg = train_config.from_dict(TINY) if args.tiny else train_config.load(args.config, args.set)
    return cfg.eval.interval if cfg.eval.interval % cfg.log.interval == 0 else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.eval_interval = eval_interval_of(args)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kill-sweep-"))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the finally below runs
    hog = Hog(args.hog)
    try:
        sweep = Sweep(args, work)
        print(f"kill_sweep: {args.kills} kills, seed {args.seed}, hog {args.hog}, OMP_NUM_THREADS "
              f"{args.threads}, {'tiny' if args.tiny else args.config} {' '.join(args.set)}, in {work}", flush=True)
        sweep.run_reference()
        outcomes = sweep.run()
    finally:
        hog.stop()
        for trainer in Trainer.started:
            if trainer.running():
                trainer.kill(group=True)
    result = summary(outcomes, sweep.unresumed)
    print("summary: " + json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                               "summary": result, "kills": [asdict(o) for o in outcomes]}, indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if result["differing"] or result["differing_without_resume"] else 0


if __name__ == "__main__":
    sys.exit(main())
