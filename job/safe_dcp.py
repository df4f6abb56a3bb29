"""Reading a PyTorch Distributed Checkpoint (DCP) folder that someone else may have written.

DCP's own reader runs code from its files: `.metadata` is a pickle, and its load planner unpickles
every value that is not a tensor with torch.load(weights_only=False). Anyone who may write the bucket
may write a checkpoint's files when no CHECKPOINT_HMAC_KEY signs its manifest.

    reader = safe_dcp.SafeReader(folder)          # in place of dcp.FileSystemReader(folder)
    with safe_dcp.readers_replaced():             # dcp.FileSystemReader is SafeReader meanwhile,
        trainer.train(resume_from_checkpoint=...) # for code that builds its own (accelerate's FSDP load)

sharded.py (train.py under FSDP) and hf_resume.py (a Trainer under FSDP) use it. It ships with the
runtime (job/, on the trainer's PYTHONPATH) and code/ links it. It needs torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import pickle
import sys
import threading
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

import checkpoint

METADATA = ".metadata"  # DCP's index of every shard: which file, where in it


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose .metadata is unpickled with DCP's own classes only, whose files are
    plain names in its folder, and whose non-tensor values load as torch.load(weights_only=True)
    would."""

    def __init__(self, path, *args, **kwargs):
        super().__init__(path, *args, **kwargs)
        self._metadata = None

    def reset(self, checkpoint_id=None) -> None:  # dcp.load(checkpoint_id=...) points it at a folder
        super().reset(checkpoint_id)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            with open(Path(self.path) / METADATA, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
            if not isinstance(metadata, dcp_metadata.Metadata):
                raise pickle.UnpicklingError(f"{METADATA} holds no DCP metadata")
            for where in (metadata.storage_data or {}).values():
                name = getattr(where, "relative_path", None)
                if not checkpoint.is_file_name(name):
                    raise pickle.UnpicklingError(f"{METADATA} names {checkpoint.shown(name)}, not a file of its folder")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _PlainBytes(planner))


@contextlib.contextmanager
def readers_replaced():
    """DCP's reader is SafeReader while inside, under every name a loaded module holds it by:
    `dcp.FileSystemReader`, which accelerate's load_fsdp_model and load_fsdp_optimizer (a Trainer's
    FSDP resume) build their readers by, and the copies DCP's own modules took when they loaded
    (dcp.load(checkpoint_id=...) without a reader, format_utils). Threads may enter and leave in any
    order: the first in replaces, the last out puts back."""
    global _inside
    with _lock:
        if _inside == 0:
            _replaced.extend(_replace_everywhere())
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                for module in _replaced:
                    if vars(module).get(_NAME) is SafeReader:
                        setattr(module, _NAME, _DCP_READER)
                _replaced.clear()


_NAME = "FileSystemReader"
_DCP_READER = dcp.FileSystemReader  # DCP's own, which every module that loaded holds under _NAME
_lock = threading.Lock()
_inside = 0
_replaced: list = []


def _replace_everywhere() -> list:
    """The modules whose FileSystemReader was DCP's own, now SafeReader. Only each module's own
    namespace is read (vars), so a lazy module is never made to import anything."""
    replaced = []
    for module in list(sys.modules.values()):
        if module is not None and vars(module).get(_NAME) is _DCP_READER:
            setattr(module, _NAME, SafeReader)
            replaced.append(module)
    return replaced


class _PlainBytes:
    """A load planner whose load_bytes first unpickles the value as weights_only=True does (tensors,
    numbers, strings, containers): what passes names no other global, so the planner's own
    torch.load(weights_only=False) of the same bytes builds only those."""

    def __init__(self, planner):
        self._planner = planner

    def __getattr__(self, name: str):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as err:  # torch's message is a page long; its reason is one line
            reason = next((line for line in str(err).splitlines() if "GLOBAL" in line), "refused")
            raise pickle.UnpicklingError(f"{checkpoint.shown(read_item.dest_index.fqn)} is not plain data: {reason}") from None
        self._planner.load_bytes(read_item, io.BytesIO(data))


def _metadata_classes() -> dict:
    allowed = {("torch.distributed.checkpoint.metadata", name): value for name, value in vars(dcp_metadata).items()
               if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("builtins", "getattr")] = _enum_member
    allowed[("pathlib", "PosixPath")] = Path
    allowed[("collections", "OrderedDict")] = dict
    return allowed


def _enum_member(owner, name: str):
    """The one use of getattr in DCP's metadata: a member of one of its enums."""
    if isinstance(owner, type) and issubclass(owner, enum.Enum) and name in owner.__members__:
        return owner[name]
    raise pickle.UnpicklingError(f"DCP metadata asks for {name!r} of {owner!r}")


class _MetadataUnpickler(pickle.Unpickler):
    allowed = None

    def find_class(self, module: str, name: str):
        if _MetadataUnpickler.allowed is None:
            _MetadataUnpickler.allowed = _metadata_classes()
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
