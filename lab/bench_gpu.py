"""Every GPU figure beside its floor, in one command of at most 8 minutes on one GPU (issue 27):

    python lab/benchmark.py gpu --json FILE [--cpu] [--budget SECONDS] [--only PART]... [--candidate NAME]...

Parts, in this order (or --only's); the JSON (bench_report.GPU_KEYS) is rewritten after each, and a
part that fails or is not reached within --budget leaves its keys null with the reason in `how`:
  trainer     train.py on config/conf.yaml at train.micro_batch 0 (GPT-2 124M, compile, bf16, 0.5M
              tokens a step): tokens/s and MFU over a window of steps, beside the bare loop's
  bare        the same model and step with no trainer (compile, bf16 autocast, fused AdamW, clipping,
              tokens already on the GPU): the floor of the two above
  stall       train.py with a checkpoint every ~10 s of training, in the background and synchronous,
              over the trainer part's run (no checkpoint) in the same window
  sigterm     job/torchrun.py with one process (one GPU): SIGTERM to exit, the step
              committed; the same command resumes there (and is stopped once more)
  finetune    code/finetune.py (bf16 on a GPU) on a random Llama made here, LoRA, full and full under
              FSDP (torchrun, one process) side by side: SIGTERM, then the same command resumes at
              the committed step and finishes
  fsdp        train.py with train.parallelism: fsdp through job/torchrun.py (one process; NCCL on a
              GPU): SIGTERM, the sharded step committed, the same command resumes there
  probe       the micro-batch probe (code/speed.py), train.py with train.micro_batch: auto, and the
              bare loop at the micro-batch it picks (its peak memory)
  candidates  train.py with each speed setting alone, over the trainer part's run, while --budget lasts
              (--candidate NAME, repeatable: only those, in that order; a candidate not run says why)
--cpu (the default without CUDA): the same parts on a tiny model, float32, no compile: the command
works, the figures mean nothing. Nothing here reads the network.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE, JOB, TESTS = ROOT / "code", ROOT / "job", ROOT / "tests"
for _path in (JOB, CODE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import contract  # noqa: E402 - the trainers' events
from bench_report import figure, unmeasured  # noqa: E402

RESULT = "BENCH_RESULT "  # a worker process's last line: its answer as JSON
LOG_EVERY = 5  # train.py's log.interval here: a step mark every 5 steps (a sync each, as in a real run)


@dataclass(frozen=True)
class Mode:
    name: str  # gpu or cpu
    trainer_steps: int  # the trainer part's run: steps 1..this, window LOG_EVERY..this
    stall_target_s: float  # training between two checkpoints in the stall part
    bare_steps: int
    candidate_steps: int
    sigterm_nproc: int
    finetune: dict  # the Llama's shape and the fine-tune's settings
    finetune_methods: tuple[str, ...]
    budget_s: float

    @property
    def cuda(self) -> bool:
        return self.name == "gpu"


GPU = Mode("gpu", trainer_steps=30, stall_target_s=10.0, bare_steps=10, candidate_steps=20, sigterm_nproc=1,
           finetune={"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "block": 256, "batch": 8},
           finetune_methods=("lora", "full", "fsdp"), budget_s=450)
CPU = Mode("cpu", trainer_steps=15, stall_target_s=0.5, bare_steps=5, candidate_steps=10, sigterm_nproc=1,
           finetune={"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "block": 32, "batch": 4},
           finetune_methods=("lora",), budget_s=900)  # full: the same code, a --set (tests/test_finetune.py runs it)
# The CPU mode's model: train.py's tests' size, 4 micro-steps a step (so a probe has 1, 2, 4 to try).
CPU_CONFIG = """model: {n_layer: 2, n_head: 2, n_embd: 64, block_size: 64, vocab_size: 256, dropout: 0.0, bias: false}
train: {batch_size: 8, grad_accum_steps: 4, max_steps: 100, learning_rate: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 2, seed: 7}
eval: {interval: 100, steps: 1}
checkpoint: {interval: 100, keep: 2}
log: {interval: 5}
system: {dtype: float32, compile: false}
"""
GPU_DATA_TOKENS = 8 << 20  # random GPT-2 token ids: the step's speed does not care what they say


# -- running trainers ---------------------------------------------------------------------------

@dataclass
class Trace:
    """A trainer process as it ran: its exit code, lines, and when (monotonic) each event came."""

    code: int | None = None
    lines: list[str] = field(default_factory=list)
    events: list[tuple[float, dict]] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    stop_sent: float | None = None
    out_of_time: bool = False  # killed at its timeout (the budget), not ended by itself

    def marks(self) -> dict[int, float]:
        """Step -> when its `step` event came (the first time)."""
        found: dict[int, float] = {}
        for at, record in self.events:
            if record.get("event") == "step":
                found.setdefault(record["step"], at)
        return found

    def first(self, kind: str) -> dict | None:
        return next((record for _, record in self.events if record.get("event") == kind), None)

    def all(self, kind: str) -> list[dict]:
        return [record for _, record in self.events if record.get("event") == kind]

    def tail(self) -> str:
        return "".join(self.lines[-25:])


def stream(command: list[str], env: dict, timeout: float, stop_at_step: int | None = None) -> Trace:
    """Run `command`, reading its events as they come; SIGTERM it at the first step event at or
    past `stop_at_step` (counted from the first step it trains); kill it at `timeout`."""
    trace = Trace(started=time.monotonic())
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT)
    def out_of_time():
        trace.out_of_time = True
        proc.kill()

    timer = threading.Timer(max(timeout, 1.0), out_of_time)
    timer.start()
    first_step = None
    try:
        for line in proc.stdout:
            trace.lines.append(line)
            record = contract.parse_event(line)
            if record is None:
                continue
            trace.events.append((time.monotonic(), record))
            if record.get("event") == "step" and stop_at_step is not None and trace.stop_sent is None:
                first_step = record["step"] if first_step is None else first_step
                if record["step"] - first_step + 1 >= stop_at_step:
                    trace.stop_sent = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
        trace.code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    trace.ended = time.monotonic()
    return trace


def speed(trace: Trace, tokens_per_step: int, first: int, last: int) -> float:
    """Tokens/s between the step events of `first` and `last` (wall clock: saves between count)."""
    marks = trace.marks()
    if first not in marks or last not in marks:
        raise RuntimeError(f"no step events of steps {first} and {last} (saw {sorted(marks)[:40]}): {trace.tail()}")
    return tokens_per_step * (last - first) / (marks[last] - marks[first])


def step_seconds(trace: Trace, first: int, last: int) -> float:
    marks = trace.marks()
    return (marks[last] - marks[first]) / (last - first)


# -- the bench's context -------------------------------------------------------------------------

class Bench:
    """What the parts share: the mode, the work folder, the data, the config, the deadline, and
    what earlier parts measured (the trainer part's run is the floor of several others)."""

    def __init__(self, mode: Mode, work: Path, budget_s: float, candidates: list[str] | None = None):
        self.mode, self.work = mode, work
        self.candidates = candidates  # --candidate names, in order; None: every candidate
        self.deadline = time.monotonic() + budget_s
        self.data = work / "data"
        self.config = work / "train.yaml"
        self.reference: Trace | None = None  # the trainer part's run
        self.trainer_tokens: float | None = None
        self.bare: dict | None = None
        self.probe: dict | None = None
        self.every: int | None = None
        self.trace_log = work / "runs.log"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self) -> dict:
        path = os.pathsep.join([str(CODE), str(JOB), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # The fine-tune reads a model made here: a Hugging Face library that looks online is a failure.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        if not self.mode.cuda:
            env["OMP_NUM_THREADS"] = "1"  # as the pod and the tests run a CPU trainer
        return env

    def prepare(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        if self.mode.cuda:
            write_random_tokens(self.data, GPU_DATA_TOKENS, 50257)
            self.config.write_text(gpu_config())
        else:
            write_random_tokens(self.data, 200_000, 256)
            self.config.write_text(CPU_CONFIG)

    def cfg(self, sets: list[str] = ()):
        import config

        return config.load(self.config, list(sets))

    def train(self, name: str, sets: list[str], stop_at_step: int | None = None, torchrun: int = 0) -> Trace:
        """train.py (under torchrun with `torchrun` processes) on the bench's config and data, with
        --set `sets`, into a fresh folder `name` (kept: a resume reuses it)."""
        out = self.work / name
        args = [str(CODE / "train.py"), "--config", str(self.config), "--data_dir", str(self.data),
                "--output_dir", str(out)] + [item for s in sets for item in ("--set", s)]
        launcher = ([sys.executable, str(JOB / "torchrun.py"), "--standalone", f"--nproc_per_node={torchrun}"]
                    if torchrun else [sys.executable])
        trace = stream(launcher + args, self.env(), self.left(), stop_at_step)
        with open(self.trace_log, "a") as log:
            log.write(f"== {name} (exit {trace.code}, {trace.ended - trace.started:.1f} s)\n{''.join(trace.lines)}")
        return trace

    def worker(self, what: str, **args) -> dict:
        """One of this file's workers (bare loop, probe) in a process of its own: a clean GPU."""
        command = [sys.executable, str(Path(__file__)), what, json.dumps({"config": str(self.config), **args})]
        result = subprocess.run(command, capture_output=True, text=True, env=self.env(), cwd=ROOT,
                                timeout=max(self.left(), 1.0))
        answer = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]
        if result.returncode or not answer:
            raise RuntimeError(f"{what} exited {result.returncode}: {(result.stdout + result.stderr)[-2000:]}")
        return json.loads(answer[-1][len(RESULT):])

    def tokens_per_step(self, sets: list[str] = ()) -> int:
        return self.cfg(sets).tokens_per_step

    def mfu(self, tokens_per_s: float, sets: list[str] = ()) -> float | None:
        """Model FLOPs utilization against the GPU's bf16 peak (train.py's table); None on a CPU."""
        import torch

        from model import GPT
        from train import peak_flops

        cfg = self.cfg(sets)
        if not self.mode.cuda:
            return None
        with torch.device("meta"):
            flops = GPT(cfg.model).flops_per_token()
        peak = peak_flops(torch.device("cuda", 0), cfg.system.peak_tflops, cfg.system.dtype)
        return flops * tokens_per_s / peak if peak else None


def gpu_config() -> str:
    """config/conf.yaml with train.micro_batch 0 (train.batch_size a pass): the trainer part's run is
    the floor the other parts compare with, and the probe part measures conf.yaml's auto against it."""
    import yaml

    shipped = yaml.safe_load((ROOT / "config" / "conf.yaml").read_text())
    shipped["train"]["micro_batch"] = 0
    return yaml.safe_dump(shipped, sort_keys=False)


def write_random_tokens(folder: Path, tokens: int, vocab: int) -> None:
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, tokens, dtype=np.uint16).tofile(folder / "train.bin")
    rng.integers(0, vocab, tokens // 10, dtype=np.uint16).tofile(folder / "val.bin")


def base_sets(steps: int, log_every: int = LOG_EVERY) -> list[str]:
    """A run of `steps` steps with no checkpoint but the last and one batch of eval at the end."""
    return [f"train.max_steps={steps}", f"log.interval={log_every}", "checkpoint.interval=100000",
            "eval.interval=100000", "eval.steps=1"]


def finished(trace: Trace, what: str) -> Trace:
    if trace.code != 0 and trace.out_of_time:  # a compile or autotuning that outlasts --budget is not a crash
        raise RuntimeError(f"{what} was ended by the budget after {trace.ended - trace.started:.0f} s; give it a "
                           f"call of its own (--only, --candidate): {trace.tail()}")
    if trace.code != 0:
        raise RuntimeError(f"{what} exited {trace.code}: {trace.tail()}")
    return trace


# -- the parts -----------------------------------------------------------------------------------

def part_trainer(bench: Bench) -> dict:
    steps = bench.mode.trainer_steps
    trace = finished(bench.train("trainer", base_sets(steps)), "train.py")
    bench.reference = trace
    step_s = step_seconds(trace, LOG_EVERY, steps)
    # A checkpoint every ~stall_target_s of training, in whole log intervals, three in the run.
    bench.every = LOG_EVERY * max(1, min(steps // (3 * LOG_EVERY), round(bench.mode.stall_target_s / (LOG_EVERY * step_s))))
    tokens = speed(trace, bench.tokens_per_step(), LOG_EVERY, steps)
    bench.trainer_tokens = tokens
    return {}  # its figures need the bare loop's floor: part_bare writes both


def trainer_figures(bench: Bench) -> dict:
    """The trainer's tokens/s and MFU, beside the bare loop's where it ran."""
    steps, what = bench.mode.trainer_steps, describe(bench)
    tokens = bench.trainer_tokens
    bare = bench.bare or {}
    how = (f"train.py, {what}, tokens/s over steps {LOG_EVERY}..{steps} (wall clock; log.interval {LOG_EVERY}) "
           f"over the bare loop of the same model and step")
    mfu = bench.mfu(tokens)
    return {
        "gpu_trainer_tokens_per_s": figure("gpu_trainer_tokens_per_s", tokens, how, bare.get("tokens_per_s"),
                                           step_s=step_seconds(bench.reference, LOG_EVERY, steps)),
        "gpu_trainer_mfu": (figure("gpu_trainer_mfu", mfu, f"{how}: its MFU over the bare loop's (bf16 peak of "
                                   f"train.py's table)", bare.get("mfu"))
                            if mfu is not None else unmeasured("gpu_trainer_mfu", "CPU mode: no bf16 peak, no MFU")),
    }


def part_bare(bench: Bench) -> dict:
    bench.bare = bench.worker("bare", multiple=1, steps=bench.mode.bare_steps)
    figures = {"gpu_bare_tokens_per_s": figure(
        "gpu_bare_tokens_per_s", bench.bare["tokens_per_s"],
        f"a bare loop of {describe(bench)} ({bare_words(bench)}), {bench.mode.bare_steps} timed steps after "
        f"{BARE_WARMUP} of warm-up", None, mfu=bench.bare["mfu"], peak_bytes=bench.bare["peak_bytes"])}
    if bench.reference is not None:
        figures.update(trainer_figures(bench))
    return figures


def part_probe(bench: Bench) -> dict:
    cfg = bench.cfg()
    bench.probe = probe = bench.worker("probe")
    chosen = probe["chosen"] * cfg.train.batch_size
    tried = ", ".join(f"{k * cfg.train.batch_size}: {'out of memory' if p is None else f'{p / 2**30:.2f} GiB'}"
                      for k, p in probe["tried"])
    figures = {"gpu_micro_batch": figure(
        "gpu_micro_batch", chosen, f"code/speed.py's probe ({probe['how']}): the largest micro-batch under "
        f"{probe['cap'] / 2**30:.2f} GiB; tried {tried}; floor: train.batch_size", cfg.train.batch_size,
        tried=[k * cfg.train.batch_size for k, _ in probe["tried"]], peaks=[p for _, p in probe["tried"]],
        cap_bytes=probe["cap"])}
    best = bench.worker("bare", multiple=probe["chosen"], steps=bench.mode.bare_steps)
    figures["gpu_micro_batch_peak_bytes"] = (figure(
        "gpu_micro_batch_peak_bytes", best["peak_bytes"], f"the bare loop's peak memory (compiled as train.py runs) "
        f"at {chosen} sequences a pass, over the device's memory", best["device_bytes"])
        if best["peak_bytes"] is not None else
        unmeasured("gpu_micro_batch_peak_bytes", "CPU mode: no allocator peak (the probe's cap is a model of memory)"))
    figures["gpu_bare_best_tokens_per_s"] = figure(
        "gpu_bare_best_tokens_per_s", best["tokens_per_s"], f"the bare loop at {chosen} sequences a pass "
        f"({cfg.train.grad_accum_steps // probe['chosen']} passes a step) over it at {cfg.train.batch_size}",
        (bench.bare or {}).get("tokens_per_s"), mfu=best["mfu"])
    # On a GPU train.py probes by itself (auto); on a CPU auto is batch_size, so the bench's choice is set.
    setting = "train.micro_batch=auto" if bench.mode.cuda else f"train.micro_batch={chosen}"
    steps = bench.mode.trainer_steps
    trace = finished(bench.train("auto", base_sets(steps) + [setting]), "train.py (micro_batch)")
    said = next((line.split(" train: ", 1)[1].strip() for line in trace.lines if "train.micro_batch auto:" in line), None)
    tokens = speed(trace, bench.tokens_per_step(), LOG_EVERY, steps)
    reference = speed(bench.reference, bench.tokens_per_step(), LOG_EVERY, steps) if bench.reference else None
    how = (f"train.py with {setting} ({said or 'fixed'}), tokens/s over steps {LOG_EVERY}..{steps}, over the "
           f"trainer part's run (train.batch_size a pass)")
    figures["gpu_trainer_auto_tokens_per_s"] = figure("gpu_trainer_auto_tokens_per_s", tokens, how, reference,
                                                      over_bare_best=tokens / best["tokens_per_s"])
    mfu = bench.mfu(tokens)
    figures["gpu_trainer_auto_mfu"] = (
        figure("gpu_trainer_auto_mfu", mfu, f"{how}: its MFU over the bare loop's at {chosen} a pass", best["mfu"])
        if mfu is not None else unmeasured("gpu_trainer_auto_mfu", "CPU mode: no bf16 peak, no MFU"))
    return figures


def part_stall(bench: Bench) -> dict:
    if bench.reference is None or bench.every is None:
        raise RuntimeError("needs the trainer part's run (its floor) in the same invocation")
    every, tokens_per_step = bench.every, bench.tokens_per_step()
    first, last = every, 3 * every
    none = speed(bench.reference, tokens_per_step, first, last)
    runs = {}
    for name, background in (("async", "true"), ("sync", "false")):
        sets = base_sets(last, every) + [f"checkpoint.interval={every}", f"eval.interval={every * 1000}",
                                         f"checkpoint.async_save={background}"]
        runs[name] = finished(bench.train(f"stall-{name}", sets), f"train.py ({name} saves)")
    interval_s = step_seconds(bench.reference, first, last) * every
    size = checkpoint_bytes(runs["sync"])
    how = (f"train.py, {describe(bench)}, a {size / 1e6:.1f} MB checkpoint every {every} steps ({interval_s:.1f} s "
           f"of training), tokens/s over steps {first}..{last} (2 saves in it, wall clock) over the trainer part's "
           f"run with none over the same steps")
    saves = {name: [c for c in trace.all("checkpoint") if c.get("step") in (first, 2 * first)] for name, trace in runs.items()}
    final = runs["async"].first("done")
    last_wait = final_wait(runs["async"], last)
    commit = next((c["seconds"] for c in runs["async"].all("checkpoint") if c.get("step") == last), None)
    return {
        "gpu_checkpoint_stall": figure(
            "gpu_checkpoint_stall", speed(runs["async"], tokens_per_step, first, last), f"background saves: {how}",
            none, blocked_s=[c.get("blocked_seconds") for c in saves["async"]],
            save_s=[c.get("seconds") for c in saves["async"]], interval_s=interval_s, bytes=size),
        "gpu_checkpoint_stall_sync": figure(
            "gpu_checkpoint_stall_sync", speed(runs["sync"], tokens_per_step, first, last),
            f"synchronous saves: {how}", none, save_s=[c.get("seconds") for c in saves["sync"]]),
        "gpu_last_save_wait_s": figure(
            "gpu_last_save_wait_s", last_wait, f"the background-save run's last step ({last}) to its `done` event "
            f"(eval of one batch, the last checkpoint committed); floor: that checkpoint's save, request to commit",
            commit, done=bool(final)),
    }


def final_wait(trace: Trace, last: int) -> float:
    marks = trace.marks()
    done = next((at for at, record in trace.events if record.get("event") == "done"), None)
    if last not in marks or done is None:
        raise RuntimeError(f"no step {last} or done event: {trace.tail()}")
    return done - marks[last]


def checkpoint_bytes(trace: Trace) -> int:
    sizes = [c["bytes"] for c in trace.all("checkpoint") if c.get("bytes")]
    return max(sizes) if sizes else 0


def part_sigterm(bench: Bench) -> dict:
    import checkpoint

    nproc = bench.mode.sigterm_nproc
    sets = base_sets(100000, 1)
    measured, saves = [], []
    first = bench.train("sigterm", sets, stop_at_step=4, torchrun=nproc)
    stopped = checked_stop(first, bench.work / "sigterm", "the first start")
    measured.append(first.ended - first.stop_sent)
    saves.append(stop_save_seconds(first, stopped))
    again = bench.train("sigterm", sets, stop_at_step=1, torchrun=nproc)
    resumed = (again.first("resumed") or {}).get("step")
    if resumed != stopped:
        raise RuntimeError(f"the same command resumed at step {resumed}, the stop committed {stopped}: {again.tail()}")
    checked_stop(again, bench.work / "sigterm", "the resumed start")
    measured.append(again.ended - again.stop_sent)
    saves.append(stop_save_seconds(again, (again.first("stopped") or {}).get("step")))
    size = checkpoint.read_manifest(bench.work / "sigterm" / "checkpoints" / checkpoint.step_dir_name(stopped))
    nbytes = sum(e["size"] for e in size["files"].values())
    backend = "NCCL" if bench.mode.cuda and nproc > 1 else ("gloo" if nproc > 1 else "one process, no process group")
    return {"gpu_sigterm_to_exit_s": figure(
        "gpu_sigterm_to_exit_s", statistics.median(measured),
        f"SIGTERM to `python job/torchrun.py --nproc_per_node={nproc} train.py` ({backend}; {describe(bench)}) at "
        f"its 4th step, to its exit with that step committed ({nbytes / 1e6:.1f} MB); the same command resumed "
        f"there and was stopped again at its first step: the median of the two; floor: the stop's save (request "
        f"to commit)", statistics.median(saves), runs=measured, saves=saves, stopped_at=stopped, resumed_at=resumed,
        exit_codes=[first.code, again.code])}


def checked_stop(trace: Trace, out: Path, what: str) -> int:
    """The step the stop committed, checked: a `stopped` event, a committed folder of that step."""
    import checkpoint

    stopped = (trace.first("stopped") or {}).get("step")
    if trace.stop_sent is None or stopped is None:
        raise RuntimeError(f"{what}: no SIGTERM sent or no `stopped` event (exit {trace.code}): {trace.tail()}")
    if checkpoint.verify(out / "checkpoints" / checkpoint.step_dir_name(stopped)) is not None:
        raise RuntimeError(f"{what}: step {stopped} is not committed after the stop: {trace.tail()}")
    return stopped


def stop_save_seconds(trace: Trace, step: int | None) -> float | None:
    return next((c.get("seconds") for c in trace.all("checkpoint") if c.get("step") == step), None)


def part_fsdp(bench: Bench) -> dict:
    """train.py's sharded path (FSDP2, DCP shards, manifest last) stopped and resumed by the same command."""
    sets = base_sets(100000, 1) + ["train.parallelism=fsdp"]
    first = bench.train("fsdp", sets, stop_at_step=4, torchrun=1)
    stopped = checked_stop(first, bench.work / "fsdp", "the first FSDP start")
    again = bench.train("fsdp", sets, stop_at_step=1, torchrun=1)
    resumed = (again.first("resumed") or {}).get("step")
    if resumed != stopped:
        raise RuntimeError(f"the same command resumed at step {resumed}, the stop committed {stopped}: {again.tail()}")
    checked_stop(again, bench.work / "fsdp", "the resumed FSDP start")
    backend = "NCCL" if bench.mode.cuda else "no process group"
    return {"gpu_fsdp_train_resume": figure(
        "gpu_fsdp_train_resume", resumed, f"train.py, train.parallelism: fsdp, `job/torchrun.py --nproc_per_node=1` "
        f"({backend}; {describe(bench)}): SIGTERM at its 4th step, then the same command; value: the step it "
        f"resumed at; floor: the step the stop committed", stopped,
        sigterm_to_exit_s=[first.ended - first.stop_sent, again.ended - again.stop_sent],
        saves=[stop_save_seconds(first, stopped),
               stop_save_seconds(again, (again.first("stopped") or {}).get("step"))],
        exit_codes=[first.code, again.code])}


def part_finetune(bench: Bench) -> dict:
    lab = bench.work / "finetune"
    shape = bench.mode.finetune
    make_finetune_lab(lab, shape)
    methods = bench.mode.finetune_methods
    with ThreadPoolExecutor(2) as pool:  # side by side: each is mostly a process start
        results = dict(zip(methods, pool.map(lambda method: failure_or(finetune_resume, bench, lab, method), methods)))
    figures = {f"gpu_finetune_{method}_resume": unmeasured(f"gpu_finetune_{method}_resume", NOT_ON_CPU[method])
               for method in FINETUNE_METHODS if method not in methods}
    for method, got in results.items():
        key = f"gpu_finetune_{method}_resume"
        if isinstance(got, Exception):  # one method's failure is its key's reason, not the others'
            figures[key] = unmeasured(key, f"finetune {method} failed: {type(got).__name__}: {str(got)[:300]}")
            continue
        figures[key] = figure(
            key, got["resumed_at"], f"code/finetune.py, {FINETUNE_METHODS[method]}, {got['dtype']}, a random Llama of "
            f"{shape['layers']} layers of {shape['hidden']} made here: SIGTERM at its 3rd step, then the same command; "
            f"value: the step it resumed at and finished from (step {got['final']}); floor: the step the stop committed",
            got["stopped_at"], **{k: v for k, v in got.items() if k not in ("resumed_at", "stopped_at")})
    return figures


FINETUNE_METHODS = {"lora": "LoRA", "full": "full", "fsdp": "full, train.parallelism: fsdp under job/torchrun.py "
                                                           "(one process)"}
NOT_ON_CPU = {"full": "GPU only: the CPU mode fine-tunes with LoRA alone (a shorter run)",
              "fsdp": "GPU only: accelerate shards a Trainer's model only across GPUs (finetune.py exits 64 on a CPU)"}


FINETUNE_STEPS = 6


def failure_or(function, *args):
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - returned: the caller records it as that run's reason
        return error


def finetune_resume(bench: Bench, lab: Path, method: str) -> dict:
    out = lab / f"out-{method}"
    sets = ["model.method=full", "train.parallelism=fsdp"] if method == "fsdp" else [f"model.method={method}"]
    launcher = ([sys.executable, str(JOB / "torchrun.py"), "--standalone", "--nproc_per_node=1"] if method == "fsdp"
                else [sys.executable])
    command = launcher + [str(CODE / "finetune.py"), "--config", str(lab / "finetune.yaml"), "--model_dir",
                          str(lab / "model"), "--data_dir", str(lab / "data"), "--output_dir", str(out)]
    command += [item for s in sets for item in ("--set", s)]
    first = stream(command, bench.env(), bench.left(), stop_at_step=3)
    stopped = checked_stop(first, out, f"finetune {method}")
    again = stream(command, bench.env(), bench.left())
    resumed = (again.first("resumed") or {}).get("step")
    done = (again.first("done") or {}).get("step")
    if again.code != 0 or resumed != stopped or done != FINETUNE_STEPS:
        raise RuntimeError(f"finetune {method}: resumed at {resumed} (committed {stopped}), done at {done}, exit "
                           f"{again.code}: {again.tail()}")
    steps = [s for s in again.all("step") if s.get("tokens_per_s")]
    return {"stopped_at": stopped, "resumed_at": resumed, "final": done, "sigterm_to_exit_s": first.ended - first.stop_sent,
            "dtype": "bf16" if bench.mode.cuda else "float32", "exit_codes": [first.code, again.code],
            "tokens_per_s": steps[-1]["tokens_per_s"] if steps else None}


def make_finetune_lab(lab: Path, shape: dict) -> None:
    """A random Llama with a tokenizer trained here (tests/finetune_lab.py), JSONL data, a config."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from finetune_lab import make_jsonl, make_snapshot

    if lab.exists():
        shutil.rmtree(lab)
    make_snapshot(lab / "model", hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
                  kv_heads=shape["kv_heads"], positions=shape["block"])
    make_jsonl(lab / "data", 600)
    (lab / "finetune.yaml").write_text(f"""model: {{method: lora}}
lora: {{r: 8, alpha: 16, dropout: 0.05, target_modules: all-linear}}
data: {{block_size: {shape['block']}}}
train: {{batch_size: {shape['batch']}, grad_accum_steps: 2, max_steps: {FINETUNE_STEPS}, learning_rate: 1.0e-3, warmup_steps: 1, seed: 7}}
eval: {{interval: 0}}
checkpoint: {{interval: 3, keep: 2}}
log: {{interval: 1}}
""")


# code/speed.py's settings, each alone: (key, --set overrides, runs on a CPU).
CANDIDATES = [
    ("gpu_candidate_loss_chunk", ["model.loss_chunk_tokens=8192"], True),
    ("gpu_candidate_auto_loss_chunk", ["model.loss_chunk_tokens=8192", "train.micro_batch=auto"], False),
    ("gpu_candidate_attention_cudnn", ["model.attention=cudnn"], False),
    ("gpu_candidate_attention_flash", ["model.attention=flash"], False),
    ("gpu_candidate_attention_efficient", ["model.attention=efficient"], False),
    ("gpu_candidate_coordinate_descent", ["system.inductor=coordinate_descent_tuning"], False),
    ("gpu_candidate_max_autotune", ["system.compile_mode=max-autotune-no-cudagraphs"], False),
    # FSDP gathers the weights and reduces the gradients at every pass: its speed at 40 passes a step
    # and at 10 (48 sequences a pass fits an 80 GB GPU), each over DDP's at 40.
    ("gpu_candidate_fsdp", ["train.parallelism=fsdp"], False),
    ("gpu_candidate_fsdp_micro_batch_48", ["train.parallelism=fsdp", "train.micro_batch=48"], False),
]
CANDIDATE_MIN_S = 60  # a new compile and the steps: what a candidate needs left of the budget on a GPU


def candidate_names() -> list[str]:
    """The names --candidate takes: each key without its gpu_candidate_ prefix."""
    return [key.removeprefix("gpu_candidate_") for key, _, _ in CANDIDATES]


def chosen_candidates(names: list[str] | None) -> list[tuple[str, list[str], bool]]:
    """CANDIDATES in the order `names` gives them (all, in their own order, when none are given)."""
    if not names:
        return list(CANDIDATES)
    by_name = {key.removeprefix("gpu_candidate_"): (key, sets, on_cpu) for key, sets, on_cpu in CANDIDATES}
    return [by_name[name] for name in dict.fromkeys(names)]  # a name given twice runs once


def part_candidates(bench: Bench, after_each=lambda figures: None) -> dict:
    if bench.reference is None:
        raise RuntimeError("needs the trainer part's run (its floor) in the same invocation")
    steps = bench.mode.candidate_steps
    floor = speed(bench.reference, bench.tokens_per_step(), LOG_EVERY, steps)
    chosen = chosen_candidates(bench.candidates)
    named = {key for key, _, _ in chosen}
    figures = {key: unmeasured(key, "not named by --candidate in this invocation")
               for key, _, _ in CANDIDATES if key not in named}
    for key, sets, on_cpu in chosen:
        if not bench.mode.cuda and not on_cpu:
            figures[key] = unmeasured(key, f"GPU only ({' '.join(sets)}): not run in the CPU mode")
            continue
        if bench.mode.cuda and bench.left() < CANDIDATE_MIN_S:
            figures[key] = unmeasured(key, f"not reached: {bench.left():.0f} s of --budget left; run "
                                           f"`lab/benchmark.py gpu --only trainer --only candidates`")
            continue
        cpu_sets = [s.replace("micro_batch=auto", f"micro_batch={2 * bench.cfg().train.batch_size}") for s in sets]
        used = sets if bench.mode.cuda else cpu_sets
        try:
            launch = 1 if "train.parallelism=fsdp" in used else 0  # as the fsdp part runs it (NCCL's store)
            trace = finished(bench.train(key, base_sets(steps) + used, torchrun=launch), f"train.py ({' '.join(used)})")
            tokens = speed(trace, bench.tokens_per_step(), LOG_EVERY, steps)
            figures[key] = figure(key, tokens, f"train.py with {' '.join(used)}, {describe(bench)}, tokens/s over "
                                               f"steps {LOG_EVERY}..{steps} over the trainer part's run, same steps",
                                  floor, mfu=bench.mfu(tokens))
        except Exception as error:  # noqa: BLE001 - one candidate's failure is its key's reason
            figures[key] = unmeasured(key, f"{' '.join(used)} failed: {type(error).__name__}: "
                                           f"{str(error).splitlines()[0][:300] if str(error) else ''}")
        after_each(figures)
    return figures


def describe(bench: Bench) -> str:
    cfg = bench.cfg()
    m, t = cfg.model, cfg.train
    shape = f"{m.n_layer} layers of {m.n_embd}, context {m.block_size}, vocab {m.vocab_size}"
    how = "compile, bf16" if bench.mode.cuda else "float32, no compile"
    return (f"{'config/conf.yaml with train.micro_batch 0' if bench.mode.cuda else 'the CPU mode model'} ({shape}; "
            f"{how}; batch {t.batch_size} x "
            f"{t.grad_accum_steps} micro-steps = {cfg.tokens_per_step:,} tokens a step)")


def bare_words(bench: Bench) -> str:
    return ("torch.compile, bf16 autocast, fused AdamW, grad clipping, random tokens already on the GPU"
            if bench.mode.cuda else "float32, AdamW, grad clipping, random tokens")


# The aims first (MFU, stall, SIGTERM, fine-tune), then what searches for more speed.
PARTS = ("trainer", "bare", "stall", "sigterm", "finetune", "fsdp", "probe", "candidates")
PART_KEYS = {
    "trainer": ("gpu_trainer_tokens_per_s", "gpu_trainer_mfu"),
    "bare": ("gpu_bare_tokens_per_s",),
    "probe": ("gpu_micro_batch", "gpu_micro_batch_peak_bytes", "gpu_bare_best_tokens_per_s",
              "gpu_trainer_auto_tokens_per_s", "gpu_trainer_auto_mfu"),
    "stall": ("gpu_checkpoint_stall", "gpu_checkpoint_stall_sync", "gpu_last_save_wait_s"),
    "sigterm": ("gpu_sigterm_to_exit_s",),
    "finetune": ("gpu_finetune_lora_resume", "gpu_finetune_full_resume", "gpu_finetune_fsdp_resume"),
    "fsdp": ("gpu_fsdp_train_resume",),
    "candidates": tuple(key for key, _, _ in CANDIDATES),
}
# What a part needs left of --budget to be started on a GPU (seconds; a compile is ~40 s cold).
PART_MIN_S = {"trainer": 90, "bare": 40, "probe": 100, "stall": 90, "sigterm": 50, "finetune": 50, "fsdp": 60,
              "candidates": 60}


def measure(mode: Mode, work: Path, budget_s: float, only: list[str], after_each=lambda figures: None,
            candidates: list[str] | None = None) -> dict:
    """Every GPU key the parts in `only` measure, in that order (the candidates part: those named in
    `candidates`, in that order, else all); after_each(figures) after each part."""
    bench = Bench(mode, work, budget_s, candidates)
    bench.prepare()
    figures: dict[str, dict] = {}
    for part in only:
        started = time.monotonic()
        print(f"== {part} ({bench.left():.0f} s of the budget left)", flush=True)
        if mode.cuda and bench.left() < PART_MIN_S[part]:
            why = (f"not started: {bench.left():.0f} s of --budget left, the part needs about {PART_MIN_S[part]}; "
                   f"run `lab/benchmark.py gpu --only {part}`")
            figures.update({key: unmeasured(key, why) for key in PART_KEYS[part]})
            after_each(figures)
            continue
        try:
            if part == "candidates":
                got = part_candidates(bench, lambda partial: after_each({**figures, **partial}))
            else:
                got = PART_RUNNERS[part](bench)
            figures.update(got)
            if part == "trainer":  # beside the bare loop's floor if it ran already (part_bare writes them too)
                figures.update(trainer_figures(bench))
        except Exception as error:  # noqa: BLE001 - one part's failure is its keys' reason, the rest still run
            print(f"   {part} failed: {type(error).__name__}: {str(error)[-2000:]}", flush=True)
            reason = f"{part} failed: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            for key in PART_KEYS[part]:
                figures.setdefault(key, unmeasured(key, reason))
        print(f"   {part} took {time.monotonic() - started:.0f} s", flush=True)
        after_each(figures)
    return figures


PART_RUNNERS = {"trainer": part_trainer, "bare": part_bare, "probe": part_probe, "stall": part_stall,
                "sigterm": part_sigterm, "finetune": part_finetune, "fsdp": part_fsdp}


# -- the workers (each a process of its own) -------------------------------------------------------

BARE_WARMUP = 3


def bare_loop(cfg, multiple: int, steps: int) -> dict:
    """tokens/s and peak memory of the trainer's step with no trainer: the model compiled as
    train.py compiles it, autocast, AdamW (fused on a GPU), clipping; every batch already on the device."""
    import contextlib

    import torch

    import speed as speedups
    from model import GPT
    from train import peak_flops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # as train.py's Runtime
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    raw = GPT(cfg.model).to(device)
    t = cfg.train
    optimizer = raw.make_optimizer(t.weight_decay, t.learning_rate, (t.beta1, t.beta2), device.type)
    model = speedups.compiled(raw, cfg.system)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda and cfg.system.dtype == "bfloat16"
                else contextlib.nullcontext())
    passes = t.grad_accum_steps // multiple
    batch, block = t.batch_size * multiple, cfg.model.block_size
    tokens = torch.randint(cfg.model.vocab_size, (passes, batch, block + 1), device=device)
    xs = [tokens[i, :, :-1].contiguous() for i in range(passes)]
    ys = [tokens[i, :, 1:].contiguous() for i in range(passes)]

    def step() -> None:
        for x, y in zip(xs, ys):
            with autocast:
                _, loss = model(x, y)
                loss = loss / passes
            loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(BARE_WARMUP):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.monotonic() - started
    tokens_per_s = steps * cfg.tokens_per_step / seconds
    peak = peak_flops(device, cfg.system.peak_tflops, cfg.system.dtype) if cuda else 0.0
    return {"tokens_per_s": tokens_per_s, "step_s": seconds / steps,
            "mfu": raw.flops_per_token() * tokens_per_s / peak if peak else None,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "device_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None}


def probe(cfg) -> dict:
    """code/speed.py's probe, as train.py runs it for train.micro_batch: auto (on a GPU: the
    allocator's peak under PROBE_SHARE of its memory). On a CPU there is no memory to run out of:
    the probe measures its model of memory (speed.saved_bytes_peak) under a cap set between the
    peaks of 2 and 4 batches a pass, so that its back-off runs."""
    import contextlib

    import torch

    import speed as speedups
    from model import GPT

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    t = cfg.train
    optimizer = model.make_optimizer(t.weight_decay, t.learning_rate, (t.beta1, t.beta2), device.type)
    shape = (t.batch_size, cfg.model.block_size)
    candidates = speedups.multiples(t.grad_accum_steps)
    if cuda:
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cfg.system.dtype == "bfloat16"
                    else contextlib.nullcontext())
        peak_of = speedups.cuda_peak(model, optimizer, autocast, device, shape, cfg.model.vocab_size)
        total = torch.cuda.get_device_properties(device).total_memory
        cap, how = int(speedups.PROBE_SHARE * total), f"eager forward and backward, cap {speedups.PROBE_SHARE:.0%} of the GPU"
    else:
        peak_of = speedups.saved_bytes_peak(model, shape, cfg.model.vocab_size)
        low, high = peak_of(2), peak_of(4)
        cap, how = (low + high) // 2, "CPU: weights, grads, AdamW and saved activations, cap between 2 and 4 batches"
    chosen, tried = speedups.choose(candidates, peak_of, cap)
    return {"chosen": chosen, "tried": tried, "cap": cap, "how": how}


def worker_main(what: str, raw: str) -> int:
    import config

    args = json.loads(raw)
    cfg = config.load(args.pop("config"))
    result = bare_loop(cfg, **args) if what == "bare" else probe(cfg)
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
