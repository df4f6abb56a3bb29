"""Checkpoints committed by a background process: training waits only for a copy of its state.

    saver = AsyncSaver(device, log)
    saver.reserve(nbytes)  # after the first step: the buffer's pages touched off the training loop
    saver.submit(root, name, model_state, state, meta, best, keep)  # blocks for the snapshot only
    saver.poll()     # each step: logs a finished save, raises SaveFailed if the save process failed
    saver.wait()     # until the save in flight is committed (SIGTERM, the last step)
    saver.close()

submit() copies every tensor into CPU buffers the save process shares (pinned on CUDA). That
process runs write_step(), as the synchronous path does: files, manifest last, rename, best/ linked,
old steps pruned; one save at a time, so prune never removes what a save links from. A second
submit() waits for the first rather than hold a second copy. The save process dies with the trainer
(PR_SET_PDEATHSIG): a SIGKILLed trainer leaves a staging folder, never a committed step.

Why a process: torch.save holds the GIL, which a thread would take from training. Why spawn: fork
copies torch's and gloo's thread locks, which no thread in the child would release. Why a memfd:
a container's /dev/shm is 64 MiB unless a memory emptyDir is mounted there; a memfd is plain pod
memory, handed over the socket (SCM_RIGHTS). docs/performance.md has what the copy costs.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import importlib
import mmap
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Any, Callable

import torch

import checkpoint

# Test-only: seconds the save process sleeps between model.pt and state.pt, so a test can kill it
# (or the trainer) while a save is in flight.
TEST_DELAY_ENV = "TRAIN_TEST_SAVE_DELAY"
SAVER_NICENESS = 5  # on a busy CPU, training keeps the upper hand; the save still gets its share
_ALIGN = 64
_PR_SET_PDEATHSIG = 1


class SaveFailed(RuntimeError):
    """The background save failed or its process died: that step is not committed."""


class NoSpace(OSError):
    """The save process ran out of disk space (the trainer turns it into bad input, exit 64)."""


def write_step(root: Path, name: str, model_state, state: dict, meta: dict, best: bool, keep: int,
               beat: Callable[[], None] = lambda: None, durable: bool = True) -> Path:
    """Commit checkpoint `name` under `root`, link best/ to it if `best`, prune to `keep`.
    Not `durable` (trainer_kit.stop_save_durable): its files are not fsynced, and nothing is
    pruned, so the step before it stays whole on disk."""
    final = root / name
    # Passed only when False: a checkpoint.py of one's own from before `durable` still saves.
    with checkpoint.stage(final) as staged, without_crc32():
        open_file = staged.open if durable else functools.partial(staged.open, durable=False)
        with open_file("model.pt") as file:
            torch.save(model_state, file)
        beat()
        _test_delay()
        with open_file("state.pt") as file:
            torch.save(state, file)
        staged.commit(meta=meta)
    beat()
    if best:
        link_best(root, final, meta)
    if durable:
        checkpoint.prune(root, keep)
    return final


@contextlib.contextmanager
def without_crc32():
    """torch.save with no CRC-32 of its records: the manifest's sha256 already covers every byte,
    torch.load does not need it, and it costs 0.15 s of CPU a 500 MB (a third of the save
    process's own CPU here, and as long again in every synchronous save). torch's setting is global,
    so it is put back after."""
    serialization = torch.serialization
    if not hasattr(serialization, "set_crc32_options"):  # torch before 2.6 always computes it
        yield
        return
    before = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        yield
    finally:
        serialization.set_crc32_options(before)


def link_best(root: Path, source: Path, meta: dict) -> None:
    """best/ holds hard links to a committed step's model.pt (a sharded step: every file, the
    weights being spread over the ranks' files), with that step's meta."""
    files = checkpoint.read_manifest(source)["files"]
    names = ["model.pt"] if "model.pt" in files else sorted(files)
    with checkpoint.stage(root / "best") as staged:
        for name in names:
            staged.add_link(source / name, files[name])
        staged.commit(meta=meta, replace=True)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def folder_mb(folder: Path) -> float:
    return folder_bytes(folder) / 1e6


def _test_delay() -> None:
    delay = float(os.environ.get(TEST_DELAY_ENV) or 0)
    if delay > 0:
        time.sleep(delay)


# -- the state as a skeleton plus tensors ------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """Where a tensor was in the state: the storage it views (an index into the layout), and how."""

    index: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class Layout:
    """One storage's place in the shared buffer."""

    offset: int
    nbytes: int


def flatten(obj, storages: list, seen: dict):
    """`obj` with every tensor replaced by a Slot. Storages are what is copied, each once, as
    torch.save writes them: tied weights stay tied, a view keeps its strides. An object met twice
    (a tensor, the betas tuple that param groups share) stays one object, so pickle's memo, and
    with it every byte torch.save writes, is the same as for the live state."""
    if ("object", id(obj)) in seen:
        return seen["object", id(obj)]
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (obj.device, storage._cdata)  # the identity torch.save itself uses for a storage
        if key not in seen:
            seen[key] = len(storages)
            storages.append(torch.empty(0, dtype=torch.uint8, device=obj.device).set_(storage))
        copy = Slot(seen[key], obj.dtype, tuple(obj.shape), tuple(obj.stride()), obj.storage_offset())
    elif isinstance(obj, (dict, list, tuple)):
        copy = _rebuilt_like(obj, lambda value: flatten(value, storages, seen))
    else:
        return obj
    seen["object", id(obj)] = copy
    seen["alive", id(obj)] = obj  # ids stay unique while the walk lasts
    return copy


def rebuild(obj, bases: Callable[[int], torch.Tensor], made: dict | None = None):
    """The inverse of flatten: each Slot becomes a tensor over its storage's bytes in the shared
    buffer; tensors of one storage share it, so torch.save writes it once, as for the live state."""
    made = {} if made is None else made
    if ("object", id(obj)) in made:
        return made["object", id(obj)]
    if isinstance(obj, Slot):
        copy = bases(obj.index).view(obj.dtype).as_strided(obj.shape, obj.stride, obj.offset)
    elif isinstance(obj, (dict, list, tuple)):
        copy = _rebuilt_like(obj, lambda value: rebuild(value, bases, made))
    else:
        return obj
    made["object", id(obj)] = copy
    made["alive", id(obj)] = obj
    return copy


def _rebuilt_like(obj, convert: Callable):
    """A dict, OrderedDict, list or tuple like `obj`, its values converted."""
    if isinstance(obj, dict):
        items = [(k, convert(v)) for k, v in obj.items()]
        copy = collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
        if hasattr(obj, "_metadata"):  # state_dict()'s module versions, which torch.save keeps
            copy._metadata = obj._metadata
        return copy
    items = [convert(v) for v in obj]
    return items if isinstance(obj, list) else tuple(items)


def plan(storages: list[torch.Tensor]) -> tuple[list[Layout], int]:
    """Each storage's place in one buffer (64-byte aligned), and the buffer's size."""
    layout, offset = [], 0
    for storage in storages:
        nbytes = storage.numel()
        layout.append(Layout(offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return layout, max(offset, _ALIGN)


def snapshot_bytes(obj) -> int:
    """The buffer size a snapshot of `obj` (any state submit() takes) needs."""
    storages: list[torch.Tensor] = []
    flatten(obj, storages, {})
    return plan(storages)[1]


def _new_buffer(nbytes: int) -> tuple[int, mmap.mmap]:
    """A memfd of `nbytes` and its shared mapping (the save process maps the same fd)."""
    fd = os.memfd_create("checkpoint-snapshot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def bytes_over(buffer, place: Layout) -> torch.Tensor:
    """A uint8 tensor of its own storage (torch.save writes only these bytes) over part of `buffer`."""
    if place.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=place.nbytes, offset=place.offset)


class _Bases:
    """Slot index -> the uint8 tensor over that storage's bytes, one per storage."""

    def __init__(self, buffer, layout: list[Layout]):
        self.buffer, self.layout, self.bases = buffer, layout, {}

    def __call__(self, index: int) -> torch.Tensor:
        if index not in self.bases:
            self.bases[index] = bytes_over(self.buffer, self.layout[index])
        return self.bases[index]


# -- the trainer's side --------------------------------------------------------------------------

@dataclass
class _Request:
    root: str
    name: str
    model: Any
    state: Any
    meta: dict
    best: bool
    keep: int
    layout: list
    durable: bool = True

    def run(self, buffer) -> tuple:
        """In the save process: commit the state the buffer holds; the outcome for the trainer."""
        views = _Bases(buffer, self.layout)
        made: dict = {}
        return saved_in_process(lambda: write_step(Path(self.root), self.name, rebuild(self.model, views, made),
                                                   rebuild(self.state, views, made), self.meta, self.best,
                                                   self.keep, durable=self.durable))


@dataclass
class _InFlight:
    """The save submitted and not yet seen committed (monotonic times)."""

    final: Path
    requested: float  # submit() was called
    copied: float  # submit() returned
    blocked: float  # training waited this long in submit()


class AsyncSaver:
    """The trainer's handle on its save process (started at the first save)."""

    def __init__(self, device: torch.device, log: Callable[[str], None],
                 beat: Callable[[], None] = lambda: None,
                 on_commit: Callable[[Path, int, float, float], None] = lambda *report: None,
                 preload: tuple[str, ...] = ()):
        """`on_commit(final, bytes, seconds, blocked_seconds)` is called here, in the trainer, once
        poll() or wait() sees a save committed: seconds from submit() to the commit, blocked_seconds
        of those that submit() held training (the copy, and a wait for the save before it).
        `preload`: modules the save process imports as it starts, not at its first save (a
        sharded save's request needs `sharded`, whose torch.distributed imports take 0.7 s here)."""
        self.device, self.log, self.beat, self.on_commit = device, log, beat, on_commit
        self.preload = preload
        self._process = None
        self._conn = None
        self._buffer = None
        self._fd: int | None = None
        self._layout: list[Layout] | None = None
        self._targets: list[torch.Tensor] = []
        self._pinned = None
        self._in_flight: _InFlight | None = None
        self._reserving: threading.Thread | None = None
        self._reserved: tuple[int, mmap.mmap] | None = None  # (memfd, its mapping), every page touched

    def submit(self, root: Path, name: str, model_state, state: dict, meta: dict, best: bool,
               keep: int, durable: bool = True) -> None:
        def request(skeleton, layout) -> _Request:
            return _Request(str(root), name, skeleton["model"], skeleton["state"], meta, best, keep, layout,
                            durable)

        self.submit_job(Path(root) / name, {"model": model_state, "state": state}, request)

    def submit_job(self, final: Path, tree, make_request: Callable[[Any, list], Any]) -> None:
        """Copy the tensors of `tree` into the shared buffer and send the save process
        make_request(skeleton, layout): an object whose run(buffer) it calls (see _Request.run),
        where the skeleton is `tree` with every tensor replaced by its place in the buffer."""
        requested = time.monotonic()
        if self._in_flight:
            waiting_for, started = self._in_flight.final.name, time.monotonic()
            self.wait()
            self.log(f"waited {time.monotonic() - started:.2f}s for checkpoint {waiting_for} to commit "
                     f"before taking {final.name}; checkpoint.interval is shorter than a save")
        started = time.monotonic()
        storages: list[torch.Tensor] = []
        skeleton = flatten(tree, storages, {})
        layout, size = plan(storages)
        if layout != self._layout:  # the first save, or the state changed shape: buffers are reused
            self._allocate(layout, size)
        self.start()
        with torch.no_grad():
            for target, storage in zip(self._targets, storages):
                target.copy_(storage, non_blocking=self._pinned is not None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every copy has landed before the process reads it
        self._send(("save", make_request(skeleton, self._layout)))
        copied = time.monotonic()
        self._in_flight = _InFlight(final, requested, copied, blocked=copied - requested)
        self.log(f"saving {final.name} in the background (pid {self._process.pid}); "
                 f"training waited {copied - started:.2f}s for the copy")

    def reserve(self, nbytes: int) -> None:
        """Allocate a buffer of `nbytes` and touch its pages in a thread, while training goes on;
        the first submit() whose state fits takes it (see the module's docstring)."""
        if self._buffer is not None or self._reserving is not None:
            return

        def allocate() -> None:
            fd = None
            try:
                fd, buffer = _new_buffer(nbytes)
                torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).fill_(0)
            except Exception as err:  # noqa: BLE001 - submit() allocates, as without it
                if fd is not None:
                    os.close(fd)
                self.log(f"warning: could not set {nbytes / 1e6:.0f} MB aside for checkpoint snapshots "
                         f"({type(err).__name__}: {err}); the first save allocates it")
                return
            self._reserved = (fd, buffer)

        self._reserving = threading.Thread(target=allocate, name="checkpoint-buffer", daemon=True)
        self._reserving.start()

    def _take_reserved(self, size: int) -> tuple[int, mmap.mmap] | None:
        """The reserved buffer if it holds `size` bytes (waiting for its thread), else None."""
        if self._reserving is not None:
            self._reserving.join()
        reserved, self._reserved = self._reserved, None
        if reserved is not None and len(reserved[1]) < size:
            os.close(reserved[0])
            return None  # the mapping goes with its last reference
        return reserved

    def poll(self) -> None:
        """Non-blocking: report a save that finished; raise SaveFailed if it failed."""
        if self._in_flight and self._conn.poll():
            self._receive()

    def wait(self) -> None:
        """Until no save is in flight; the heartbeat goes on meanwhile."""
        while self._in_flight:
            if self._conn.poll(1.0):
                self._receive()
            self.beat()

    def close(self) -> None:
        """Wait for the save in flight, then let the process go."""
        try:
            if self._process and self._process.is_alive():
                self.wait()
        finally:
            self._stop_process()
            self._release()
            reserved = self._take_reserved(0)  # never used: a run that saved nothing
            if reserved is not None:
                os.close(reserved[0])

    def _receive(self) -> None:
        saving = self._in_flight
        name = saving.final.name
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._in_flight = None
            self._process.join(5)
            code = self._process.exitcode
            raise SaveFailed(f"the checkpoint save process died (exit code {code}) while writing {name}; "
                             f"that step is not committed, the run stops so the next start resumes from "
                             f"the newest committed one") from None
        self._in_flight = None
        if reply[0] == "ok":
            nbytes, seconds, committed = reply[1:]  # CLOCK_MONOTONIC: one clock for both processes
            self.log(f"checkpoint {name} committed: {nbytes / 1e6:.1f} MB in {seconds:.2f}s (in the background, "
                     f"{committed - saving.copied:.2f}s after the copy)")
            self.on_commit(saving.final, nbytes, committed - saving.requested, saving.blocked)
        elif reply[0] == "nospace":
            raise NoSpace(errno.ENOSPC, reply[1], name)
        else:
            raise SaveFailed(f"saving checkpoint {name} failed in the save process: {reply[1]}; that step is "
                             f"not committed")

    def start(self) -> None:
        """Start the save process (it imports torch meanwhile); submit() does it if not done."""
        if self._process:
            if not self._process.is_alive():
                raise SaveFailed(f"the checkpoint save process died (exit code {self._process.exitcode}) "
                                 f"between saves")
            return
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        self._process = context.Process(target=_serve, args=(theirs, os.getpid(), self.preload),
                                        name="checkpoint-saver", daemon=True)
        with _stop_signals_ignored_by_children():
            self._process.start()
        theirs.close()  # only the child holds that end now: its death reads as EOF here
        self._conn = ours
        if self._buffer is not None:
            self._send_buffer()

    def _allocate(self, layout: list[Layout], size: int) -> None:
        self._release()
        reserved = self._take_reserved(size)
        if reserved is not None:
            self._fd, self._buffer = reserved
        else:
            self._fd, self._buffer = _new_buffer(size)
        self._layout = layout
        self._targets = [bytes_over(self._buffer, place) for place in layout]
        if self.device.type == "cuda":
            self._pin(len(self._buffer))
        if self._process:
            self._send_buffer()

    def _pin(self, size: int) -> None:
        """Page-lock the buffer so GPU-to-CPU copies run by DMA, asynchronously (as pin_memory())."""
        base = torch.frombuffer(self._buffer, dtype=torch.uint8, count=1).data_ptr()
        result = torch.cuda.cudart().cudaHostRegister(base, size, 1)  # 1: portable, as torch pins
        if int(result) != 0:
            self.log(f"warning: could not pin {size / 1e6:.0f} MB for checkpoint snapshots (cuda error "
                     f"{int(result)}); the copy off the GPU is slower")
            return
        self._pinned = base

    def _send_buffer(self) -> None:
        self._send(("buffer", len(self._buffer)))
        reduction.send_handle(self._conn, self._fd, self._process.pid)  # SCM_RIGHTS over the socket

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._process.join(5)
            raise SaveFailed(f"the checkpoint save process died (exit code {self._process.exitcode}) "
                             f"between saves") from None

    def _release(self) -> None:
        if self._pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = None
        self._targets = []
        self._layout = None
        self._buffer = None  # unmapped once the last tensor over it is gone
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _stop_process(self) -> None:
        if self._process is None:
            return
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("stop",))
            self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()
        self._process = self._conn = None
        self._in_flight = None


# -- the save process ----------------------------------------------------------------------------

def _serve(conn, trainer_pid: int, preload: tuple[str, ...] = ()) -> None:
    """The save process: map the buffer it is handed, commit each request, answer with the outcome."""
    _die_with_parent(trainer_pid)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the trainer decides when to stop; it waits for us
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(1)
    os.nice(SAVER_NICENESS)
    for name in preload:  # while training runs: a stop's save that comes early does not wait for it
        importlib.import_module(name)
    buffer = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone
        if message[0] == "stop":
            # Every save was answered after its commit: nothing is left to flush. The interpreter's
            # finalization (torch's modules, its last garbage collection) is skipped: the trainer
            # waits for this process to end, and it cost 0.42 s of a 124M trainer's exit here.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if message[0] == "buffer":
            fd = reduction.recv_handle(conn)
            buffer = mmap.mmap(fd, message[1])
            os.close(fd)
            continue
        conn.send(message[1].run(buffer))


def saved_in_process(save: Callable[[], Path | None]) -> tuple:
    """The save process's answer for save(), which returns the folder it committed (None: another
    process commits it): ("ok", bytes, seconds, committed at), ("nospace", why) or ("error", why)."""
    started = time.monotonic()
    try:
        final = save()
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return ("nospace", str(err))
        return ("error", f"{type(err).__name__}: {err}{raised_at(err)}")
    except Exception as err:  # noqa: BLE001 - any failure is reported to the trainer, which stops
        return ("error", f"{type(err).__name__}: {err}{raised_at(err)}")
    committed = time.monotonic()
    return ("ok", folder_bytes(final) if final else 0, committed - started, committed)


def raised_at(err: BaseException) -> str:
    """Where `err` was raised (the innermost frame): in the save process there is no traceback to
    read, and a bare "TypeError: 'NoneType' object is not subscriptable" says nothing of where."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (raised at {Path(last.filename).name}:{last.lineno} in {last.name})"


@contextlib.contextmanager
def _stop_signals_ignored_by_children():
    """torchrun stops a worker with SIGTERM to its whole process group, and the save process is in
    it: it must ignore the signal from its first instruction, not only once it has imported torch.
    An ignored signal stays ignored across exec (a mask does not: spawn resets it), so the trainer
    ignores them while it starts the process, with them blocked meanwhile: on Linux a blocked
    signal is kept pending even when ignored, and reaches the trainer's own handler afterwards."""
    stop = (signal.SIGTERM, signal.SIGINT)
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be changed from the main thread
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stop}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _die_with_parent(trainer_pid: int) -> None:
    """SIGKILL this process when the trainer dies (Linux), so no writer outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != trainer_pid:  # the trainer died before the line above ran
        os._exit(1)
