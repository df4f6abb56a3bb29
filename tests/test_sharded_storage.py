"""A sharded step (train.parallelism: fsdp) in S3: uploaded like any other, manifest last and signed;
restored by a node of a group in part (the files its ranks read), each file verified; a node's
partial copy never goes up. The real uploader and restore against the local S3."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import checkpoint
import restore as restorelib
import s3 as s3lib
from podlab import BUCKET
from test_uploader import JOB, keys_in_s3, take_lease, uploader_env

SHARD_FILES = {".metadata": b"index" * 10, "__0_0.distcp": b"rank zero" * 100, "__1_0.distcp": b"rank one" * 100,
               "train_state.pt": b"rng and counters"}
SHARDS_META = {"format": "dcp", "world_size": 2, "reads": [["__0_0.distcp"], ["__1_0.distcp"]],
               "common": [".metadata", "train_state.pt"]}
KEY = "sharded-unit-key"
PREFIX = "runs/sharded/"
WHERE = s3lib.Location.parse(f"s3://{BUCKET}/{PREFIX}")


def commit_sharded(root, step: int, files: dict = SHARD_FILES) -> None:
    with checkpoint.stage(root / checkpoint.step_dir_name(step)) as staged:
        for name, data in files.items():
            with staged.open(name) as file:
                file.write(data)
        staged.commit(meta={"step": step, "keep": 2, "shards": SHARDS_META})


def upload(tmp_path, s3_endpoint, out) -> str:
    """`uploader.py final` (exit code 1: no COMPLETE), once; its output."""
    env = uploader_env(tmp_path, s3_endpoint)
    take_lease(env, f"s3://{BUCKET}/{PREFIX}")
    result = subprocess.run([sys.executable, str(JOB / "uploader.py"), "final", f"s3://{BUCKET}/{PREFIX}", str(out),
                             "1"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def local_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_sharded_step_goes_up_signed_and_each_node_restores_only_its_ranks_files(s3, s3_endpoint, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv(checkpoint.HMAC_KEY_ENV, KEY)
    node0 = tmp_path / "node0"
    commit_sharded(node0 / "checkpoints", 5)
    output = upload(tmp_path, s3_endpoint, node0)
    assert "step-00000005 is in S3" in output
    key = f"{PREFIX}checkpoints/step-00000005/manifest.json"
    remote = json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert "hmac" in remote and checkpoint.manifest_problem(remote, "step-00000005") is None and "absent" not in remote

    for rank, other in ((0, "__1_0.distcp"), (1, "__0_0.distcp")):
        out = tmp_path / f"restored{rank}"
        assert restorelib.restore(s3, WHERE, out, ranks=(rank, 1, 2)) == "step-00000005"
        folder = out / "checkpoints" / "step-00000005"
        assert local_files(folder) == sorted({*SHARD_FILES, checkpoint.MANIFEST} - {other})
        manifest = checkpoint.read_manifest(folder)
        assert manifest["absent"] == [other] and manifest["files"] == remote["files"]
        assert checkpoint.verify(folder) is None, "a partial copy verifies: its absent file is not looked for"
    whole = tmp_path / "one-process"
    assert restorelib.restore(s3, WHERE, whole, ranks=(0, 1, 1)) == "step-00000005"
    assert local_files(whole / "checkpoints" / "step-00000005") == sorted({*SHARD_FILES, checkpoint.MANIFEST}), \
        "another world size reads every file: all come down"

    # Node 0's partial copy: S3 has the step whole, so nothing is written; S3 without it: still nothing.
    etag = s3.head_object(Bucket=BUCKET, Key=key)["ETag"]
    upload(tmp_path, s3_endpoint, tmp_path / "restored0")
    assert s3.head_object(Bucket=BUCKET, Key=key)["ETag"] == etag
    for key in keys_in_s3(s3, f"{PREFIX}checkpoints/"):
        s3.delete_object(Bucket=BUCKET, Key=key)
    output = upload(tmp_path, s3_endpoint, tmp_path / "restored0")
    assert "holds only this node's shard files" in output
    assert not keys_in_s3(s3, f"{PREFIX}checkpoints/"), "a node's part of a step never goes up as the step"


def test_a_node_verifies_each_file_it_fetches_and_a_damaged_one_of_its_own_sends_it_to_the_step_before(
        s3, s3_endpoint, tmp_path):
    made = tmp_path / "made"
    commit_sharded(made, 5)
    commit_sharded(made, 10)
    for step in (5, 10):
        folder = made / checkpoint.step_dir_name(step)
        for path in folder.iterdir():
            body = path.read_bytes()
            if step == 10 and path.name == "__1_0.distcp":
                body = body.replace(b"rank one", b"RANK ONE", 1)  # same size: only its sha256 tells
            s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}checkpoints/{folder.name}/{path.name}", Body=body)
    assert restorelib.restore(s3, WHERE, tmp_path / "node1", ranks=(1, 1, 2)) == "step-00000005"
    assert restorelib.restore(s3, WHERE, tmp_path / "node0", ranks=(0, 1, 2)) == "step-00000010", \
        "node 0 reads nothing of rank 1's file"
    with pytest.raises(s3lib.Unavailable, match="__1_0.distcp does not match its sha256"):
        restorelib.restore_named(s3, WHERE, tmp_path / "node1-named", "step-00000010", 0, ranks=(1, 1, 2))


@pytest.mark.parametrize("argv,parsed", [
    (["s3://b/r/", "out"], (["s3://b/r/", "out"], {})),
    (["s3://b/r/", "out", "--ranks", "2:2:4"], (["s3://b/r/", "out"], {"--ranks": (2, 2, 4)})),
    (["s3://b/r/", "out", "--step", "", "--ranks", "0:1:2"],
     (["s3://b/r/", "out"], {"--step": "", "--ranks": (0, 1, 2)})),
    (["s3://b/r/", "out", "--ranks", "2:3:4"], None),  # past the world
    (["s3://b/r/", "out", "--ranks", "0:0:4"], None),
    (["s3://b/r/", "out", "--ranks", "1:1"], None),
    (["s3://b/r/", "out", "--ranks", "\u0661:1:2"], None),
    (["s3://b/r/", "out", "--step"], None),
    (["s3://b/r/", "out", "--step", "a", "--step", "b"], None),
])
def test_restore_takes_a_block_of_ranks_of_a_world(argv, parsed):
    assert restorelib.parse_args(argv) == parsed


@pytest.mark.parametrize("meta,ranks,files", [
    ({"shards": SHARDS_META}, (1, 1, 2), {".metadata", "train_state.pt", "__1_0.distcp"}),
    ({"shards": SHARDS_META}, (0, 2, 2), set(SHARD_FILES)),
    ({"shards": SHARDS_META}, (0, 1, 4), None),  # saved by 2, resumed by 4: every file
    ({}, (0, 1, 2), None),  # not sharded
    ({"shards": {**SHARDS_META, "reads": [["__0_0.distcp"], ["../x"]]}}, (1, 1, 2), None),  # not its file
    ({"shards": {**SHARDS_META, "reads": "all"}}, (1, 1, 2), None),
    ({"shards": {**SHARDS_META, "common": [{}]}}, (0, 1, 2), None),  # a forged meta: names that are not text
    ({"shards": {**SHARDS_META, "reads": [[["__0_0.distcp"]], []]}}, (0, 1, 2), None),
])
def test_a_node_fetches_what_the_manifest_says_its_ranks_read_or_everything(meta, ranks, files):
    manifest = {"files": {name: {} for name in SHARD_FILES}, "meta": meta}
    assert restorelib.remote_checkpoints.ranks_files(manifest, ranks) == files


def _exchange(rank: int, roots: list, port: int, results) -> None:
    """One rank of a group of 2 whose nodes each restored the other's shard (ranks not in node order)."""
    import torch.distributed as dist

    import sharded

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    folder = roots[rank] / "step-00000005"
    shards = sharded.ShardedCheckpoints(rank, 2, None, print)
    shards._fetch_missing(folder, [".metadata", f"__{rank}_0.distcp"])
    results[rank] = sorted(p.name for p in folder.iterdir())
    dist.destroy_process_group()


def test_a_rank_whose_node_restored_another_ranks_shard_is_sent_its_own_by_that_node(s3, tmp_path):
    import torch.multiprocessing as mp

    from podlab import free_ports

    made = tmp_path / "made"
    commit_sharded(made, 5)
    for path in (made / "step-00000005").iterdir():
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}checkpoints/step-00000005/{path.name}", Body=path.read_bytes())
    # Each node restored the block of the other (its name sorted the other way): node a holds rank
    # 1's file, node b rank 0's.
    roots = [tmp_path / "node-b", tmp_path / "node-a"]
    for root, ranks in zip(roots, ((1, 1, 2), (0, 1, 2))):
        assert restorelib.restore(s3, WHERE, root, ranks=ranks) == "step-00000005"
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_exchange, args=([r / "checkpoints" for r in roots], free_ports(1), results), nprocs=2)
        got = dict(results)
    for rank in (0, 1):
        assert f"__{rank}_0.distcp" in got[rank], got
        folder = roots[rank] / "checkpoints" / "step-00000005"
        assert (folder / f"__{rank}_0.distcp").read_bytes() == SHARD_FILES[f"__{rank}_0.distcp"]
        assert checkpoint.verify(folder) is None
