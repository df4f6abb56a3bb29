"""FSDP2 training and its sharded checkpoints (PyTorch Distributed Checkpoint, DCP), committed by
the protocol every checkpoint follows (checkpoint.py: files first, manifest last, then rename).

    model = build(lambda: GPT(cfg.model), blocks, device, bf16, resuming)  # fully_shard per block + root
    shards = ShardedCheckpoints(rt, log, saver)   # saver: an async_save.AsyncSaver on every rank, or None
    shards.save(final, model, optimizer, train_state, meta, best, keep)  # a collective
    train_state = shards.load(folder, model, optimizer)                  # a collective

step-N/ holds DCP's .metadata and __R_0.distcp (rank R's shards of the weights and AdamW's
moments), train_state.pt (all that is not sharded, from rank 0) and manifest.json, which rank 0
writes last once every rank's files are staged with their sha256; a rank on another node sends its
files to rank 0 (node 0 alone uploads). DCP reshards on load, so N processes resume what M saved.
The manifest's meta "shards" lists the files each rank reads, so a node of a group fetches only its
ranks' (restore.py --ranks); a file a rank lacks is sent by a peer before the load. With a saver,
save() returns once this rank's shards are copied; the save processes commit together over a gloo
group of their own. Checkpoints are read by safe_dcp.SafeReader (DCP's own reader runs the pickles
a checkpoint holds). docs/fsdp.md has the details.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import checkpoint
from async_save import SaveFailed, _Bases, link_best, rebuild, saved_in_process, without_crc32
from safe_dcp import METADATA, SafeReader

TRAIN_STATE = "train_state.pt"
SHIP_CHUNK = 64 << 20  # bytes per message when a rank sends a file to another node
GROUP_TIMEOUT = timedelta(minutes=30)


class ShardSaveFailed(SaveFailed):
    """A sharded save failed on some rank: that step is not committed."""


# -- the model ---------------------------------------------------------------------------------

def ensure_group(device: torch.device) -> None:
    """FSDP needs a process group even for one process (torchrun made one for more)."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def mixed_precision(device: torch.device, bf16: bool) -> MixedPrecisionPolicy:
    """On CUDA with bf16: bf16 weights in forward and backward, gradients reduced in fp32, fp32
    shards kept (what the optimizer updates and the checkpoint holds). Unmeasured on a GPU here."""
    if device.type == "cuda" and bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def build(make: Callable[[], torch.nn.Module], blocks: Callable[[torch.nn.Module], list],
          device: torch.device, bf16: bool, resuming: bool) -> torch.nn.Module:
    """The model sharded: fully_shard on each block (its weights gathered only while it runs),
    then on the root (the rest). A fresh model is drawn whole on the CPU, as the DDP path draws it,
    then each process keeps its shard (moved to `device`); one that a checkpoint fills is built on
    the meta device and allocated shard by shard, never whole."""
    ensure_group(device)
    policy = mixed_precision(device, bf16)
    if resuming:
        with torch.device("meta"):
            model = make()
    else:
        model = make()
    for block in blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if resuming:
        model.to_empty(device=device)
    return model


# -- the state: what DCP shards, what train_state.pt holds ----------------------------------------

def state_parts(model, optimizer) -> tuple[dict, dict, dict]:
    """(everything, the DTensors by dotted path, the rest): the model's and optimizer's state
    dicts keyed by parameter names, once as they are, once the DTensors alone (each tensor once:
    a tied weight is saved under its first name), once with None where a DTensor was (the
    optimizer's step counts and settings: rank 0 saves them in train_state.pt, so every rank's
    DCP file holds only its own shards and a node reads only its ranks' files)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    everything = {"model": model_state, "optim": optim_state}
    shards: dict[str, DTensor] = {}
    seen: set[int] = set()
    for path, value in _leaves(everything):
        if isinstance(value, DTensor) and id(value) not in seen:
            seen.add(id(value))
            shards[".".join(map(str, path))] = value
    return everything, shards, _without_dtensors(everything)


def _leaves(obj, path: tuple = ()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _leaves(value, (*path, index))
    else:
        yield path, obj


def _without_dtensors(obj):
    if isinstance(obj, DTensor):
        return None
    if isinstance(obj, dict):
        return {key: _without_dtensors(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_without_dtensors(value) for value in obj)
    return obj.detach().clone() if torch.is_tensor(obj) else obj


def merged(template, saved):
    """`template` (state_parts' everything, its DTensors loaded) with `saved`'s other values."""
    if isinstance(template, DTensor):
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        missing = next((key for key in template if key not in saved), None)
        if missing is not None:
            raise KeyError(f"the checkpoint has no {missing!r}")
        return {key: merged(value, saved[key]) for key, value in template.items()}
    return saved


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a local shard sits in its DTensor, for the save process to rebuild it."""

    placements: tuple
    shape: tuple
    stride: tuple


def portable(shards: dict[str, DTensor]) -> dict:
    """The shards as plain local tensors and their specs: what a save process is sent."""
    return {key: {"local": value.to_local(), "spec": ShardSpec(tuple(value.placements), tuple(value.shape),
                                                               tuple(value.stride()))}
            for key, value in shards.items()}


def from_portable(shards: dict, mesh) -> dict[str, DTensor]:
    return {key: DTensor.from_local(part["local"], mesh, part["spec"].placements, run_check=False,
                                    shape=torch.Size(part["spec"].shape), stride=part["spec"].stride)
            for key, part in shards.items()}


# -- writing and committing (in the trainer, or in each rank's save process) ----------------------

@dataclasses.dataclass(frozen=True)
class SaveJob:
    """One rank's part of a sharded save."""

    root: str
    name: str
    staging: str  # rank 0's staging folder, created by rank 0 (the same path on every node)
    rank: int
    world: int
    same_disk: bool  # this rank writes into rank 0's staging folder (else it sends its files there)
    meta: dict
    best: bool
    keep: int


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced), noting the names of the files it wrote and,
    on the coordinator, where each item went (the .metadata file's storage_data)."""

    def __init__(self, path: Path):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.written: list[str] = []
        self.storage_data: dict | None = None

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.storage_data = {result.index: result.storage_data for part in results for result in part}
        self.written = [*self.written, METADATA]


def write_and_commit(job: SaveJob, shards: dict[str, DTensor], train_state: dict, group) -> Path | None:
    """Every rank writes its shards into the staging folder; rank 0 commits it once all are there.
    Returns the committed folder on rank 0 (None elsewhere); raises ShardSaveFailed on every rank
    when any part failed."""
    staging = Path(job.staging)
    final = Path(job.root) / job.name
    staging.mkdir(parents=True, exist_ok=True)  # rank 0 made it; another node makes its own
    staged = checkpoint.Staged(final, path=staging) if job.rank == 0 else None
    try:
        writer = _Writer(staging)
        with without_crc32():
            metadata = dcp_call(dcp.save, shards, storage_writer=writer, process_group=group)
        # torch 2.11's writer puts storage_data on a copy of the metadata (the one in .metadata), so
        # the Metadata that save() returns has none there: every rank takes the coordinator's.
        metadata = dataclasses.replace(metadata, storage_data=_broadcast(group, job.world, writer.storage_data))
        mine = _entries(staging, writer.written)
        reads = files_read(shards, metadata, job.rank == 0)
        ranks = _all_gather(group, job.world, (job.same_disk, mine, reads))
        _send_to_rank0(job, staging, ranks, group, staged)
        outcome = _commit(job, staged, ranks, train_state) if staged else None
    except BaseException:
        if staged:
            staged.abandon()
        raise
    finally:
        if not job.same_disk:
            shutil.rmtree(staging, ignore_errors=True)
    outcome = _broadcast(group, job.world, outcome)
    if outcome != "ok":
        raise ShardSaveFailed(outcome)
    return final if job.rank == 0 else None


def dcp_call(call, *args, **kwargs):
    """A DCP save or load; its CheckpointException (a BaseException, which `except Exception`
    misses) becomes a RuntimeError that names the first rank's failure."""
    try:
        return call(*args, **kwargs)
    except CheckpointException as err:
        failures = getattr(err, "failures", None) or {}
        rank, failure = min(failures.items(), key=lambda item: item[0]) if failures else (None, err)
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(error.errno, f"rank {rank}: {error.strerror}") from None  # the caller's "no space"
        raise RuntimeError(f"rank {rank}: {type(error).__name__}: {error}") from None


def _entries(folder: Path, names: list[str]) -> dict[str, dict]:
    """Size and sha256 of files just written (hashlib lets go of the GIL: side by side)."""
    def entry(name: str) -> tuple[str, dict]:
        path = folder / name
        return name, {"size": path.stat().st_size, "sha256": checkpoint.file_sha256(path)}

    with ThreadPoolExecutor(max_workers=max(1, min(len(names), 4))) as pool:
        return dict(pool.map(entry, names))


def files_read(shards: dict, metadata, coordinator: bool) -> list[str]:
    """The files this rank's load of `shards` reads, as DCP's load planner resolves them."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(shards, metadata, coordinator)
    plan = planner.create_local_plan()
    return sorted({metadata.storage_data[item.storage_index].relative_path for item in plan.items})


def _commit(job: SaveJob, staged: checkpoint.Staged, ranks: list, train_state: dict) -> str:
    """Rank 0: train_state.pt, the manifest last, the rename; then best/ and retention, as
    write_step does. "ok", or what went wrong (every rank raises it)."""
    try:
        for same_disk, files, _ in ranks:
            if same_disk:  # the others' files were checked as they arrived
                for name, entry in files.items():
                    staged.add_written(name, entry)
        with staged.open(TRAIN_STATE) as file, without_crc32():
            torch.save(train_state, file)
        meta = {**job.meta, "shards": shards_meta(job.world, [reads for _, _, reads in ranks])}
        final = staged.commit(meta=meta)
    except Exception as err:  # noqa: BLE001 - told to every rank, which all stop
        staged.abandon()
        return f"rank 0 could not commit {job.name}: {type(err).__name__}: {err}"
    if job.best:
        link_best(Path(job.root), final, meta)
    checkpoint.prune(Path(job.root), job.keep)
    return "ok"


def shards_meta(world: int, reads: list[list[str]]) -> dict:
    """What the manifest says of a sharded checkpoint: who reads what at the same world size."""
    return {"format": "dcp", "world_size": world, "reads": reads, "common": [METADATA, TRAIN_STATE]}


# -- files between nodes ---------------------------------------------------------------------------

def _send_to_rank0(job: SaveJob, staging: Path, ranks: list, group, staged) -> None:
    """The files of ranks on other disks go to rank 0's staging folder, one rank after another."""
    for rank, (same_disk, files, _) in enumerate(ranks):
        if same_disk:
            continue
        for name, entry in sorted(files.items()):
            if job.rank == rank:
                send_file(staging / name, 0, group)
            elif job.rank == 0:
                with staged.receive(name, entry) as stream:
                    receive_file(stream, entry["size"], rank, group)


def send_file(path: Path, to: int, group) -> None:
    with open(path, "rb") as file:
        while chunk := file.read(SHIP_CHUNK):
            dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), dst=to, group=group)


def receive_file(stream, size: int, source: int, group) -> None:
    left = size
    while left:
        part = torch.empty(min(SHIP_CHUNK, left), dtype=torch.uint8)
        dist.recv(part, src=source, group=group)
        stream.write(memoryview(part.numpy()))
        left -= part.numel()


def _all_gather(group, world: int, value) -> list:
    if world == 1:
        return [value]
    values = [None] * world
    dist.all_gather_object(values, value, group=group)
    return values


def _broadcast(group, world: int, value):
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


# -- the save process's side ---------------------------------------------------------------------

@dataclasses.dataclass
class ShardRequest:
    """What a rank's save process is sent (async_save.AsyncSaver.submit_job): run() rebuilds the
    shards from the buffer and runs write_and_commit with the other ranks' save processes."""

    job: SaveJob
    skeleton: Any
    layout: list
    store: tuple | None  # (host, port, prefix) of the store the save processes meet at; None: alone

    def run(self, buffer) -> tuple:
        def save():
            group, mesh = _save_group(self.store, self.job.rank, self.job.world)
            tree = rebuild(self.skeleton, _Bases(buffer, self.layout))
            return write_and_commit(self.job, from_portable(tree["shards"], mesh), tree["train_state"], group)

        return saved_in_process(save)


_GROUP: tuple | None = None


def _save_group(store: tuple | None, rank: int, world: int):
    """The save processes' own gloo group and mesh, made at their first save."""
    global _GROUP
    if _GROUP is None:
        if store is None:
            backing = dist.HashStore()
        else:
            host, port, prefix = store
            backing = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=GROUP_TIMEOUT,
                                                              wait_for_workers=False))
        dist.init_process_group("gloo", store=backing, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
        mesh = init_device_mesh("cpu", (world,))
        _GROUP = (None, mesh)
    return _GROUP


# -- the trainer's side --------------------------------------------------------------------------

class ShardedCheckpoints:
    """Save and load sharded checkpoints; every call is a collective of all ranks."""

    def __init__(self, rank: int, world: int, group, log: Callable[[str], None], saver=None):
        self.rank, self.world, self.group, self.log, self.saver = rank, world, group, log, saver
        self.store = _store_address(rank, world, group) if saver else None  # every rank has one, or none

    def save(self, final: Path, model, optimizer, train_state: dict, meta: dict, best: bool, keep: int) -> Path | None:
        """Rank 0 names a staging folder and makes it; every rank writes its shards there (or on
        its own disk, then sends them), rank 0 commits. With a saver, it returns once this rank's
        state is copied and the save processes do the rest."""
        staging = None
        if self.rank == 0:
            staging = checkpoint.staging_path(final)
            staging.mkdir(parents=True)
        staging = Path(_broadcast(self.group, self.world, str(staging)))
        _, shards, rest = state_parts(model, optimizer)
        train_state = {**train_state, "unsharded": rest}
        job = SaveJob(str(final.parent), final.name, str(staging), self.rank, self.world, staging.is_dir(), meta,
                      best, keep)
        if self.saver is None:
            try:
                return write_and_commit(job, shards, train_state, self.group)
            except ShardSaveFailed:
                raise
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise ShardSaveFailed(f"saving checkpoint {final.name} failed: {err}") from err
            except Exception as err:
                raise ShardSaveFailed(f"saving checkpoint {final.name} failed: {type(err).__name__}: "
                                      f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}") from err
        tree = {"shards": portable(shards), "train_state": train_state}
        self.saver.submit_job(final, tree, lambda skeleton, layout: ShardRequest(job, skeleton, layout, self.store))
        return None

    def snapshot_tree(self, model, optimizer) -> dict:
        """What a background save copies, for sizing its buffer ahead (AsyncSaver.reserve)."""
        _, shards, rest = state_parts(model, optimizer)
        return {"shards": portable(shards), "train_state": {"unsharded": rest}}

    def load(self, folder: Path, model, optimizer) -> dict:
        """Fill model and optimizer from `folder` (any world size saved it); its train_state."""
        train_state = torch.load(folder / TRAIN_STATE, map_location="cpu", weights_only=True)
        everything, shards, _ = state_parts(model, optimizer)
        reader = SafeReader(folder)
        metadata = reader.read_metadata()
        self._fetch_missing(folder, files_read(shards, metadata, self.rank == 0))
        dcp_call(dcp.load, shards, storage_reader=reader, process_group=self.group)
        everything = merged(everything, train_state.pop("unsharded"))
        set_state_dict(model, optimizer, model_state_dict=everything["model"], optim_state_dict=everything["optim"])
        return train_state

    def _fetch_missing(self, folder: Path, needed: list[str]) -> None:
        """Files this rank reads that its node did not restore come from a node that has them."""
        present = {name for name in needed if (folder / name).is_file()}
        node = _node_key(folder.parent)
        ranks = _all_gather(self.group, self.world, (node, sorted(present), sorted(set(needed) - present),
                                                     _listing(folder)))
        for receiver, sender, name in transfers(ranks):
            if self.rank == sender:
                send_file(folder / name, receiver, self.group)
            elif self.rank == receiver:
                size = checkpoint.read_manifest(folder)["files"][name]["size"]
                with checkpoint.fill_in(folder, name) as stream:
                    receive_file(stream, size, sender, self.group)
        if ranks and any(missing for _, _, missing, _ in ranks):
            self.log(f"rank {self.rank}: files its node did not restore came from peers")


def transfers(ranks: list) -> list[tuple[int, int, str]]:
    """(receiver, sender, file) so that every node gets the files its ranks miss, once per node:
    the lowest rank of a node receives, the lowest rank of a node that holds the file sends.
    ranks[r] = (node, files it has of those it reads, files it misses, every file it holds). Pure."""
    planned, done = [], set()
    for rank, (node, _, missing, _) in enumerate(ranks):
        for name in missing:
            if (node, name) in done:
                continue
            done.add((node, name))
            receiver = min(r for r, entry in enumerate(ranks) if entry[0] == node)
            sender = next((r for r, entry in enumerate(ranks) if entry[0] != node and name in entry[3]), None)
            if sender is None:
                raise ShardSaveFailed(f"no node holds {name}, which rank {rank} reads")
            planned.append((receiver, sender, name))
    return sorted(planned)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file())


def _node_key(root: Path) -> tuple:
    """Which disk: ranks with the same key see the same checkpoint folder."""
    stat = os.stat(root)
    return socket.gethostname(), stat.st_dev, stat.st_ino


def _store_address(rank: int, world: int, group) -> tuple | None:
    """Where the save processes meet: torchrun's store (MASTER_ADDR:MASTER_PORT), under a prefix
    of this trainer's own (rank 0's choice), so that a restarted trainer never meets old ones."""
    if world == 1:
        return None
    prefix = _broadcast(group, world, f"shard-savers/{uuid.uuid4().hex}/" if rank == 0 else None)
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), prefix
