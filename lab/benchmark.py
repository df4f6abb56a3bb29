"""Figures for docs/performance.md, measured on this machine, as ratios within one run where it matters.

    sudo .venv/bin/python lab/benchmark.py all --json F [--quick | --tiny] [--only PART]...  # every figure

all: every key of lab/bench_report.py's KEYS, each beside its floor measured in the same run, as one
JSON object ({key: {value, unit, floor, ratio, aim, meets_aim, how, detail}}, machine, started_at),
in five parts: transfer (lab/bench_transfer.py: restore and upload against s5cmd, the disk, plain
GETs and s3torchconnector; the watcher's lag), stall (checkpoint_stall below), pod
(lab/bench_pod.py: SIGTERM to exit, pod start to the first resumed step, SIGKILL to training),
growth (lab/bench_growth.py: bytes and requests per upload interval) and fsdp (lab/bench_fsdp.py:
memory per rank under DDP and FSDP, sharded saves' stall, time to S3 and restore beside
s3torchconnector's DCP writer and reader, restore bytes per node). --quick: a 100 MB checkpoint,
3 repetitions, small models (about 4 minutes on 2 loaded cores); full: 1.5 GB, 5 repetitions, the
stall model below and a pod of GPT-2 124M's shape. --tiny (the tests'): --quick with transfers of
60 MB (each file still past the ranged reads' threshold), 2 repetitions, 4 growing and 3 idle
upload intervals: the keys and the paths, no figure. A part that fails leaves its keys null with the
reason in `how`; the others still run.

    python lab/benchmark.py gpu --json F [--cpu] [--budget S] [--only PART]... [--candidate NAME]...  # every GPU figure

gpu: lab/bench_gpu.py's parts (bench_report.GPU_KEYS) on one GPU in at most 8 minutes, or on a tiny
model on a CPU (--cpu, or no CUDA): tokens/s and MFU of train.py beside a bare loop, the micro-batch
probe, checkpoint_stall, SIGTERM through torchrun, a bf16 fine-tune that resumes, speed settings.
No S3, no network: lab/gpu_check.sh runs it on a GPU machine with that machine's own torch.

    .venv/bin/python lab/benchmark.py checkpoint        # GPT-2 124M: save, verify, load
    sudo .venv/bin/python lab/benchmark.py restart      # a pod's restart: phases vs. bytes
    .venv/bin/python lab/benchmark.py checkpoint_stall  # tokens/s with checkpoints over without

checkpoint: builds config/conf.yaml's model (GPT-2 124M) on the CPU, takes one AdamW step so the
optimizer state is real, then commits a checkpoint the way train.py does (torch.save through the
hashing writer, fsync, manifest last), verifies it and loads it back. The save must fit well inside
torchrun's 30 s between SIGTERM and SIGKILL.

checkpoint_stall: trains a 42M-parameter model (510 MB of weights and AdamW state) with train.py:
with no checkpoint, with one every N steps saved synchronously (checkpoint.async_save: false) and
in the background (true); the runs with none and with background saves alternate, three of each
(--quick: one). N is chosen so that a synchronous save costs 20% of the interval. Prints each run's
tokens/s over the same window of steps (wall clock, saves included); checkpoint_stall is the
median of the ratios of each background-save run to the run with none just before it.

restart: trains a ~13M-parameter model for 2 steps through the real job.yaml (local pod runner,
local S3), then starts the Job's next pod with one more step to do, and compares each phase of
that restart with the time `aws s3 cp --recursive` takes to move the same checkpoint bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from podlab import BUCKET, ROOT, Run, local_s3, venv_path


def bench_checkpoint() -> None:
    import torch

    import checkpoint
    import config
    from model import GPT
    from train import load_optimizer_state, read_tensors

    cfg = config.load(ROOT / "config" / "conf.yaml")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = model.make_optimizer(0.1, 6e-4, (0.9, 0.95), "cpu")
    x = torch.randint(0, cfg.model.vocab_size, (1, 64))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    folder = Path(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR")))
    final = folder / checkpoint.step_dir_name(1)
    started = time.monotonic()
    with checkpoint.stage(final) as staged:
        with staged.open("model.pt") as file:
            torch.save(model.state_dict(), file)
        with staged.open("state.pt") as file:
            torch.save({"optimizer": optimizer.state_dict(), "step": 1}, file)
        staged.commit(meta={"step": 1})
    saved = time.monotonic() - started
    size = sum(p.stat().st_size for p in final.iterdir())
    started = time.monotonic()
    assert checkpoint.verify(final) is None
    verified = time.monotonic() - started
    started = time.monotonic()
    model.load_state_dict(read_tensors(final / "model.pt", torch.device("cpu")))
    load_optimizer_state(optimizer, final / "state.pt")
    loaded = time.monotonic() - started
    shutil.rmtree(folder)
    print(f"GPT-2 124M ({model.num_params() / 1e6:.1f}M parameters), checkpoint {size / 1e9:.2f} GB on {folder.parent}:")
    print(f"  save (serialize + sha256 + fsync + manifest + rename): {saved:.1f} s ({size / 1e6 / saved:.0f} MB/s)")
    print(f"  verify (sha256 of every file):                        {verified:.1f} s")
    print(f"  load (weights and optimizer state):                   {loaded:.1f} s")


STALL_MODEL = {"model__n_layer": 6, "model__n_head": 12, "model__n_embd": 768, "model__block_size": 64,
               "model__vocab_size": 256, "model__dropout": 0.0, "train__batch_size": 1,
               "train__grad_accum_steps": 1, "train__warmup_steps": 1, "log__interval": 1, "checkpoint__keep": 2}
# --quick: 4 layers of 384 (a ~90 MB checkpoint), 3 saves in the window: the method, not the 500 MB figure.
STALL_MODEL_QUICK = {**STALL_MODEL, "model__n_layer": 4, "model__n_head": 6, "model__n_embd": 384}
STALL_SHARE = 0.2  # of an interval that a synchronous save takes
STALL_SAVES = 4  # saves inside the measured window
STALL_PAIRS = 3  # runs with none and with async saves, alternating (full run; --quick: 1)


def bench_checkpoint_stall(quick: bool = False) -> dict:
    """tokens/s of the runs with no checkpoint, sync and async saves, and what the model was."""
    from podlab import write_config, write_corpus

    model, saves = (STALL_MODEL_QUICK, 3) if quick else (STALL_MODEL, STALL_SAVES)
    folder = Path(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR")))
    data = write_corpus(folder / "data")
    step_s, save_s, size = calibrate_stall(folder, model)
    every = max(2, round(save_s / STALL_SHARE * (1 - STALL_SHARE) / step_s))
    if quick:  # intervals of 3 s at least: a window of a few seconds is all noise on a shared machine
        every = max(every, math.ceil(3.0 / step_s))
    last = every * (saves + 1) + 1
    shape = f"{model['model__n_layer']} layers of {model['model__n_embd']}"
    print(f"model: {shape}, checkpoint {size / 1e6:.0f} MB; a step {step_s:.2f}s, a synchronous save "
          f"{save_s:.2f}s: a checkpoint every {every} steps, window steps {every}..{every * (saves + 1)} "
          f"({saves} saves); load average before: {os.getloadavg()[0]:.1f}")
    runs = {
        "none": {"checkpoint__interval": last, "eval__interval": last},
        "sync": {"checkpoint__interval": every, "checkpoint__async_save": False},
        "async": {"checkpoint__interval": every, "checkpoint__async_save": True},
    }
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    for name in stall_order(1 if quick else STALL_PAIRS):
        overrides = {"eval__interval": every * (last // every + 1), **runs[name]}
        cfg = write_config(folder / f"{name}.yaml", train__max_steps=last, eval__steps=1, **{**model, **overrides})
        speeds[name].append(window_speed(cfg, data, folder / name, every, every * (saves + 1)))
        print(f"  {name:<5} {speeds[name][-1]:8.0f} tokens/s (load average {os.getloadavg()[0]:.1f})")
        shutil.rmtree(folder / name)
    shutil.rmtree(folder)
    compared = stall_pairs(speeds)
    print(f"checkpoint_stall: async/none = {compared['async'][0] / compared['async'][1]:.3f} (the median of "
          f"{len(speeds['async'])} pairs), sync/none = {compared['sync'][0] / compared['sync'][1]:.3f}")
    return {"compared": compared, "runs": speeds, "shape": shape, "size": size, "every": every, "saves": saves,
            "step_s": step_s, "save_s": save_s, "share": save_s / (save_s + every * step_s)}


def stall_pairs(speeds: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """(tokens/s with saves, tokens/s with none) for async and sync, from runs made in stall_order.
    async: the pair (a run with background saves and the run with none just before it) whose ratio
    is the median; sync: its run over the mean of the runs with none either side of it. The
    machine drifts by a quarter over minutes here, more than the effect: a ratio of medians
    taken from different minutes would show that drift."""
    pairs = sorted(zip(speeds["async"], speeds["none"]), key=lambda pair: pair[0] / pair[1])
    around = speeds["none"][:2]
    return {"async": pairs[(len(pairs) - 1) // 2], "sync": (speeds["sync"][0], sum(around) / len(around))}


def stall_order(pairs: int) -> list[str]:
    """Runs with no checkpoint and with background saves alternate, so that the machine's drift
    over minutes (other tenants, the page cache) falls on both; one synchronous run after the first
    pair is its reference point."""
    order = []
    for pair in range(pairs):
        order += ["none", "async"] + (["sync"] if pair == 0 else [])
    return order


def calibrate_stall(folder: Path, model: dict = STALL_MODEL) -> tuple[float, float, int]:
    """Seconds of one training step and of one synchronous save of the stall model, and its size."""
    import torch

    import async_save
    import checkpoint
    import config
    from model import GPT
    from podlab import write_config

    cfg = config.load(write_config(folder / "calibration.yaml", **model))
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as window_speed's trainer runs
    model = GPT(cfg.model)
    optimizer = model.make_optimizer(0.1, 6e-4, (0.9, 0.95), "cpu")
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.block_size))
    times = []
    for _ in range(4):
        started = time.monotonic()
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.monotonic() - started)
    started = time.monotonic()
    final = async_save.write_step(folder / "calibration", checkpoint.step_dir_name(1), model.state_dict(),
                                  {"optimizer": optimizer.state_dict(), "step": 1}, {"step": 1}, False, 1)
    saved = time.monotonic() - started
    size = sum(p.stat().st_size for p in final.iterdir())
    shutil.rmtree(folder / "calibration")
    return sorted(times)[1], saved, size


def window_speed(cfg: Path, data: Path, out: Path, first: int, last: int) -> float:
    """Tokens/s of train.py between its `step` events (or log lines) of steps `first` and `last`
    (wall clock, so the saves in between count; the save after `last` does not)."""
    import config
    from bench_pod import trainer_mark

    tokens_per_step = config.load(cfg).tokens_per_step
    command = [sys.executable, str(ROOT / "code" / "train.py"), "--config", str(cfg), "--data_dir", str(data),
               "--output_dir", str(out)]
    # One thread, as the pod runs it: two OpenMP threads wait on the slower one whenever another
    # process takes a core, and a step here swings from 60 ms to 2 s.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        mark = trainer_mark(line)
        if mark and mark[0] == "step" and mark[1]["step"] in (first, last):
            seen.setdefault(mark[1]["step"], time.monotonic())
    assert proc.wait() == 0 and len(seen) == 2, "".join(lines[-20:])
    commits = [fields for kind, fields in filter(None, map(trainer_mark, lines)) if kind == "checkpoint"]
    saves = [c["seconds"] for c in commits if "seconds" in c]
    copies = [c["blocked_seconds"] for c in commits if c.get("blocked_seconds")]
    if not saves:  # a trainer without events: its log lines
        saves = [float(m.group(1)) for m in map(COMMITTED.search, lines) if m]
        copies = [float(m.group(1)) for m in map(COPIED.search, lines) if m]
    waits = [float(m.group(1)) for m in map(WAITED.search, lines) if m]
    if saves:
        print(f"        saves took {sum(saves) / len(saves):.2f}s on average ({len(saves)})"
              + (f"; training waited {sum(copies) / len(copies):.2f}s per copy" if copies else "")
              + (f", {len(waits)} times {sum(waits) / len(waits):.2f}s for a save in flight" if waits else ""))
    return tokens_per_step * (last - first) / (seen[last] - seen[first])


COMMITTED = re.compile(r"committed: [\d.]+ MB in ([\d.]+)s")
COPIED = re.compile(r"training waited ([\d.]+)s for the copy")
WAITED = re.compile(r"waited ([\d.]+)s for checkpoint")


def bench_restart() -> None:
    import boto3

    os.environ["PATH"] = venv_path()
    with local_s3() as endpoint:
        measure_restart(boto3.client("s3", endpoint_url=endpoint), endpoint)


def measure_restart(s3, endpoint: str) -> None:
    folder = Path(tempfile.mkdtemp())
    run = Run(s3, endpoint, folder, name="bench", train__max_steps=2, checkpoint__interval=1, eval__interval=1,
              model__n_layer=4, model__n_embd=512, model__n_head=8, model__block_size=64).stage()
    code, pod = run.run()
    assert code == 0, pod.output[-3000:]
    s3.delete_object(Bucket=BUCKET, Key=f"{run.prefix}COMPLETE")
    code, pod = run.run(TRAIN_ARGS="--set train.max_steps=3")
    assert code == 0, pod.output[-3000:]
    # The pod's events (job/contract.py), not its prose lines.
    phases = {e["name"]: e["seconds"] for e in pod.events if e["event"] == "phase" and e["state"] == "done"}
    phases.pop("final upload", None)  # after training: not part of a restart's cost
    ready = next(e["seconds"] for e in pod.events if e["event"] == "ready")
    size = sum(o["Size"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run.prefix}checkpoints/step-00000002/")["Contents"])
    started = time.monotonic()
    subprocess.run(["aws", "s3", "cp", "--recursive", "--quiet", f"{run.output_uri}checkpoints/step-00000002/",
                    str(folder / "raw")], check=True)
    raw = time.monotonic() - started
    print(f"restart of a pod with a {size / 1e6:.0f} MB checkpoint in S3 (local S3 on loopback):")
    for name, seconds in phases.items():
        print(f"  {name:<22} {seconds:5.1f} s")
    print(f"  start to training      {ready:5.1f} s")
    print(f"  plain `aws s3 cp` of the same checkpoint: {raw:.1f} s; restore/raw = {phases['restore checkpoint'] / raw:.2f}")


PARTS = ("transfer", "stall", "pod", "growth", "fsdp")


def bench_all(size: str, only: list[str], after_each=lambda figures: None) -> dict[str, dict]:
    """Every figure of bench_report.KEYS, each beside its floor measured here, now; `after_each(figures)`
    once a part is done (the JSON so far survives a run stopped later). size: full, quick or tiny."""
    import boto3

    import bench_report

    os.environ["PATH"] = venv_path()
    figures: dict[str, dict] = {}
    with local_s3() as endpoint, tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        for part in only:
            started = time.monotonic()
            print(f"== {part} (load average {os.getloadavg()[0]:.1f})", flush=True)
            try:
                figures.update(PART_RUNNERS[part](s3, endpoint, Path(tmp) / part, size))
            except Exception as error:  # noqa: BLE001 - one part's failure is its keys' reason, the rest still run
                print(f"   {part} failed: {type(error).__name__}: {str(error)[-1500:]}", flush=True)
                reason = f"{part} failed: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
                for key in PART_KEYS[part]:
                    figures.setdefault(key, bench_report.unmeasured(key, reason))
            print(f"   {part} took {time.monotonic() - started:.0f} s", flush=True)
            after_each(figures)
    return figures


# (checkpoint bytes, repetitions): --tiny keeps model.pt, a third, past s3.IN_ORDER's 16 MiB threshold.
TRANSFER_SIZES = {"full": (1_500_000_000, 5), "quick": (100_000_000, 3), "tiny": (60_000_000, 2)}
GROWTH_INTERVALS = {"full": (30, 10), "quick": (8, 5), "tiny": (4, 3)}  # (growing, idle)


def transfer_figures(s3, endpoint: str, folder: Path, size: str) -> dict[str, dict]:
    import bench_transfer

    return bench_transfer.measure(s3, endpoint, folder, *TRANSFER_SIZES[size])


def stall_figures(_s3, _endpoint: str, _folder: Path, size: str) -> dict[str, dict]:
    from bench_report import figure

    result = bench_checkpoint_stall(size != "full")
    (async_speed, async_floor), (sync_speed, sync_floor) = result["compared"]["async"], result["compared"]["sync"]
    runs = result["runs"]
    how = (f"train.py ({result['shape']}, a {result['size'] / 1e6:.0f} MB checkpoint, one thread) tokens/s over steps "
           f"{result['every']}..{result['every'] * (result['saves'] + 1)} with a checkpoint every {result['every']} "
           f"steps ({result['saves']} saves, a sync save of {result['save_s']:.2f} s, {result['share']:.0%} of an "
           f"interval) over a run with none; runs in the order {', '.join(stall_order(len(runs['async'])))}")
    return {"checkpoint_stall": figure("checkpoint_stall", async_speed,
                                       f"async saves: {how}; the pair (async, the none before it) of median ratio",
                                       async_floor, async_runs=runs["async"], none_runs=runs["none"]),
            "checkpoint_stall_sync": figure("checkpoint_stall_sync", sync_speed,
                                            f"sync saves: {how}; over the mean of the none runs either side",
                                            sync_floor, sync_runs=runs["sync"], none_runs=runs["none"])}


def pod_figures(s3, endpoint: str, folder: Path, size: str) -> dict[str, dict]:
    import bench_pod

    return bench_pod.measure(s3, endpoint, folder, full=size == "full")


def growth_figures(_s3, endpoint: str, folder: Path, size: str) -> dict[str, dict]:
    import bench_growth
    from bench_report import figure

    intervals, idle = GROWTH_INTERVALS[size]
    got = bench_growth.measure(endpoint, folder, intervals, idle)
    how = (f"`uploader.py watch` (SYNC_INTERVAL_SECONDS=1) through a counting proxy, {intervals} intervals of "
           f"{bench_growth.POINTS_PER_INTERVAL} scalars and log lines")
    return {
        "upload_bytes_per_interval": figure(
            "upload_bytes_per_interval", statistics.median(got["uploaded"]),
            f"{how}: median request-body bytes put for event files and the log per interval over the bytes written "
            f"per interval", statistics.median(got["written"]), first=got["uploaded"][0], last=got["uploaded"][-1],
            total_uploaded=sum(got["uploaded"]), total_written=sum(got["written"])),
        "idle_requests_per_interval": figure(
            "idle_requests_per_interval", got["idle_requests"],
            f"{how}, then {got['idle_intervals']} idle intervals: S3 requests per idle interval (all; floor: "
            f"status.json's one PUT)", 1, growing_files=got["idle_growing_requests"]),
    }


def fsdp_figures(s3, endpoint: str, folder: Path, size: str) -> dict[str, dict]:
    import bench_fsdp

    return bench_fsdp.measure(s3, endpoint, folder, size != "full")


PART_RUNNERS = {"transfer": transfer_figures, "stall": stall_figures, "pod": pod_figures, "growth": growth_figures,
                "fsdp": fsdp_figures}
PART_KEYS = {
    "transfer": ("restore_vs_s5cmd", "restore_vs_disk_floor", "restore_vs_get_floor", "restore_vs_s3torchconnector",
                 "upload_vs_s5cmd", "upload_vs_s3torchconnector", "upload_lag_p95_s", "s3torchconnector"),
    "stall": ("checkpoint_stall", "checkpoint_stall_sync"),
    "pod": ("sigterm_to_exit_s", "pod_start_to_first_step_s", "pod_start_to_first_step_minus_bare_torchrun_s",
            "kill_to_training_s"),
    "growth": ("upload_bytes_per_interval", "idle_requests_per_interval"),
    "fsdp": ("fsdp_state_bytes_per_rank", "fsdp_peak_rss_per_rank_mb", "fsdp_stall_toolkit_s", "fsdp_stall_dcp_async_s",
             "fsdp_to_s3_s", "fsdp_restore_s", "fsdp_restore_bytes_per_node"),
}


def run_all(args) -> int:
    import json

    import bench_report

    load, started_at, started = os.getloadavg(), time.time(), time.monotonic()
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    def write(figures: dict) -> dict:
        result = bench_report.report(figures, load, started_at, time.monotonic() - started, size)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return result

    result = write(bench_all(size, args.only or list(PARTS), write))
    for key in bench_report.KEYS:
        entry = result[key]
        print(f"{key:<46} {entry['value']!s:>10} {entry['unit']:<8} floor {entry['floor']!s:>10} "
              f"ratio {entry['ratio']!s:>7} aim {entry['aim'] or '-':<13} meets {entry['meets_aim']!s:<5} "
              f"{entry['how'] if entry['value'] is None else ''}")
    print(f"{result['seconds']:.0f} s; load average {result['machine']['load_average_at_start'][0]} at the start, "
          f"{result['machine']['load_average_at_end'][0]} at the end")
    return 0


def run_gpu(args) -> int:
    """`gpu`: lab/bench_gpu.py's parts, each key beside its floor, the JSON rewritten after each part."""
    import json

    import bench_gpu
    import bench_report

    cuda = False
    with contextlib.suppress(ImportError):
        import torch

        cuda = torch.cuda.is_available()
    mode = bench_gpu.CPU if args.cpu or not cuda else bench_gpu.GPU
    budget = args.budget or mode.budget_s
    load, started_at, started = os.getloadavg(), time.time(), time.monotonic()

    def write(figures: dict) -> dict:
        result = bench_report.report(figures, load, started_at, time.monotonic() - started, mode.name,
                                     keys=bench_report.GPU_KEYS)
        result["budget_s"] = budget
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return result

    only = args.only or list(bench_gpu.PARTS)
    unknown = sorted(set(only) - set(bench_gpu.PARTS))
    if unknown:
        print(f"benchmark.py gpu: unknown part {', '.join(unknown)}; the parts are {', '.join(bench_gpu.PARTS)}",
              file=sys.stderr)
        return 64
    unknown = sorted(set(args.candidate or ()) - set(bench_gpu.candidate_names()))
    if args.candidate and "candidates" not in only:
        print("benchmark.py gpu: --candidate picks within the candidates part; add --only candidates (and --only "
              "trainer, its floor)", file=sys.stderr)
        return 64
    if unknown:
        print(f"benchmark.py gpu: unknown candidate {', '.join(unknown)}; the candidates are "
              f"{', '.join(bench_gpu.candidate_names())}", file=sys.stderr)
        return 64
    print(f"benchmark.py gpu: {mode.name} mode, parts {', '.join(only)}, budget {budget:.0f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=os.environ.get("BENCH_DIR")))
    try:
        result = write(bench_gpu.measure(mode, work, budget, only, write, args.candidate))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for key in bench_report.GPU_KEYS:
        entry = result[key]
        print(f"{key:<36} {entry['value']!s:>12} {entry['unit']:<9} floor {entry['floor']!s:>12} "
              f"ratio {entry['ratio']!s:>7} aim {entry['aim'] or '-':<13} meets {entry['meets_aim']!s:<5} "
              f"{entry['how'] if entry['value'] is None else ''}")
    print(f"{result['seconds']:.0f} s ({mode.name} mode)" + (f"; runs kept in {work}" if args.keep else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["all", "gpu", "checkpoint", "restart", "checkpoint_stall"])
    parser.add_argument("--json", help="all, gpu: write the figures here as one JSON object")
    parser.add_argument("--quick", action="store_true",
                        help="all: 100 MB transfers, small models, fewer repetitions (minutes, not tens of them)")
    parser.add_argument("--tiny", action="store_true",
                        help="all: --quick with 60 MB transfers, 2 repetitions, 4 growing and 3 idle upload intervals "
                             "(the tests': no figure)")
    parser.add_argument("--only", action="append",
                        help=f"all: only this part (repeatable): {', '.join(PARTS)}; gpu: one of lab/bench_gpu.py's")
    parser.add_argument("--candidate", action="append",
                        help="gpu: only this speed setting in the candidates part (repeatable, run in this order)")
    parser.add_argument("--cpu", action="store_true", help="gpu: the CPU mode (tiny model) even with a GPU")
    parser.add_argument("--budget", type=float, help="gpu: seconds; parts not started in time are skipped")
    parser.add_argument("--keep", action="store_true", help="gpu: keep the runs' folders (their logs: runs.log)")
    args = parser.parse_args(argv)
    if args.what == "gpu":
        return run_gpu(args)
    if args.only and set(args.only) - set(PARTS):
        parser.error(f"--only takes {', '.join(PARTS)} for all")
    if args.what == "all":
        return run_all(args)
    {"checkpoint": bench_checkpoint, "restart": bench_restart, "checkpoint_stall": bench_checkpoint_stall}[args.what]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
