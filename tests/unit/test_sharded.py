"""Sharded checkpoints' pure parts: a staging folder that several ranks write into, a partial copy
(a node's own shard files), which node sends which file, the optimizer's unsharded values put
back, and the parallelism a checkpoint was saved with."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import checkpoint
import config
import sharded
from train import check_same_parallelism


def entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_staging_folder_others_wrote_into_commits_with_the_entries_they_measured(tmp_path):
    final = tmp_path / "step-00000005"
    folder = checkpoint.staging_path(final)
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"zero")
    (folder / "__1_0.distcp").write_bytes(b"one")
    staged = checkpoint.Staged(final, path=folder)
    staged.add_written("__0_0.distcp", entry(b"zero"))
    with pytest.raises(ValueError, match="__1_0.distcp has 3 bytes, manifest says 4"):
        staged.add_written("__1_0.distcp", entry(b"onee"))
    staged.add_written("__1_0.distcp", entry(b"one"))
    assert staged.commit(meta={"step": 5}) == final
    assert checkpoint.verify(final) is None and not folder.exists()


def test_only_a_staging_folder_of_that_checkpoint_can_be_adopted(tmp_path):
    with pytest.raises(ValueError, match="is not a staging folder of step-00000005"):
        checkpoint.Staged(tmp_path / "step-00000005", path=tmp_path)


def test_a_partial_copy_verifies_without_its_absent_files_and_is_filled_in_only_with_the_right_bytes(tmp_path):
    files = {"__0_0.distcp": entry(b"mine"), "__1_0.distcp": entry(b"theirs")}
    with checkpoint.stage(tmp_path / "step-00000005") as staged:
        with staged.open("__0_0.distcp") as file:
            file.write(b"mine")
        final = staged.commit(meta={}, files=files, absent=["__1_0.distcp"])
    assert checkpoint.read_manifest(final)["absent"] == ["__1_0.distcp"]
    assert checkpoint.verify(final) is None
    with pytest.raises(ValueError, match="does not match its sha256"):
        with checkpoint.fill_in(final, "__1_0.distcp") as stream:
            stream.write(b"THEIRS")
    assert not (final / "__1_0.distcp").exists() and sorted(os.listdir(final)) == ["__0_0.distcp", "manifest.json"]
    with checkpoint.fill_in(final, "__1_0.distcp") as stream:
        stream.write(b"theirs")
    assert (final / "__1_0.distcp").read_bytes() == b"theirs"


def test_absent_may_name_only_files_the_manifest_lists():
    value = {"format": 1, "files": {"a": entry(b"a")}, "meta": {}, "absent": ["b"]}
    assert checkpoint.manifest_problem(value, "step-00000001") == "its manifest's absent files are not names it lists"
    assert checkpoint.manifest_problem({**value, "absent": ["a"]}, "step-00000001") is None


def test_a_step_folder_left_without_its_manifest_is_removed_with_the_staging_leftovers(tmp_path):
    for name in ("step-00000005", "step-00000010", ".staging-step-00000015-abcd1234"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "step-00000010" / checkpoint.MANIFEST).write_text("{}")
    (tmp_path / "best").mkdir()
    checkpoint.remove_staging_leftovers(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["best", "step-00000010"]


# ranks[r] = (node, files it has of those it reads, files it misses, every file it holds)
TWO_NODES_SWAPPED = [("b", [], ["__0_0.distcp"], [".metadata", "__1_0.distcp"]),
                     ("a", [], ["__1_0.distcp"], [".metadata", "__0_0.distcp"])]


@pytest.mark.parametrize("ranks,planned", [
    ([("a", ["__0_0.distcp"], [], ["__0_0.distcp"]), ("b", ["__1_0.distcp"], [], ["__1_0.distcp"])], []),
    (TWO_NODES_SWAPPED, [(0, 1, "__0_0.distcp"), (1, 0, "__1_0.distcp")]),
    # two ranks on node b miss the same file: it crosses once, to the lower rank
    ([("a", [], [], ["x"]), ("b", [], ["x"], []), ("b", [], ["x"], [])], [(1, 0, "x")]),
])
def test_each_node_is_sent_the_files_its_ranks_miss_once(ranks, planned):
    assert sharded.transfers(ranks) == planned


def test_a_file_no_node_holds_is_an_error():
    with pytest.raises(sharded.ShardSaveFailed, match="no node holds x, which rank 1 reads"):
        sharded.transfers([("a", [], [], []), ("b", [], ["x"], [])])


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_the_optimizers_unsharded_values_come_from_the_checkpoint_and_a_missing_one_is_an_error(one_rank_mesh):
    from torch.distributed.tensor import Shard

    shard = sharded.DTensor.from_local(torch.zeros(2), one_rank_mesh, [Shard(0)])
    template = {"optim": {"state": {"w": {"exp_avg": shard, "step": torch.tensor(0.0)}},
                          "param_groups": [{"lr": 0.0}]}}
    saved = {"optim": {"state": {"w": {"exp_avg": None, "step": torch.tensor(7.0)}},
                       "param_groups": [{"lr": 3e-4}]}}
    got = sharded.merged(template, saved)
    assert got["optim"]["state"]["w"]["exp_avg"] is shard and got["optim"]["state"]["w"]["step"].item() == 7.0
    assert got["optim"]["param_groups"] == [{"lr": 3e-4}]
    with pytest.raises(KeyError, match="the checkpoint has no 'w'"):
        sharded.merged(template, {"optim": {"state": {}, "param_groups": []}})


@pytest.mark.parametrize("meta,parallelism,problem", [
    ({"shards": {"world_size": 2}}, "fsdp", None),
    ({}, "ddp", None),
    ({}, "fsdp", "checkpoint step-00000005 was saved with train.parallelism=ddp, the config says fsdp; set "
                 "train.parallelism: ddp, or use a new S3_OUTPUT_URI"),
    ({"shards": {"world_size": 2}}, "ddp", "checkpoint step-00000005 was saved with train.parallelism=fsdp, the "
                                          "config says ddp; set train.parallelism: fsdp, or use a new S3_OUTPUT_URI"),
])
def test_a_checkpoint_resumes_only_under_the_parallelism_it_was_saved_with(meta, parallelism, problem):
    if problem is None:
        check_same_parallelism(meta, parallelism, "step-00000005")
        return
    with pytest.raises(config.ConfigError) as raised:
        check_same_parallelism(meta, parallelism, "step-00000005")
    assert str(raised.value) == problem


def test_a_save_commits_when_dcp_save_returns_metadata_without_where_the_items_went(one_rank_mesh, tmp_path,
                                                                                       monkeypatch):
    # torch 2.11's FileSystemWriter.finish fills storage_data on a copy of the metadata (the one it
    # writes to .metadata): save() returns metadata without it. Every FSDP save failed there
    # (TypeError in files_read), on the H100 and on a CPU alike.
    import dataclasses

    from torch.distributed.tensor import Shard

    writes_a_copy = sharded.dcp.FileSystemWriter.finish
    monkeypatch.setattr(sharded.dcp.FileSystemWriter, "finish",
                        lambda self, metadata, results: writes_a_copy(self, dataclasses.replace(metadata), results))
    final = tmp_path / "step-00000001"
    staging = checkpoint.staging_path(final)
    staging.mkdir()
    job = sharded.SaveJob(str(tmp_path), final.name, str(staging), 0, 1, True, {"step": 1}, False, 2)
    shards = {"model.w": sharded.DTensor.from_local(torch.arange(4.0), one_rank_mesh, [Shard(0)])}
    assert sharded.write_and_commit(job, shards, {"step": 1}, None) == final
    assert checkpoint.verify(final) is None
    assert checkpoint.read_manifest(final)["meta"]["shards"]["reads"] == [["__0_0.distcp"]]
