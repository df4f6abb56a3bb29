"""Train a GPT that resumes by itself, exactly, from its newest committed checkpoint.

One process (CPU, or one GPU):
    python train.py --config ../config/smoke.yaml --data_dir DATA --output_dir OUT
Every GPU of one machine (what the pod runs):
    torchrun --standalone --nproc_per_node=4 train.py --config config/conf.yaml --data_dir DATA --output_dir OUT
Override single settings with --set group.key=value (e.g. --set train.max_steps=100).
Check the config and the arguments alone, in a second, without torch or data (the pod does it first):
    python train.py --check --config config/conf.yaml --data_dir DATA --output_dir OUT [--set ...]

Resume policy: the same command on every start; the newest checkpoint in OUTPUT_DIR/checkpoints
that verifies decides (a bad one is skipped with a warning; none: a fresh start). Batches come from
generators seeded by (seed, step, micro-step) and every process's RNG state is saved, so a resumed
run ends bitwise equal to an uninterrupted one on CPU. SIGTERM/SIGINT: the step finishes and is
committed, exit 143 (130). Exit 64: bad input (the config, the data, a checkpoint of another model
shape); 1 with one line: a save failed. Writes checkpoints/, tensorboard/ and progress.json under
OUTPUT_DIR; touches $HEALTH_FILE while steps complete.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import config
import contract
from config import Config, ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML settings, e.g. config/conf.yaml")
    parser.add_argument("--data_dir", required=True, help="folder with train.bin and val.bin")
    parser.add_argument("--output_dir", required=True, help="checkpoints/, tensorboard/ go here")
    parser.add_argument("--set", action="append", default=[], metavar="GROUP.KEY=VALUE",
                        help="override one setting (repeatable)")
    parser.add_argument("--check", action="store_true",
                        help="only check the config and these arguments (no torch, no data): exit 0 or 64")
    return parser.parse_args(argv)


def check_settings(args: argparse.Namespace) -> int:
    """--check: the config with its overrides, for WORLD_SIZE processes; one line and 64 when bad."""
    try:
        config.load(args.config, args.set).check_world_size(int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return config.EXIT_BAD_INPUT
    return 0


# Before torch: the pod runs --check first, and torch's import alone takes seconds.
if __name__ == "__main__" and "--check" in sys.argv[1:]:
    sys.exit(check_settings(parse_args(None)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import checkpoint  # noqa: E402
import speed  # noqa: E402
import trainer_kit  # noqa: E402
from async_save import (AsyncSaver, NoSpace, SaveFailed, folder_bytes, folder_mb, link_best,  # noqa: E402
                        snapshot_bytes, write_step)
from model import GPT  # noqa: E402
from trainer_kit import event  # noqa: E402

EXIT_BAD_INPUT = config.EXIT_BAD_INPUT
# torch.load(weights_only=True) runs code from a crafted file before 2.6 (CVE-2025-32434), and a
# checkpoint comes from S3, which others may be able to write.
SAFE_TORCH = (2, 6)
# A checkpoint's state beyond the model and the optimizer: every process's RNG states, counters.
SNAPSHOT_SLACK = 16 << 20

# Dense bf16 tensor-core peaks per GPU (NVIDIA datasheets, TFLOP/s). Matched in order against
# torch.cuda.get_device_name(), so the more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H100", 989.4), ("H200", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("A10", 125.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
)


log = trainer_kit.logger("train")


def report_checkpoint(final: Path, nbytes: int, seconds: float, blocked_seconds: float) -> None:
    """The event of a committed save, sync or background: `seconds` from the request to the commit,
    `blocked_seconds` of those that training waited."""
    event("checkpoint", step=checkpoint.parse_step(final.name), name=final.name, state="committed",
          seconds=round(seconds, 3), blocked_seconds=round(blocked_seconds, 3), bytes=nbytes)


@dataclass
class Runtime:
    """Who this process is: rank, world size, device. DDP is on when torchrun set RANK."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    cpu_group: object = None  # collectives of CPU tensors; None: the default group (gloo)

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "Runtime":
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        return cls(rank, local_rank, world_size, device)

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if self.ddp:
            self.check_writer_on_node0()
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
            if self.device.type == "cuda":  # a per-step flag over NCCL would drain the GPU queue
                self.cpu_group = dist.new_group(backend="gloo")

    def check_writer_on_node0(self) -> None:
        """Rank 0, the writer, on node 0, the uploader (trainer_kit.writer_not_on_node0)."""
        problem = trainer_kit.writer_not_on_node0(self.rank)
        if problem:
            raise ConfigError(problem)

    def stop(self) -> None:
        if self.ddp and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peer is gone has nothing left to tear down
                pass

    def barrier(self) -> None:
        """All processes leave together: none tears down the process group while another still
        saves (a gloo peer gone mid-teardown aborts the process)."""
        if self.ddp:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over all processes."""
        if self.ddp:
            value = value.detach().clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.world_size
        return value.item()


class Batches:
    """Random windows of uint16 tokens, drawn from generators seeded by what the batch is for,
    so the data position is a pure function of (seed, step, micro-step) and resume is exact."""

    def __init__(self, data_dir: str, cfg: Config, device: torch.device):
        self.paths = {split: os.path.join(data_dir, f"{split}.bin") for split in ("train", "val")}
        self.batch_size = cfg.train.batch_size
        self.block_size = cfg.model.block_size
        self.seed = cfg.train.seed
        self.device = device

    def train(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw("train", ("train", self.seed, step, micro))

    def train_joined(self, step: int, micros: range) -> tuple[torch.Tensor, torch.Tensor]:
        """The batches of several micro-steps as one (train.micro_batch): the same sequences."""
        if len(micros) == 1:
            return self.train(step, micros[0])
        pairs = [self._draw_cpu("train", ("train", self.seed, step, micro)) for micro in micros]
        return self._to_device(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]))

    def eval(self, split: str, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(split, ("eval", self.seed, split, index, rank))

    def _draw(self, split: str, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return self._to_device(*self._draw_cpu(split, key))

    def _draw_cpu(self, split: str, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        # A fresh memmap per batch: numpy's memmap otherwise holds every page it ever touched.
        data = np.memmap(self.paths[split], dtype=np.uint16, mode="r")
        generator = torch.Generator().manual_seed(_seed_of(key))
        starts = torch.randint(len(data) - self.block_size, (self.batch_size,), generator=generator)
        x = torch.stack([torch.from_numpy(data[i:i + self.block_size].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + self.block_size].astype(np.int64)) for i in starts])
        return x, y

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y


def _seed_of(key: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1


def lr_at(step: int, train: config.TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr, then min_lr."""
    decay_steps = train.lr_decay_steps or train.max_steps
    # 1) warmup (step counts from 1)
    if step <= train.warmup_steps:
        return train.learning_rate * step / max(train.warmup_steps, 1)
    # 2) past the decay: the floor
    if step > decay_steps:
        return train.min_lr
    # 3) in between: cosine from learning_rate down to min_lr
    ratio = (step - train.warmup_steps) / max(decay_steps - train.warmup_steps, 1)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return train.min_lr + coeff * (train.learning_rate - train.min_lr)


class GroupMismatch(Exception):
    """The processes of a group would resume from different checkpoints."""


def read_tensors(path: Path, device: torch.device):
    """A checkpoint file through a memory map: its tensors are read once, as they are copied where
    they go. Without the map torch.load first copied everything into fresh memory: a 124M resume
    loaded in 1.94-2.43 s here, 1.64-1.71 s with it (a fresh process, the same files). The map
    lives only while the trainer loads; checkpoint files are never rewritten in place."""
    return torch.load(path, map_location=device, weights_only=True, mmap=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> dict:
    """state.pt's optimizer state into `optimizer`, in the trainer's own memory; state.pt's other
    entries (the RNG states, counters) are returned, still mapped until the caller drops them."""
    state = read_tensors(path, torch.device("cpu"))
    optimizer.load_state_dict(state.pop("optimizer"))
    own_copies(optimizer)
    return state


def own_copies(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's CPU state, copied out of state.pt's memory map (0.5 s for 124M here): left in
    the map, every AdamW step ran at half speed on its pages (1.4 s against 0.7 s), and the file of a
    rotated checkpoint stayed held."""
    for state in optimizer.state.values():
        if not isinstance(state, dict):  # load_state_dict keeps what it does not know as it came
            continue
        for key, value in state.items():
            if torch.is_tensor(value) and value.device.type == "cpu":
                state[key] = value.clone()


def rng_state(device: torch.device) -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def arithmetic(device: torch.device) -> dict:
    """What besides the state decides a step's floating-point result: a resume is bitwise exact only
    where these are the checkpoint's (one and two OpenMP threads round the same CPU matmul differently)."""
    return {"torch": str(torch.__version__), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def arithmetic_changes(saved, now: dict) -> list[str]:
    """'name saved -> now' for each that differs; none for a checkpoint that recorded nothing."""
    if not isinstance(saved, dict):
        return []
    return [f"{key} {shown(saved[key])} -> {shown(now[key])}" for key in now
            if key in saved and isinstance(saved[key], (str, int, type(None))) and saved[key] != now[key]]


def shown(value) -> str:
    """A value read from a checkpoint, fit for one log line: a bucket writer cannot forge a line."""
    return contract.printable(str(value))[:80]


def gather_rng_states(rt: Runtime) -> list[dict]:
    """Every process's RNG state (dropout), collected on every rank; rank 0 saves them."""
    state = rng_state(rt.device)
    if not rt.ddp:
        return [state]
    states = [None] * rt.world_size
    dist.all_gather_object(states, state)
    return [{k: (v.cpu() if v is not None else None) for k, v in s.items()} for s in states]


def reseed(seed: int, step: int, rt: Runtime, saved_by: int) -> None:
    """A sharded checkpoint resumed by another number of processes: each draws from a seed of
    (seed, step, rank), the same on every resume of that checkpoint at this world size."""
    if rt.master:
        log(f"the checkpoint was saved by {saved_by} process(es), this run has {rt.world_size}: each process's "
            f"RNG (dropout) is seeded anew from (seed, step, rank)")
    torch.manual_seed(_seed_of(("rng", seed, step, rt.rank)))
    if rt.device.type == "cuda":
        torch.cuda.manual_seed(_seed_of(("cuda rng", seed, step, rt.rank)))


def check_same_parallelism(meta: dict, parallelism: str, name: str) -> None:
    """A sharded checkpoint (DCP files) and a DDP one (model.pt, state.pt) do not load into each other."""
    saved = "fsdp" if isinstance(meta.get("shards"), dict) else "ddp"
    if saved != parallelism:
        raise ConfigError(f"checkpoint {name} was saved with train.parallelism={saved}, the config says "
                          f"{parallelism}; set train.parallelism: {saved}, or use a new S3_OUTPUT_URI")


def restore_rng(states: list[dict], rt: Runtime) -> None:
    if len(states) != rt.world_size:
        log(f"warning: checkpoint has RNG states of {len(states)} processes, this run has "
            f"{rt.world_size}; dropout draws will differ from an uninterrupted run")
        return
    torch.set_rng_state(states[rt.rank]["cpu"])
    if rt.device.type == "cuda" and states[rt.rank]["cuda"] is not None:
        torch.cuda.set_rng_state(states[rt.rank]["cuda"], rt.device)


class Trainer:
    def __init__(self, cfg: Config, args: argparse.Namespace, rt: Runtime):
        self.cfg, self.args, self.rt = cfg, args, rt
        self.out = Path(args.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.heartbeat = trainer_kit.Heartbeat(os.environ.get("HEALTH_FILE") if rt.local_rank == 0 else None)
        self.stop = trainer_kit.StopSignal().install()
        self.batches = Batches(args.data_dir, cfg, rt.device)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if rt.device.type == "cuda" and cfg.system.dtype == "bfloat16"
                         else contextlib.nullcontext())
        self.step = 0
        self.best_val_loss = float("inf")
        self.best_step = 0
        self.val_loss = None
        self.train_loss = None
        self.speed: dict = {}
        self.start_step: int | None = None  # set once loaded: steps past it were trained here
        self.hashed_by = "trainer"  # who hashed the checkpoint resumed from against its manifest
        self.started = time.monotonic()
        self.micro_multiple = 1  # batches per forward pass (train.micro_batch), set once built
        self.saved_micro_batch: int | None = None  # sequences a pass the checkpoint resumed from ran

        self.raw_model: GPT | None = None  # built by load(), once it knows whether a checkpoint fills it
        self.optimizer: torch.optim.Optimizer | None = None
        self.writer = None
        # FSDP: every rank saves its own shards, so every rank has a save process; DDP: rank 0's.
        self.shards = None
        fsdp = cfg.train.parallelism == "fsdp"
        self.saver = (AsyncSaver(rt.device, log if rt.master else _quiet, self.heartbeat.beat,
                                 on_commit=report_checkpoint if rt.master else lambda *_: None,
                                 preload=("sharded",) if fsdp else ())
                      if cfg.checkpoint.async_save and (rt.master or fsdp) else None)
        if fsdp:
            import sharded  # torch.distributed.fsdp and .checkpoint: only for the runs that use them

            self.shards = sharded.ShardedCheckpoints(rt.rank, rt.world_size, rt.cpu_group, log, self.saver)

    # -- checkpoints ---------------------------------------------------------------------------

    def load(self) -> None:
        """Build the model and continue from the newest valid checkpoint, if there is one."""
        name = self._checkpoint_to_resume()
        self._build(resuming=name is not None)
        if name is None:
            if self.rt.master:
                log("no committed checkpoint: starting from step 0")
                event("resumed", step=0, name=None, seconds=0.0)
            return
        self._load_from(self.ckpt_root / name)

    def _checkpoint_to_resume(self) -> str | None:
        """Rank 0's choice, the same on every process."""
        name = None
        if self.rt.master:
            checkpoint.remove_staging_leftovers(self.ckpt_root)
            verified = checkpoint.read_verified(os.environ.get("RESTORE_VERIFIED_FILE"))  # the pod's restore
            folder = checkpoint.newest_valid(self.ckpt_root, on_skip=self._drop_bad_checkpoint, verified=verified)
            name = folder.name if folder else None
            self.hashed_by = "restore" if folder and checkpoint.is_verified(folder, verified) else "trainer"
        if self.rt.ddp:
            box = [name]
            dist.broadcast_object_list(box, src=0)
            name = box[0]
            self._check_every_rank_has(name)
        return name

    def _build(self, resuming: bool) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every process
        if self.shards:
            import sharded

            self.raw_model = sharded.build(lambda: GPT(cfg.model), lambda model: model.transformer.h, self.rt.device,
                                           cfg.system.dtype == "bfloat16", resuming)
        else:
            self.raw_model = (GPT.empty(cfg.model, self.rt.device) if resuming
                              else GPT(cfg.model).to(self.rt.device))
        self.optimizer = self.raw_model.make_optimizer(
            cfg.train.weight_decay, cfg.train.learning_rate, (cfg.train.beta1, cfg.train.beta2),
            self.rt.device.type)
        torch.manual_seed(cfg.train.seed + 1 + self.rt.rank)  # dropout draws differ per process

    def _check_every_rank_has(self, name: str | None) -> None:
        """In a group of pods each node restored node 0's choice from S3; one that has another
        (a newer step landed between two nodes' restores) must not load different weights."""
        has = name is None or checkpoint.is_committed(self.ckpt_root / name)
        missing = torch.tensor([0 if has else 1])
        dist.all_reduce(missing, op=dist.ReduceOp.SUM, group=self.rt.cpu_group)
        if missing.item():
            raise GroupMismatch(f"{missing.item()} process(es) have no committed {name}, which rank 0 resumes "
                                f"from; the group restarts and every node restores it again")

    def _drop_bad_checkpoint(self, folder: Path, problem: str) -> None:
        log(f"warning: skipping checkpoint {folder.name}: {problem}; falling back to the one before it")
        checkpoint.discard(folder)

    def _load_from(self, folder: Path) -> None:
        started = time.monotonic()
        problem = torch_version_problem(torch.__version__)
        if problem:
            raise ConfigError(problem)
        meta = checkpoint.read_manifest(folder)["meta"]
        config.check_same_model(meta.get("model", {}), self.cfg, f"checkpoint {folder.name}")
        check_same_parallelism(meta, self.cfg.train.parallelism, folder.name)
        try:
            if self.shards:
                state = self.shards.load(folder, self.raw_model, self.optimizer)
            else:
                self.raw_model.load_state_dict(read_tensors(folder / "model.pt", self.rt.device))
                state = None
        except (RuntimeError, KeyError, ValueError) as err:
            first = str(err).strip().splitlines()[-1].strip()
            raise ConfigError(f"checkpoint {folder.name} does not fit this model ({first}); use the "
                              f"config it was trained with, or a new S3_OUTPUT_URI") from None
        if state is None:
            state = load_optimizer_state(self.optimizer, folder / "state.pt")
        if self.shards and len(state["rng"]) != self.rt.world_size:
            reseed(self.cfg.train.seed, state["step"], self.rt, len(state["rng"]))
        else:
            restore_rng(state["rng"], self.rt)
        changes = arithmetic_changes(state.get("arithmetic"), arithmetic(self.rt.device))
        if changes and self.rt.master:
            log(f"warning: {', '.join(changes)} since {folder.name} was saved: the steps from here will not be "
                f"bitwise those of an uninterrupted run; resume with what it had (e.g. OMP_NUM_THREADS) for that")
        self.step = state["step"]
        self.best_val_loss = state["best_val_loss"]
        self.best_step = state["best_step"]
        self.val_loss = state.get("val_loss")
        self.train_loss = state.get("train_loss")
        self.saved_micro_batch = speed.saved_micro_batch(state)
        if self.rt.master:
            log(f"resumed from {folder.name} (step {self.step}) in {time.monotonic() - started:.1f}s")
            if self.step >= self.cfg.train.max_steps:
                log(f"step {self.step} is at or past train.max_steps ({self.cfg.train.max_steps}): the run is done, "
                    f"nothing to train")
            event("resumed", step=self.step, name=folder.name, seconds=round(time.monotonic() - started, 3),
                  hashed_by=self.hashed_by)
            if self.best_step == self.step:
                # A pod that died between committing this step and linking it as best/ left best/ behind.
                self._link_best(folder)

    def save(self, is_best: bool, durable: bool = True) -> None:
        """Checkpoint this step (a collective: every rank calls it, rank 0 writes). With a saver,
        it returns once the state is copied; the commit follows in the background. Not `durable`:
        its files are not fsynced (the save as the pod goes; a sharded save fsyncs regardless)."""
        rng = gather_rng_states(self.rt)
        if self.shards:
            self._save_shards(rng, is_best)
            return
        if not self.rt.master:
            return
        final = self.ckpt_root / checkpoint.step_dir_name(self.step)
        if checkpoint.is_committed(final):
            if is_best:
                self.wait_for_saves()  # best/ is linked by one writer at a time
                self._link_best(final)
            return
        self._write_checkpoint(final, rng, is_best, durable)

    def wait_for_saves(self) -> None:
        """Until the save in flight (if any) is committed."""
        if self.saver:
            with self._saver_errors():
                self.saver.wait()

    def check_saves(self) -> None:
        """Log a background save that finished; a failed one stops the run (SaveFailed)."""
        if self.saver:
            with self._saver_errors():
                self.saver.poll()

    @contextlib.contextmanager
    def _saver_errors(self):
        try:
            yield
        except NoSpace as err:
            raise self._no_space(err.filename) from None

    def _no_space(self, name: str) -> ConfigError:  # the next pod would fail the same way
        return ConfigError(f"no space left in {self.out} for checkpoint {name}; give the workspace volume "
                           f"more room (emptyDir sizeLimit) or lower checkpoint.keep ({self.cfg.checkpoint.keep})")

    def _save_shards(self, rng: list[dict], is_best: bool) -> None:
        """Every rank writes its shards (sharded.py); rank 0's view of what is committed decides."""
        final = self.ckpt_root / checkpoint.step_dir_name(self.step)
        box = [checkpoint.is_committed(final) if self.rt.master else None]
        if self.rt.ddp:
            dist.broadcast_object_list(box, src=0, group=self.rt.cpu_group)
        if box[0]:
            if is_best and self.rt.master:
                self.wait_for_saves()  # best/ is linked by one writer at a time
                self._link_best(final)
            return
        started = time.monotonic()
        try:
            with self._saver_errors():
                self.shards.save(final, self.raw_model, self.optimizer, self._train_state(rng), self._meta(),
                                 is_best, self.cfg.checkpoint.keep)
        except OSError as err:  # a synchronous save's full disk (a background one's is NoSpace)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(final.name) from None
            raise
        if not self.saver and self.rt.master:
            seconds = time.monotonic() - started
            log(f"checkpoint {final.name} committed: {folder_mb(final):.1f} MB in {seconds:.2f}s")
            report_checkpoint(final, folder_bytes(final), seconds, blocked_seconds=seconds)

    def _train_state(self, rng: list[dict]) -> dict:
        """Everything a checkpoint holds beside the weights and the optimizer state."""
        return {
            "step": self.step,
            "rng": rng,
            "best_val_loss": self.best_val_loss,
            "best_step": self.best_step,
            "val_loss": self.val_loss,
            "train_loss": self.train_loss,
            # Batches are a pure function of (seed, step, micro-step): the data position is the step.
            "data": {"next_step": self.step + 1, "seed": self.cfg.train.seed},
            "config": self.cfg.to_dict(),
            "world_size": self.rt.world_size,
            "micro_batch": self.micro_multiple * self.cfg.train.batch_size,  # sequences a forward pass
            "arithmetic": arithmetic(self.rt.device),
        }

    def _write_checkpoint(self, final: Path, rng: list[dict], is_best: bool, durable: bool) -> None:
        started = time.monotonic()
        state = {"optimizer": self.optimizer.state_dict(), **self._train_state(rng)}
        keep = self.cfg.checkpoint.keep
        if self.saver:
            with self._saver_errors():
                self.saver.submit(self.ckpt_root, final.name, self.raw_model.state_dict(), state, self._meta(),
                                  is_best, keep, durable)
            return
        try:
            write_step(self.ckpt_root, final.name, self.raw_model.state_dict(), state, self._meta(), is_best,
                       keep, beat=self.heartbeat.beat, durable=durable)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(final.name) from None
            raise
        seconds = time.monotonic() - started
        log(f"checkpoint {final.name} committed: {folder_mb(final):.1f} MB in {seconds:.2f}s")
        report_checkpoint(final, folder_bytes(final), seconds, blocked_seconds=seconds)

    def _link_best(self, source: Path) -> None:
        if checkpoint.absent_files(checkpoint.read_manifest(source) or {}):
            log(f"best/ stays as it is: {source.name} here holds only this node's shard files")
            return
        link_best(self.ckpt_root, source, self._meta())

    def _meta(self) -> dict:
        return {"step": self.step, "max_steps": self.cfg.train.max_steps, "keep": self.cfg.checkpoint.keep,
                "train_loss": self.train_loss, "val_loss": self.val_loss,
                "best_val_loss": trainer_kit.finite(self.best_val_loss), "best_step": self.best_step,
                "model": self.cfg.to_dict()["model"], "world_size": self.rt.world_size}

    # -- training ------------------------------------------------------------------------------

    def run(self) -> int:
        self.load()
        start_step = self.start_step = self.step
        speed.check_device(self.cfg, self.rt.device)
        self.micro_multiple = self._micro_multiple()
        local_steps = self.cfg.train.grad_accum_steps // self.rt.world_size
        speed.check_cuda_graphs(self.cfg.system, self.rt.device, local_steps // self.micro_multiple,
                                local_steps * self.cfg.train.batch_size)
        model = speed.compiled(self.raw_model, self.cfg.system)
        if self.rt.ddp and not self.shards:  # FSDP's model is sharded as it is built (_build)
            model = DDP(model, device_ids=[self.rt.local_rank] if self.rt.device.type == "cuda" else None)
        if self.rt.master:
            self._open_tensorboard(start_step)
            self._describe(start_step)
        if self.saver and self.step < self.cfg.train.max_steps:
            self.saver.start()  # it imports torch while training starts, not at the first save
        meter = Meter(self, start_step)
        self.heartbeat.beat()
        if self.rt.master:
            self._write_progress()
        try:
            while self.step < self.cfg.train.max_steps:
                loss = self._train_step(model)
                self.step += 1
                self.heartbeat.beat()
                if self.step == start_step + 1:
                    self._reserve_snapshot()
                self._keep(meter.after_step(loss))
                paused = time.monotonic()
                self._evaluate_and_save(model)
                self.check_saves()
                meter.pause(time.monotonic() - paused)
                signum = self.stop.agreed(self.rt.cpu_group)
                if signum:
                    return self._stop_for(signum)
            self._finish()
            return 0
        finally:
            if self.saver:
                self.saver.close()  # after an error too: a save under way is still a good checkpoint
            if self.writer:
                self.writer.close()

    def _micro_multiple(self) -> int:
        """train.micro_batch as batches per forward pass; auto probes this GPU (speed.py), and the
        processes take the smallest any of them found room for."""
        local_steps = self.cfg.train.grad_accum_steps // self.rt.world_size
        peak_of = None
        if self.rt.device.type == "cuda" and not self.shards:  # FSDP's passes are collectives: no probe
            peak_of = speed.cuda_peak(self.raw_model, self.optimizer, self.autocast, self.rt.device,
                                      (self.cfg.train.batch_size, self.cfg.model.block_size),
                                      self.cfg.model.vocab_size)
        multiple = speed.micro_multiple(self.cfg, self.rt.device, local_steps, peak_of,
                                        log if self.rt.master else _quiet)
        if self.cfg.train.micro_multiple() is not None:
            return multiple
        if self.rt.ddp:
            agreed = torch.tensor([multiple])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.rt.cpu_group)
            multiple = int(agreed.item())
        if self.step > 0:  # resumed: every rank read the same checkpoint, so all decide alike
            multiple, line = speed.resumed_multiple(self.saved_micro_batch, self.cfg.train.batch_size, multiple,
                                                    local_steps)
            if line and self.rt.master:
                log(line)
        return multiple

    def _reserve_snapshot(self) -> None:
        """After the first step the optimizer holds its state: the background save's buffer is set
        aside now, its pages touched by a thread, so the first save waits only for the copy."""
        if self.saver and self.shards:
            tree = self.shards.snapshot_tree(self.raw_model, self.optimizer)
            self.saver.reserve(snapshot_bytes(tree) + SNAPSHOT_SLACK)
        elif self.saver and self.rt.master:
            state = {"model": self.raw_model.state_dict(), "state": {"optimizer": self.optimizer.state_dict()}}
            self.saver.reserve(snapshot_bytes(state) + SNAPSHOT_SLACK)

    def _keep(self, measured: tuple[float, dict | None] | None) -> None:
        """What the meter measured on a logging step: the loss for every rank, the speed on rank 0."""
        if measured is None:
            return
        self.train_loss, speed = measured
        if speed is not None:
            self.speed = speed

    def _train_step(self, model) -> torch.Tensor:
        lr = lr_at(self.step + 1, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        local_steps = self.cfg.train.grad_accum_steps // self.rt.world_size
        # train.micro_batch: `joined` micro-steps' batches in one pass; each pass's mean loss then
        # weighs as many micro-steps, and the sum is the same step (the same data, other rounding).
        joined = self.micro_multiple
        passes = local_steps // joined
        total = torch.zeros((), device=self.rt.device)
        for i in range(passes):
            first = self.rt.rank * local_steps + i * joined
            x, y = self.batches.train_joined(self.step + 1, range(first, first + joined))
            # DDP averages gradients across processes only on the last micro-step; FSDP reduces
            # them to shards at every one (a whole unsharded gradient would cost the memory it saves).
            sync = not self.rt.ddp or self.shards is not None or i == passes - 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                speed.mark_step(self.cfg.system, self.rt.device)
                with self.autocast:
                    _, loss = model(x, y)
                    loss = loss / passes
                loss.backward()
            total += loss.detach()
            self.heartbeat.beat()
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _evaluate_and_save(self, model) -> None:
        last = self.step == self.cfg.train.max_steps
        is_best = False
        if self.step % self.cfg.eval.interval == 0 or last:
            self.val_loss = self._evaluate(model)
            is_best = self.val_loss < self.best_val_loss
            if is_best:
                self.best_val_loss, self.best_step = self.val_loss, self.step
            if self.rt.master:
                log(f"step {self.step}: val loss {_show(self.val_loss)} (best {_show(self.best_val_loss)} at step {self.best_step})")
                self.writer.add_scalar("val/loss", self.val_loss, self.step)
                self.writer.flush()
        saving = self.step % self.cfg.checkpoint.interval == 0 or last
        if saving:
            self.save(is_best)
        # What the pod reports: fresh at each log line and checkpoint, not rewritten every step.
        if self.rt.master and (saving or self.step % self.cfg.log.interval == 0):
            self._write_progress()

    @torch.no_grad()
    def _evaluate(self, model) -> float:
        model.eval()
        total = torch.zeros((), device=self.rt.device)
        for index in range(self.cfg.eval.steps):
            x, y = self.batches.eval("val", index, self.rt.rank)
            speed.mark_step(self.cfg.system, self.rt.device)
            with self.autocast:
                _, loss = model(x, y)
            total += loss.float()
            self.heartbeat.beat()
        model.train()
        return self.rt.mean(total / self.cfg.eval.steps)

    def _stop_for(self, signum: int) -> int:
        name = signal.Signals(signum).name
        # Recorded for torchrun's error file: a node that got no signal itself (a peer did) still exits 128+N.
        config.record_exit(128 + signum, f"stopped after {name} (the step is committed)")
        if self.rt.master:
            log(f"{name}: step {self.step} finished; committing a checkpoint of it before exit")
        self.wait_for_saves()  # this step may be the one in flight: then it is committed now
        # In a pod not fsynced (trainer_kit.stop_save_durable): the fsync was most of the save on a
        # disk that waits for it (docs/performance.md).
        self.save(is_best=False, durable=trainer_kit.stop_save_durable())
        self.wait_for_saves()
        if self.rt.master:
            event("stopped", signal=name, step=self.step)
            self._write_progress()
            if self.writer:
                self.writer.flush()
        self.rt.barrier()
        return 128 + signum

    def _finish(self) -> None:
        self.wait_for_saves()  # the runtime takes exit 0 to mean the last step is committed
        if self.rt.master:
            minutes = (time.monotonic() - self.started) / 60
            log(f"done: step {self.step}, train loss {_show(self.train_loss)}, val loss {_show(self.val_loss)}, "
                f"best val loss {_show(self.best_val_loss)} at step {self.best_step}, {minutes:.1f} min")
            event("done", step=self.step)
        self.rt.barrier()

    # -- what a person sees ----------------------------------------------------------------------

    def _open_tensorboard(self, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides the steps an earlier start logged after its last checkpoint: they are redone.
        self.writer = SummaryWriter(log_dir=str(self.out / "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None, flush_secs=10)

    def _describe(self, start_step: int) -> None:
        cfg = self.cfg
        log(f"model: {self.raw_model.num_params() / 1e6:.2f}M parameters, {cfg.model.n_layer} layers, "
            f"device {self.rt.device.type}, {self.rt.world_size} process(es), {cfg.tokens_per_step:,} tokens/step, "
            f"steps {start_step + 1}..{cfg.train.max_steps}")

    def _write_progress(self) -> None:
        trainer_kit.write_progress(self.out, step=self.step, start_step=self.start_step,
                                   max_steps=self.cfg.train.max_steps, train_loss=self.train_loss,
                                   val_loss=self.val_loss, best_val_loss=self.best_val_loss,
                                   best_step=self.best_step, speed=self.speed)


class Meter:
    """Step timing, tokens/s, MFU and ETA, logged every log.interval steps. It reads the trainer and
    writes none of its fields: after_step returns what it measured, for the trainer to keep."""

    def __init__(self, trainer: Trainer, start_step: int):
        self.t = trainer
        cfg = trainer.cfg
        peak = peak_flops(trainer.rt.device, cfg.system.peak_tflops, cfg.system.dtype)
        self.peak_flops = peak * trainer.rt.world_size
        self.flops_per_token = trainer.raw_model.flops_per_token()
        self.since = time.monotonic()
        self.steps = 0

    def pause(self, seconds: float) -> None:
        """Leave out time spent off training steps (evaluation, saves): speed is of steps alone."""
        self.since += seconds

    def after_step(self, loss: torch.Tensor) -> tuple[float, dict | None] | None:
        """(the mean loss, the speed on rank 0, None elsewhere) on a logging step; None otherwise."""
        self.steps += 1
        step = self.t.step
        if step % self.t.cfg.log.interval and step != self.t.cfg.train.max_steps:
            return None
        loss_value = self.t.rt.mean(loss)  # .item() waits for the GPU, so the timing below is real
        elapsed = time.monotonic() - self.since
        ms_per_step = 1000 * elapsed / self.steps
        tokens_per_sec = self.t.cfg.tokens_per_step * self.steps / elapsed
        self.since, self.steps = time.monotonic(), 0
        if not self.t.rt.master:
            return loss_value, None
        eta = (self.t.cfg.train.max_steps - step) * ms_per_step / 1000
        lr = self.t.optimizer.param_groups[0]["lr"]
        line = (f"step {step}/{self.t.cfg.train.max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                f"{ms_per_step:.1f} ms/step | {tokens_per_sec:,.0f} tok/s")
        speed = {"tokens_per_sec": tokens_per_sec, "ms_per_step": ms_per_step, "eta_seconds": eta}
        if self.peak_flops:
            mfu = self.flops_per_token * tokens_per_sec / self.peak_flops
            line += f" | mfu {100 * mfu:.1f}%"
            speed["mfu"] = mfu
            self.t.writer.add_scalar("mfu", mfu, step)
        log(f"{line} | eta {_duration(eta)}")
        event("step", step=step, max_steps=self.t.cfg.train.max_steps, loss=trainer_kit.finite(loss_value),
              ms_per_step=ms_per_step, tokens_per_s=tokens_per_sec,
              **({"mfu": speed["mfu"]} if "mfu" in speed else {}))
        self.t.writer.add_scalar("train/loss", loss_value, step)
        self.t.writer.add_scalar("lr", lr, step)
        self.t.writer.add_scalar("tokens_per_sec", tokens_per_sec, step)
        return loss_value, speed


def peak_flops(device: torch.device, override_tflops: float, dtype: str = "bfloat16") -> float:
    """Peak bf16 FLOP/s of one GPU, or 0 where unknown or not bf16 (then no MFU is shown rather
    than a guess)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda" or dtype != "bfloat16":
        return 0.0
    name = torch.cuda.get_device_name(device)
    for marker, tflops in PEAK_BF16_TFLOPS:
        if marker in name:
            return tflops * 1e12
    log(f"no bf16 peak known for {name!r}: set system.peak_tflops to see MFU")
    return 0.0


def _quiet(_message: str) -> None:
    """A rank other than 0 logs nothing of its background saves: rank 0 speaks for them."""


def _show(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def torch_version_problem(version: str) -> str | None:
    """None when this torch may unpickle a checkpoint, else one line saying why not and the fix."""
    match = re.match(r"([0-9]+)\.([0-9]+)", version)
    if match and (int(match.group(1)), int(match.group(2))) >= SAFE_TORCH:
        return None
    return (f"torch {version} cannot load a checkpoint safely (torch.load runs code from a crafted file "
            f"before 2.6, CVE-2025-32434); use an image with torch>=2.6")


def report_bad_input(err: ConfigError, rt: Runtime) -> int:
    """One line on stderr, and the torchelastic error file, so the pod learns it was exit 64
    (torchrun itself exits 1 whatever its workers' codes; it copies this file with their code)."""
    return report_failure(str(err), rt, EXIT_BAD_INPUT)


def report_failure(message: str, rt: Runtime, code: int) -> int:
    return config.report_failure(message, rt.rank, code)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        return check_settings(args)
    rt = Runtime.from_env()
    try:
        cfg = config.load(args.config, args.set)
        cfg.check_world_size(rt.world_size)
        config.check_data(args.data_dir, cfg)
    except ConfigError as err:
        return report_bad_input(err, rt)
    trainer = None
    try:
        rt.start()
        trainer = Trainer(cfg, args, rt)
        return trainer.run()
    except ConfigError as err:
        return report_bad_input(err, rt)
    except SaveFailed as err:
        return report_failure(str(err), rt, 1)
    except GroupMismatch as err:
        return report_failure(str(err), rt, config.EXIT_UNAVAILABLE)
    except Exception as err:
        trained = trainer is not None and trainer.start_step is not None and trainer.step > trainer.start_step
        code = config.group_failure_code(err, trained) if rt.ddp else None
        if code is None:
            raise
        what = "a peer of the group went away" if trained else "the group failed before its first step"
        return report_failure(f"{what} (rank {rt.rank}: {str(err).splitlines()[0][:200]})", rt, code)
    finally:
        rt.stop()


if __name__ == "__main__":
    exit_code = main()
    # Everything is committed, flushed and closed by now. Skip interpreter finalization: under
    # load, gloo's C++ threads sometimes abort in it (SIGABRT, 1 run in ~20 on 2 CPUs), which
    # torchrun reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
