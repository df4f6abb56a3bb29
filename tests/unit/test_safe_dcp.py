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
