"""safe_dcp: a DCP checkpoint folder read without running what it holds. Its .metadata is unpickled
with DCP's classes only and may name only files of its folder; a value that is not a tensor loads only
if torch.load(weights_only=True) would load it."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import safe_dcp
import sharded


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist: one process, as meant
def test_dcp_metadata_is_read_with_dcp_classes_only(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=tmp_path, no_dist=True)
    metadata = safe_dcp.SafeReader(tmp_path).read_metadata()
    assert metadata.state_dict_metadata["w"].size == torch.Size([2, 3])
    target = {"w": torch.zeros(2, 3)}
    dcp.load(target, storage_reader=safe_dcp.SafeReader(tmp_path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(6.0).reshape(2, 3))


class _Runs:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(tmp_path):
    crafted = _Runs()
    crafted.marker = tmp_path / "ran"
    (tmp_path / safe_dcp.METADATA).write_bytes(pickle.dumps(crafted))
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not part of DCP's metadata"):
        safe_dcp.SafeReader(tmp_path).read_metadata()
    assert not crafted.marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_value_that_is_not_a_tensor_loads_as_plain_data_and_one_that_runs_code_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcp.save({"w": torch.ones(2), "lr": 0.5, "betas": (0.9, 0.95)}, checkpoint_id=tmp_path, no_dist=True)
    target = {"w": torch.zeros(2), "lr": 0.0, "betas": (0.0, 0.0)}
    dcp.load(target, storage_reader=safe_dcp.SafeReader(tmp_path), no_dist=True)
    assert target["lr"] == 0.5 and tuple(target["betas"]) == (0.9, 0.95) and torch.equal(target["w"], torch.ones(2))

    crafted = _Runs()
    crafted.marker = tmp_path / "ran"
    torch.save(crafted, tmp_path / "x.distcp")  # DCP's planner would torch.load it with weights_only=False
    metadata = pickle.loads((tmp_path / safe_dcp.METADATA).read_bytes())
    metadata.state_dict_metadata["lr"] = dcp_metadata.BytesStorageMetadata()
    metadata.storage_data[dcp_metadata.MetadataIndex("lr")] = _StorageInfo("x.distcp", 0, (tmp_path / "x.distcp").stat().st_size)
    (tmp_path / safe_dcp.METADATA).write_bytes(pickle.dumps(metadata))
    with pytest.raises(RuntimeError, match="UnpicklingError: 'lr' is not plain data: .*GLOBAL posix.system"):  # as Shards.load calls it
        sharded.dcp_call(dcp.load, {"lr": 0.0}, storage_reader=safe_dcp.SafeReader(tmp_path), no_dist=True)
    assert not crafted.marker.exists()


@pytest.mark.parametrize("path", ["../elsewhere.distcp", "/etc/passwd", "a/b.distcp", ""])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_naming_a_file_outside_its_folder_is_refused(tmp_path, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    metadata = pickle.loads((tmp_path / safe_dcp.METADATA).read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo(path, 0, 8)
    (tmp_path / safe_dcp.METADATA).write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError, match="not a file of its folder"):
        safe_dcp.SafeReader(tmp_path).read_metadata()


def crafted_folder(folder):
    crafted = _Runs()
    crafted.marker = folder / "ran"
    (folder / safe_dcp.METADATA).write_bytes(pickle.dumps(crafted))
    return crafted.marker


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_inside_readers_replaced_every_name_dcps_reader_is_held_by_reads_safely(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import format_utils

    marker = crafted_folder(tmp_path)
    original = dcp.FileSystemReader
    with safe_dcp.readers_replaced():
        with pytest.raises(BaseException, match="posix.system is not part of DCP's metadata"):
            dcp.load({"w": torch.zeros(2)}, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
        with pytest.raises(BaseException, match="posix.system is not part of DCP's metadata"):
            dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path, no_dist=True)  # DCP picks its reader itself
        with pytest.raises(BaseException, match="posix.system is not part of DCP's metadata"):
            format_utils.dcp_to_torch_save(tmp_path, tmp_path / "model.pt")
    assert not marker.exists()
    assert dcp.FileSystemReader is original and format_utils.FileSystemReader is original, "put back"


def test_threads_that_leave_in_another_order_keep_the_safe_reader_until_the_last_leaves():
    import threading

    import torch.distributed.checkpoint as dcp

    original = dcp.FileSystemReader
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with safe_dcp.readers_replaced():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with safe_dcp.readers_replaced():
            b_in.set()
            a_out.wait(10)
            seen["after a left"] = dcp.FileSystemReader

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen["after a left"] is safe_dcp.SafeReader
    assert dcp.FileSystemReader is original
