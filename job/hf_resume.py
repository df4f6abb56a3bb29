"""Make a Hugging Face Trainer's checkpoints count only once they are whole, and resume from them.

The change to an existing Trainer script (after `trainer = Trainer(...)`):

    import hf_resume
    resume = hf_resume.attach(trainer)                          # commits each save, handles SIGTERM
    trainer.train(resume_from_checkpoint=resume.checkpoint())   # newest committed one, or None
    sys.exit(resume.exit_code())                                # 143 after SIGTERM, 130 after SIGINT

With transformers' own callback API: each save's `checkpoint-N/` is renamed (never copied, never
hard-linked: torch.save rewrites files in place) into `checkpoints/step-N/` and committed with
checkpoint.py's protocol; an FSDP save's folders go flat as `FOLDER~NAME`. checkpoint() resumes
from the newest step that verifies and removes torn ones. SIGTERM/SIGINT: every rank agrees on the
step to stop at, it is saved and committed once (transformers' enable_jit_checkpoint, which saves
mid-step, is switched off). Rank 0 writes progress.json, TensorBoard events and the trainer's
events, as train.py does. docs/own-trainer.md has each rule and why.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import checkpoint
import contract
import trainer_kit
from trainer_kit import event

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - the module is useless without it
    raise ImportError("hf_resume needs transformers (pip install transformers accelerate)") from err

CHECKPOINTS = "checkpoints"
TRAINER_PREFIX = "checkpoint-"  # transformers' PREFIX_CHECKPOINT_DIR
NESTED = "~"  # FOLDER~NAME: a file of a folder of the Trainer's save, as one plain file name
_CHUNK = 8 << 20


log = trainer_kit.logger("hf_resume")


class _RunDone(Exception):
    """The restored step is the last: raised before the first step, so trainer.train() trains nothing."""

    def __init__(self, step: int, loss: float | None):
        super().__init__(f"step {step} is the last")
        self.step, self.loss = step, loss


class CheckpointLayoutError(Exception):
    """The Trainer wrote something a checkpoint folder cannot hold (folders within folders)."""


# -- committing a Trainer save --------------------------------------------------------------------

class _MovedIn(checkpoint.Staged):
    """A staged checkpoint whose files are renamed in from the Trainer's folder. Their size and
    sha256 come from one read, which also fsyncs them (the Trainer wrote them without), but for
    the save as the pod goes (see commit_trainer_save)."""

    def take(self, name: str, entry: dict) -> None:
        if hasattr(checkpoint, "is_file_name") and not checkpoint.is_file_name(name):
            raise CheckpointLayoutError(f"bad checkpoint file name {name!r}")
        self._entries[name] = dict(entry)


def _hash_and_sync(path: Path, durable: bool = True) -> dict:
    """Size and sha256 of a file the Trainer wrote without fsync; fsynced here, before the manifest,
    when `durable`."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if durable:
            os.fsync(file.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def commit_trainer_save(source: Path, root: Path, step: int, meta: dict, beat=lambda: None,
                        durable: bool = True) -> Path:
    """Turn the Trainer's `checkpoint-N/` into a committed `root/step-N/` by renaming its files.
    Not `durable` (the save after a stop signal in a pod: trainer_kit.stop_save_durable): its
    files are not fsynced."""
    final = root / checkpoint.step_dir_name(step)
    if checkpoint.is_committed(final):  # the same step saved twice: the first commit stands
        _remove_tree(source)
        return final
    entries, nested = flattened(source)
    if nested:
        meta = {**meta, "nested": nested}
    root.mkdir(parents=True, exist_ok=True)
    staged = _MovedIn(final)
    try:
        for name, path in entries:  # same file system: a rename moves no bytes
            os.rename(path, staged.path / name)
        beat()
        with ThreadPoolExecutor(max_workers=max(1, min(len(entries), os.cpu_count() or 1))) as pool:
            hashed = list(pool.map(lambda item: _hash_and_sync(staged.path / item[0], durable), entries))
        beat()
        for (name, _), entry in zip(entries, hashed):
            staged.take(name, entry)
        staged.commit(meta=meta)
    finally:
        staged.abandon()
    _remove_tree(source)
    return final


def flattened(source: Path) -> tuple[list[tuple[str, Path]], dict[str, str]]:
    """(flat name, path) of every file of a Trainer save, and {flat name: FOLDER/NAME} for those in
    a folder (FSDP's shards). A folder in a folder, or two files that flatten alike, cannot be held."""
    entries, nested = [], {}
    for path in sorted(source.iterdir()):
        if not path.is_dir():
            entries.append((path.name, path))
            continue
        for inner in sorted(path.iterdir()):
            if inner.is_dir():
                raise CheckpointLayoutError(f"{source.name}/{path.name} holds a folder ({inner.name}): a checkpoint "
                                            f"holds files, and files of folders, only")
            name = f"{path.name}{NESTED}{inner.name}"
            entries.append((name, inner))
            nested[name] = f"{path.name}/{inner.name}"
    names = [name for name, _ in entries]
    if len(set(names)) != len(names):
        raise CheckpointLayoutError(f"{source.name} holds files whose names collide once folders are flattened "
                                    f"with {NESTED!r}")
    return entries, nested


def trainer_view(folder: Path) -> Path:
    """The committed checkpoint as the Trainer saved it, folders included: hard links (no bytes
    copied) in a staging folder beside it, which the next start removes. The folder itself when
    nothing in it was nested."""
    manifest = checkpoint.read_manifest(folder)
    nested = manifest.get("meta", {}).get("nested") or {}
    if not nested:
        return folder
    view = checkpoint.staging_path(folder.parent / f"resume-{folder.name}")
    view.mkdir()
    os.link(folder / checkpoint.MANIFEST, view / checkpoint.MANIFEST)  # what finetune.py checks it against
    for name in manifest["files"]:
        target = nested.get(name, name)
        parts = target.split("/")
        if not (1 <= len(parts) <= 2 and all(checkpoint.is_file_name(p) for p in parts)):
            raise CheckpointLayoutError(f"{folder.name}'s manifest maps {name!r} to {target!r}, not FOLDER/NAME")
        (view / target).parent.mkdir(exist_ok=True)
        os.link(folder / name, view / target)
    return view


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- choosing what to resume from -----------------------------------------------------------------

def newest_committed(output_dir: Path | str) -> Path | None:
    """The newest committed checkpoint under OUTPUT_DIR/checkpoints that verifies; everything torn
    (the Trainer's own `checkpoint-N/` folders, staging folders, bad step folders) is removed with a
    warning. Call it on one process (rank 0)."""
    output_dir = Path(output_dir)
    root = output_dir / CHECKPOINTS
    checkpoint.remove_staging_leftovers(root)
    for torn in sorted(output_dir.glob(f"{TRAINER_PREFIX}*")):
        # Every save that finished was renamed away into checkpoints/: what is left was cut short.
        if torn.is_dir() and torn.name[len(TRAINER_PREFIX):].isdigit():
            log(f"warning: {torn.name} is a Trainer save that never committed (killed mid-save); removing it")
            _remove_tree(torn)

    def skip(folder: Path, problem: str) -> None:
        log(f"warning: skipping checkpoint {folder.name}: {problem}; falling back to the one before it")
        checkpoint.discard(folder)

    # The one the pod's restore just hashed is checked by size only (job/contract.py).
    return checkpoint.newest_valid(root, on_skip=skip,
                                   verified=checkpoint.read_verified(os.environ.get("RESTORE_VERIFIED_FILE")))


# -- the callback ---------------------------------------------------------------------------------

class _Dist:
    """The process group the Trainer (accelerate) set up, if any, and a gloo group beside it for
    the small per-step collectives (NCCL would need GPU tensors and drain the GPU queue)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.on else 0
        self.world_size = dist.get_world_size() if self.on else 1
        self.group = None
        if self.on:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def barrier(self) -> None:
        if self.on:
            self.dist.barrier(group=self.group)

    def broadcast(self, value):
        if not self.on:
            return value
        box = [value]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value) -> list:
        """Every rank's value, on rank 0 (the others get [])."""
        if not self.on:
            return [value]
        gathered = [None] * self.world_size if self.rank == 0 else None
        self.dist.gather_object(value, gathered, dst=0, group=self.group)
        return gathered or []

    def count(self, flag: bool) -> int:
        """How many ranks say True, on every rank."""
        if not self.on:
            return int(flag)
        import torch

        total = torch.tensor([int(flag)])
        self.dist.all_reduce(total, op=self.dist.ReduceOp.SUM, group=self.group)
        return int(total.item())


def leave(message: str, code: int, rank: int) -> None:
    """End the process with CODE (one line on rank 0, torchrun's error file with the message), as
    train.py does for what the pod's contract gives a code: no traceback, no interpreter teardown."""
    trainer_kit.report_failure(message, rank, code)
    main_exit(code)


class CommitCallback(TrainerCallback):
    """Commits each Trainer save, stops on SIGTERM/SIGINT after saving, reports progress."""

    def __init__(self, output_dir: Path | str, keep: int = 3, health_file: str | None = None,
                 dist: _Dist | None = None, meta: dict | None = None, tokens_per_step: int | None = None):
        self.out = Path(output_dir)
        self.root = self.out / CHECKPOINTS
        self.keep = max(int(keep), 1)
        self.extra_meta = dict(meta or {})
        self.dist = dist or _Dist()
        self.master = self.dist.rank == 0
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # A node of a group but node 0 (torchrun's GROUP_RANK): its Trainer saves its ranks' RNG
        # files on its own disk, which no one uploads; rank 0 gathers them into the commit.
        self.other_node_saver = os.environ.get("GROUP_RANK", "0") != "0" and local_rank == 0
        self.heartbeat = trainer_kit.Heartbeat(health_file if local_rank == 0 else None, every=1.0)
        self.stop = trainer_kit.StopSignal()
        self.stopped_by = 0  # the signal all processes agreed to stop for
        self.start_step = 0
        self.trained = False  # a step finished in this process
        self.train_loss = None
        self.val_loss = None
        self.best_val_loss = None
        self.best_step = 0
        self.writer = None
        self.last_log = None
        self.speed: dict = {}
        self.tokens_per_step = tokens_per_step  # for tokens_per_s in the step event; None: unknown
        self.resuming_from: str | None = None  # what Resume.checkpoint() chose
        self.resume_started = time.monotonic()  # the load is timed from that choice to the first step
        self.save_requested: float | None = None

    def install_signal_handlers(self) -> None:
        self.stop.install()

    # events

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step
        self.beat()
        if 0 < state.max_steps <= state.global_step:
            self._finish_without_training(state)
        if self.master:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides what an earlier start logged after its last checkpoint: it is redone.
            self.writer = SummaryWriter(log_dir=str(self.out / "tensorboard"), flush_secs=10,
                                        purge_step=self.start_step + 1 if self.start_step else None)
            self.write_progress(state)
            event("resumed", step=state.global_step, name=self.resuming_from,
                  seconds=round(time.monotonic() - self.resume_started, 3))
        self.last_log = (time.monotonic(), state.global_step)

    def _finish_without_training(self, state) -> None:
        """A run whose restored checkpoint is at (or past) the last step is done: the Trainer's loop
        would train a step past it before it looks at should_training_stop, so it is left here."""
        if self.master:
            log(f"{self.resuming_from or 'the checkpoint'} is at step {state.global_step} of {state.max_steps}: "
                f"the run is done, nothing to train")
            self.write_progress(state)
            event("resumed", step=state.global_step, name=self.resuming_from,
                  seconds=round(time.monotonic() - self.resume_started, 3))
            event("done", step=state.global_step)
        raise _RunDone(state.global_step, self.train_loss)

    def on_step_end(self, args, state, control, **kwargs):
        self.trained = True
        self.beat()
        # A collective each step, on every rank, so all stop after the same step.
        agreed = self.stop.agreed(self.dist.group)
        if agreed and not self.stopped_by:
            self.stopped_by = agreed
            # For torchrun's error file: a node that got no signal itself (a peer did) exits 128+N too.
            trainer_kit.record_exit(128 + agreed, f"stopped after {signal.Signals(agreed).name} (the step is committed)")
            if self.master:
                log(f"{signal.Signals(agreed).name}: step {state.global_step} finished; "
                    f"committing a checkpoint of it before exit")
            control.should_save = True
            control.should_training_stop = True
        if state.global_step >= state.max_steps:
            # The runtime writes COMPLETE only once the last step is committed; transformers saves
            # it only under save_strategy "steps" (not "no", "best", or an epoch that ends later).
            control.should_save = True
        if control.should_save:
            self.save_requested = time.monotonic()
        return control

    def on_substep_end(self, args, state, control, **kwargs):
        self.beat()  # a long gradient-accumulation step is not a hung one
        return control

    def on_prediction_step(self, args, state, control, **kwargs):
        self.beat()  # nor is a long evaluation
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        if self.save_requested is not None:  # the Trainer evaluates before it saves: not the save's time
            self.save_requested = time.monotonic()
        return control

    def on_save(self, args, state, control, **kwargs):
        source = Path(args.output_dir) / f"{TRAINER_PREFIX}{state.global_step}"
        final = self.root / checkpoint.step_dir_name(state.global_step)
        if state.best_model_checkpoint and Path(state.best_model_checkpoint) == source:
            state.best_model_checkpoint = str(final)  # load_best_model_at_end finds it there (until pruned)
        # Every rank wrote its part (rng_state_<rank>.pth); rank 0 gathers those of other nodes.
        self._gather_rng_files(source)
        self.dist.barrier()  # every rank read its file before another node's folder goes
        if self.other_node_saver:
            _remove_tree(source)
        if self.master:
            started = time.monotonic()
            requested = self.save_requested or started
            already = checkpoint.is_committed(final)
            durable = not self.stopped_by or trainer_kit.stop_save_durable()
            final = commit_trainer_save(source, self.root, state.global_step, self.meta(state), self.beat,
                                        durable=durable)
            if durable:  # else the step before it stays whole on disk (trainer_kit.stop_save_durable)
                checkpoint.prune(self.root, self.keep)
            nbytes = sum(p.stat().st_size for p in final.iterdir())
            log(f"checkpoint {final.name} committed: {nbytes / 1e6:.1f} MB in {time.monotonic() - started:.2f}s")
            if not already:  # the Trainer saves synchronously: training waited for all of it
                seconds = round(time.monotonic() - requested, 3)
                event("checkpoint", step=state.global_step, name=final.name, state="committed", seconds=seconds,
                      blocked_seconds=seconds, bytes=nbytes)
            self.write_progress(state)
            if self.writer:
                self.writer.flush()
        self.save_requested = None
        self.beat()
        return control

    def _gather_rng_files(self, source: Path) -> None:
        """Every rank's RNG state file into rank 0's folder before it commits: the checkpoint holds
        the whole group's, so every node resumes each rank's dropout draws exactly."""
        if not self.dist.on:
            return
        name = f"rng_state_{self.dist.rank}.pth"
        mine = (source / name).read_bytes() if (source / name).is_file() else None
        for rank, data in enumerate(self.dist.gather(mine)):
            path = source / f"rng_state_{rank}.pth"
            if data is not None and not path.exists():  # a rank of node 0 wrote its own here
                path.write_bytes(data)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.master or not logs:
            return control
        step = state.global_step
        if "loss" in logs:
            self.train_loss = float(logs["loss"])
            now = time.monotonic()
            elapsed, steps = now - self.last_log[0], max(step - self.last_log[1], 1)
            self.last_log = (now, step)
            ms_per_step = 1000 * elapsed / steps
            self.speed = {"ms_per_step": ms_per_step,
                          "eta_seconds": (state.max_steps - step) * ms_per_step / 1000}
            lr = logs.get("learning_rate")
            log(f"step {step}/{state.max_steps} | loss {self.train_loss:.4f}"
                + (f" | lr {lr:.2e}" if isinstance(lr, (int, float)) else "")
                + f" | {ms_per_step:.1f} ms/step")
            known = self.tokens_per_step and ms_per_step > 0
            tokens_per_s = self.tokens_per_step * 1000 / ms_per_step if known else None
            event("step", step=step, max_steps=state.max_steps, loss=trainer_kit.finite(self.train_loss),
                  ms_per_step=ms_per_step, tokens_per_s=tokens_per_s)
        if "eval_loss" in logs:
            self._saw_val_loss(float(logs["eval_loss"]), step)
            log(f"step {step}: val loss {self.val_loss:.4f} (best {self.best_val_loss:.4f} at step {self.best_step})")
        if self.writer:
            names = {"loss": "train/loss", "eval_loss": "val/loss", "learning_rate": "lr"}
            for key, value in logs.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(names.get(key, key), value, step)
        self.write_progress(state)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.master:
            # The step it stopped at, or the last, was committed in on_save before this.
            if self.stopped_by:
                event("stopped", signal=signal.Signals(self.stopped_by).name, step=state.global_step)
            else:
                event("done", step=state.global_step)
            self.write_progress(state)
            if self.writer:
                self.writer.close()
                self.writer = None
        self.dist.barrier()  # none leaves (and tears down the group) while rank 0 still commits
        return control

    # what a person sees

    def _saw_val_loss(self, value: float, step: int) -> None:
        self.val_loss = value
        if self.best_val_loss is None or value < self.best_val_loss:
            self.best_val_loss, self.best_step = value, step

    def restore_report(self, meta: dict) -> None:
        """The losses a resumed run reports until it measures its own (from the manifest's meta)."""
        for key in ("train_loss", "val_loss", "best_val_loss"):
            value = meta.get(key)
            setattr(self, key, float(value) if isinstance(value, (int, float)) else None)
        self.best_step = meta.get("best_step") if isinstance(meta.get("best_step"), int) else 0

    def beat(self) -> None:
        self.heartbeat.beat()

    def leave_if_peer_lost(self, err: Exception) -> None:
        """A collective failed because a peer (another node) is gone: exit 138 once this process
        trained a step (the Job restarts the group uncounted), else 75; anything else is not ours."""
        code = trainer_kit.group_failure_code(err, self.trained) if self.dist.on else None
        if code is not None:
            what = "a peer of the group went away" if self.trained else "the group failed before its first step"
            leave(f"{what} (rank {self.dist.rank}: {str(err).splitlines()[0][:200]})", code, self.dist.rank)

    def meta(self, state) -> dict:
        return {"step": state.global_step, "max_steps": state.max_steps, "keep": self.keep,
                "train_loss": self.train_loss, "val_loss": self.val_loss,
                "best_val_loss": self.best_val_loss, "best_step": self.best_step,
                "world_size": self.dist.world_size, "trainer": "transformers", **self.extra_meta}

    def write_progress(self, state) -> None:
        trainer_kit.write_progress(self.out, step=state.global_step, start_step=self.start_step,
                                   max_steps=state.max_steps, train_loss=self.train_loss, val_loss=self.val_loss,
                                   best_val_loss=self.best_val_loss, best_step=self.best_step, speed=self.speed)


# -- the one-call API -----------------------------------------------------------------------------

class Resume:
    """What attach() returns: the checkpoint to resume from and the exit code to leave with."""

    def __init__(self, trainer, callback: CommitCallback):
        self.trainer = trainer
        self.callback = callback

    def checkpoint(self) -> str | None:
        """The newest committed checkpoint (rank 0 decides, every rank gets the same answer)."""
        name = None
        view = None
        if self.callback.master:
            folder = newest_committed(self.callback.out)
            name = folder.name if folder else None
            log(f"resuming from {name}" if name else "no committed checkpoint: starting from step 0")
            self.callback.resuming_from, self.callback.resume_started = name, time.monotonic()
            view = str(trainer_view(folder)) if folder else None
        try:
            name, view = self.callback.dist.broadcast((name, view))
            # In a group each node restored node 0's choice from S3; one with another (a newer step
            # landed between two nodes' restores) must not load different weights: the group restarts.
            missing = self.callback.dist.count(name is not None and not checkpoint.is_committed(self.callback.root / name))
        except Exception as err:
            self.callback.leave_if_peer_lost(err)
            raise
        if missing:
            leave(f"{missing} process(es) have no committed {name}, which rank 0 resumes from; the group restarts "
                  f"and every node restores it again", contract.EXIT_UNAVAILABLE, self.callback.dist.rank)
        if name is None:
            return None
        self.callback.restore_report((checkpoint.read_manifest(self.callback.root / name) or {}).get("meta", {}))
        if view is None or Path(view).name == name:  # nothing nested: each rank's own copy of the step
            return str(self.callback.root / name)
        return view

    def exit_code(self) -> int:
        """0, or 128 + the signal training stopped for (143 SIGTERM, 130 SIGINT)."""
        return 128 + self.callback.stopped_by if self.callback.stopped_by else 0


def attach(trainer, keep: int | None = None, output_dir: str | None = None, meta: dict | None = None,
           tokens_per_step: int | None = None) -> Resume:
    """Add the commit callback to a Trainer and take over SIGTERM/SIGINT. `keep` defaults to
    save_total_limit (else 3); checkpoints go under OUTPUT_DIR/checkpoints (the Trainer's output_dir);
    `meta` is recorded in each manifest; `tokens_per_step` (all processes) gives the step events
    their tokens_per_s."""
    args = trainer.args
    if getattr(args, "enable_jit_checkpoint", False):
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback

        trainer.remove_callback(JITCheckpointCallback)
        log("enable_jit_checkpoint is replaced by hf_resume's SIGTERM save (at a step boundary, committed)")
    if keep is None:
        keep = args.save_total_limit or 3
    callback = CommitCallback(output_dir or args.output_dir, keep=keep,
                              health_file=os.environ.get("HEALTH_FILE"), meta=meta, tokens_per_step=tokens_per_step)
    problem = trainer_kit.writer_not_on_node0(callback.dist.rank)
    if problem:
        leave(problem, contract.EXIT_BAD_INPUT, callback.dist.rank)
    _plain_cpu_device(args)
    callback.install_signal_handlers()
    trainer.add_callback(callback)
    trainer.train = _train_unless_done(trainer.train, callback)
    return Resume(trainer, callback)


def _plain_cpu_device(args) -> None:
    """A process of a multi-process CPU run has device cpu:<index> (accelerate); transformers 4.57
    resumes its optimizer with torch.load(map_location=that device), which torch refuses ("don't know
    how to restore data location ... (tagged with cpu:0)"). `cpu` is the same device."""
    device = getattr(args, "device", None)
    if device is not None and device.type == "cpu" and device.index is not None:
        import torch

        args.__dict__["_setup_devices"] = torch.device("cpu")  # the cached value `device` returns


def _train_unless_done(train, callback: CommitCallback):
    """trainer.train, returning at once when the callback found the run done before its first
    step, and ending the process with the group's code when a peer went away. Under FSDP the Trainer
    resumes through accelerate, which reads DCP's files with dcp.FileSystemReader: that name is
    safe_dcp.SafeReader meanwhile (DCP's own reader runs the pickles a checkpoint holds)."""
    @functools.wraps(train)
    def train_unless_done(*args, **kwargs):
        import safe_dcp  # torch's DCP: transformers' Trainer has imported it already

        try:
            with safe_dcp.readers_replaced():
                return train(*args, **kwargs)
        except _RunDone as done:
            from transformers.trainer_utils import TrainOutput

            return TrainOutput(done.step, done.loss if done.loss is not None else float("nan"), {})
        except Exception as err:
            callback.leave_if_peer_lost(err)
            raise
    return train_unless_done


def main_exit(code: int) -> None:
    """Leave without interpreter finalization, as train.py does (gloo threads can abort in it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
