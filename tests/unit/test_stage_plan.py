"""scripts/lib/stage_code.py, what stage.sh decides before it uploads anything: which names and files
may go, what is uploaded, what is deleted (only what an earlier stage.sh put there, only with
--delete), and a record from S3 read as untrusted."""

from __future__ import annotations

import json
import sys

import pytest

import stage_code
from stage_code import BadInput, plan

MD5 = "0" * 32


def local(*names: str, md5: str = MD5) -> dict:
    return {n: {"size": 1, "md5": md5} for n in names}


def remote(*names: str, etag: str = MD5) -> dict:
    return {n: {"size": 1, "etag": etag} for n in names}


def test_a_file_is_unchanged_only_when_its_etag_is_its_md5_and_the_size_matches():
    result = plan({**local("same.py"), **local("edited.py", md5="1" * 32), **local("new.py"),
                   "resized.py": {"size": 2, "md5": MD5}, **local("multipart.bin")},
                  {**remote("same.py", "edited.py", "resized.py"), **remote("multipart.bin", etag=MD5 + "-3")},
                  recorded=set(), delete=False)
    assert result.unchanged == ["same.py"] and result.new == ["new.py"]
    assert result.changed == ["edited.py", "multipart.bin", "resized.py"]


@pytest.mark.parametrize("delete", [False, True])
def test_only_what_an_earlier_staging_put_there_is_ever_deleted_and_only_with_delete(delete):
    result = plan(local("train.py"), remote("train.py", "old.py", "mine.py", "pkg/mine.py"),
                  recorded={"train.py", "old.py"}, delete=delete)
    assert result.delete == (["old.py"] if delete else [])
    assert result.foreign == ["mine.py", "pkg/mine.py"]
    assert result.stale == ([] if delete else ["old.py"])
    # The record keeps naming a stale file until it is deleted, so a later --delete still can.
    assert result.record == (["train.py"] if delete else ["old.py", "train.py"])


def test_the_record_itself_is_neither_kept_nor_deleted():
    result = plan(local("a.py"), remote("a.py", stage_code.RECORD_KEY), {stage_code.RECORD_KEY}, delete=True)
    assert result.delete == [] and result.foreign == []


@pytest.mark.parametrize("text", [
    "not json", "[]", '{"format": 2, "files": ["a.py"]}', '{"format": 1, "files": "a.py"}',
    '{"format": 1, "files": ["../escape.py"]}', '{"format": 1, "files": ["/abs.py"]}',
    '{"format": 1, "files": ["a//b.py"]}', '{"format": 1, "files": [1]}', "[" * 100000,
])
def test_a_record_stage_sh_did_not_write_deletes_nothing(tmp_path, text):
    path = tmp_path / "record.json"
    path.write_text(text)
    recorded, warning = stage_code.read_record(path)
    assert recorded == set() and "nothing is deleted" in warning


def test_a_record_names_the_files_an_earlier_staging_put_there(tmp_path):
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"format": 1, "files": ["a.py", "pkg/b.py"]}))
    assert stage_code.read_record(path) == ({"a.py", "pkg/b.py"}, None)
    assert stage_code.read_record(tmp_path / "none.json") == (set(), None)


def test_the_listing_gives_keys_relative_to_the_prefix(tmp_path):
    path = tmp_path / "listing.json"
    path.write_text(json.dumps({"Contents": [
        {"Key": "code/a.py", "Size": 3, "ETag": f'"{MD5}"'}, {"Key": "code/", "Size": 0, "ETag": '"x"'},
        {"Key": "code/pkg/b.py", "Size": 4, "ETag": '"y"'}]}))
    assert stage_code.read_listing(path, "code/") == {"a.py": {"size": 3, "etag": MD5},
                                                      "pkg/b.py": {"size": 4, "etag": "y"}}
    (tmp_path / "empty.json").write_text("")
    assert stage_code.read_listing(tmp_path / "empty.json", "code/") == {}


@pytest.mark.parametrize("name,problem", [
    ("a\tb.py", "control character"), ("pkg/a\\b.py", "backslash"), ("x" * 256 + ".py", "more than 255 bytes"),
    ("data/train.py", "would land in one"), ("out/x.py", "would land in one"), (".venv-abc/x.py", "would land in one"),
    (".stage-record.json", "stage.sh's record"),
])
def test_names_s3_or_the_pods_work_dir_cannot_hold_are_refused(name, problem):
    with pytest.raises(BadInput, match=problem):
        stage_code.check_name(name, name)


def test_a_pod_folder_name_deeper_down_is_a_name_like_any_other():
    stage_code.check_name("mypkg/data/loader.py", "x")
    stage_code.check_name("mypkg/out.py", "x")


@pytest.mark.parametrize("name", [".env", ".env.local", "id_ed25519", "server.PEM", "tls.key", "credentials",
                                  ".netrc", "prod.kubeconfig"])
def test_secret_looking_files_are_refused(name, tmp_path):
    with pytest.raises(BadInput, match="looks like a secret"):
        stage_code.check_not_secret(f"conf/{name}", name, tmp_path / name)


@pytest.mark.parametrize("name", [".env.example", "id_rsa.pub", "keys.py", "credentials.py", "env.py"])
def test_files_that_only_resemble_secrets_go(name, tmp_path):
    stage_code.check_not_secret(name, name, tmp_path / name)


def test_a_folder_is_collected_recursively_following_links_and_skipping_bytecode_and_a_venv(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "vendored").mkdir(parents=True)
    (elsewhere / "vendored" / "lib.py").write_text("")
    source = tmp_path / "src"
    (source / "pkg" / "__pycache__").mkdir(parents=True)
    (source / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"")
    (source / "pkg" / "m.py").write_text("")
    (source / "pkg" / "big.ckpt").write_text("")
    (source / "vendored").symlink_to(elsewhere / "vendored")
    (source / ".venv" / "bin").mkdir(parents=True)
    (source / ".venv" / "bin" / "python").symlink_to(sys.executable)  # a binary, were it followed
    layout = stage_code.collect(source, excludes=("pkg/*.ckpt",))
    assert sorted(layout.files) == ["pkg/m.py", "vendored/lib.py"]
    assert layout.files["vendored/lib.py"] == (elsewhere / "vendored" / "lib.py").resolve()
    assert layout.skipped == 2


def test_the_runtime_helpers_go_beside_a_trainer_that_has_none(tmp_path):
    runtime = tmp_path / "job"
    runtime.mkdir()
    for name in stage_code.RUNTIME_MODULES:
        (runtime / name).write_text(f"# the runtime's {name}\n")
    layout = stage_code.Layout(files={"train.py": tmp_path / "train.py"})
    stage_code.add_runtime(layout, runtime, tmp_path)
    assert layout.files["checkpoint.py"] == (runtime / "checkpoint.py").resolve() and not layout.warnings


def test_keys_from_s3_reach_the_terminal_escaped(capsys):
    hostile = "evil\x1b[2J\x07\nforged line.py"
    shown = "evil\\x1b[2J\\x07\\nforged line.py"
    stage_code.show_plan(stage_code.Plan(new=[hostile], changed=[hostile], unchanged=[], delete=[hostile],
                                         stale=[hostile], foreign=[hostile, "b\u202ec.py"], record=[]),
                         "s3://bucket/code/")
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    lines = out.splitlines()
    assert len(lines) == 5 and all(shown in line for line in lines)
    assert "b\\u202ec.py" in lines[-1]


def planned(tmp_path, names: list[str], remote_names: list[str], recorded: set[str], delete: bool):
    for name in names:
        (tmp_path / name).write_text("")
    mine = {n: {"size": 1, "md5": MD5, "path": str(tmp_path / n)} for n in names}
    work = tmp_path / "work"
    work.mkdir()
    result = plan(mine, remote(*remote_names), recorded, delete)
    stage_code.write_plan(work, result, mine, "code/", recorded)
    return work


def record_in(path) -> list[str]:
    return json.loads(path.read_text())["files"]


def test_the_record_uploaded_with_the_code_names_the_files_to_delete_until_every_delete_succeeded(tmp_path):
    # A delete that fails after the code went up must leave a record that still names the stale
    # files, or a rerun takes them for the user's and never deletes them.
    work = planned(tmp_path, ["a.py"], ["a.py", "old.py"], recorded={"a.py", "old.py", "gone.py"}, delete=True)
    assert record_in(work / "upload" / stage_code.RECORD_KEY) == ["a.py", "old.py"]
    assert record_in(work / "final-record.json") == ["a.py"]
    assert [p.name for p in work.glob("delete-*.json")] == ["delete-001.json"]


def test_without_delete_there_is_no_request_and_no_final_record(tmp_path):
    work = planned(tmp_path, ["a.py"], ["a.py", "old.py"], recorded={"a.py", "old.py"}, delete=False)
    assert not list(work.glob("delete*.json")) and not (work / "final-record.json").exists()
    assert not (work / "upload" / stage_code.RECORD_KEY).exists(), "the record is unchanged: not uploaded"


def test_deletions_go_in_requests_of_at_most_1000_keys_as_s3_allows(tmp_path):
    stale = [f"old/{i:04d}.py" for i in range(1200)]
    work = planned(tmp_path, ["a.py"], ["a.py", *stale], recorded={"a.py", *stale}, delete=True)
    requests = [json.loads(p.read_text()) for p in sorted(work.glob("delete*.json"))]
    assert [len(r["Objects"]) for r in requests] == [1000, 200]
    assert [o["Key"] for r in requests for o in r["Objects"]] == [f"code/{k}" for k in stale]
    assert all(r["Quiet"] for r in requests)
