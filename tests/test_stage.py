"""scripts/stage.sh against the local S3 with the real AWS CLI: a user's code folder staged whole
with the runtime's helpers beside it, nothing deleted that stage.sh did not put there, a dry run
that changes nothing, every check before the first upload, and S3 errors in one line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from podlab import BUCKET, ROOT, tool_env
from s3_fault_proxy import FaultProxy

STAGE = str(ROOT / "scripts" / "stage.sh")
URI = f"s3://{BUCKET}/code/"


def stage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([STAGE, *args], capture_output=True, text=True, env=env or tool_env(), timeout=300)


def keys(s3, prefix: str = "code/") -> dict[str, bytes]:
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def put(s3, key: str, body: bytes) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"code/{key}", Body=body)


def user_folder(root: Path) -> Path:
    """A user's code as it is on a laptop: a script, a package with a subpackage, a config, a link
    to a file elsewhere, and what must not travel (bytecode)."""
    (root / "mypkg" / "layers").mkdir(parents=True)
    (root / "config").mkdir()
    (root / "my_train.py").write_text("import mypkg\n")
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "layers" / "attention.py").write_text("HEADS = 4\n")
    (root / "config" / "run.yaml").write_text("steps: 10\n")
    (root / "requirements.txt").write_text("numpy\n")
    (root / "shared_utils.py").symlink_to(ROOT / "job" / "train_args.py")
    (root / "mypkg" / "__pycache__").mkdir()
    (root / "mypkg" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    return root


def test_staging_keeps_what_the_user_put_in_the_prefix_with_or_without_delete(s3):
    # Before: stage.sh mirrored code/ with `aws s3 sync --delete`, removing these.
    put(s3, "my_train.py", b"print('mine')\n")
    put(s3, "mypkg/__init__.py", b"")
    put(s3, "mypkg/model.py", b"W = 1\n")
    for flags in ((), ("--delete",)):
        result = stage(URI, *flags)
        assert result.returncode == 0, result.stderr
        staged = keys(s3)
        assert staged["my_train.py"] == b"print('mine')\n" and staged["mypkg/model.py"] == b"W = 1\n", flags
        assert "mypkg/__init__.py" in staged and staged["train.py"] == (ROOT / "code" / "train.py").read_bytes()
        assert staged["config/smoke.yaml"] == (ROOT / "config" / "smoke.yaml").read_bytes()


def test_a_user_folder_is_staged_whole_with_the_runtime_helpers_beside_it_less_what_is_excluded(s3, tmp_path):
    folder = user_folder(tmp_path / "mycode")
    (folder / "contract.py").write_text("# my own\n")  # a module of the user's that the runtime also has
    (folder / ".env").write_text("TOKEN=x\n")  # refused unless excluded (test_bad_input_...)
    (folder / "mypkg" / "weights.ckpt").write_bytes(b"\0")
    result = stage(URI, "--code", str(folder), "--exclude", ".env", "--exclude", "mypkg/*.ckpt")
    assert result.returncode == 0, result.stderr
    staged = keys(s3)
    assert set(staged) == {"my_train.py", "mypkg/__init__.py", "mypkg/layers/attention.py", "config/run.yaml",
                           "requirements.txt", "shared_utils.py", "checkpoint.py", "contract.py",
                           ".stage-record.json"}
    assert staged["shared_utils.py"] == (ROOT / "job" / "train_args.py").read_bytes(), "a link goes as its file"
    assert staged["checkpoint.py"] == (ROOT / "job" / "checkpoint.py").read_bytes()
    assert staged["contract.py"] == b"# my own\n", "the user's own module wins, as on the pod"
    assert "contract.py is not the runtime's" in result.stderr


def test_delete_removes_only_what_an_earlier_staging_put_there_and_a_dry_run_changes_nothing(s3, tmp_path):
    folder = user_folder(tmp_path / "mycode")
    assert stage(URI, "--code", str(folder)).returncode == 0
    put(s3, "notes.txt", b"by hand")
    (folder / "mypkg" / "layers" / "attention.py").unlink()
    (folder / "my_train.py").write_text("import mypkg  # changed\n")
    before = keys(s3)

    dry = stage(URI, "--code", str(folder), "--dry-run", "--delete")
    assert dry.returncode == 0, dry.stderr
    assert keys(s3) == before, "a dry run changes nothing"
    shown = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in dry.stdout.splitlines()
             if line.startswith("  ")}
    assert shown["upload (changed)"] == "my_train.py" and shown["delete"] == "mypkg/layers/attention.py"
    assert "notes.txt" in shown["kept"] and "staged code" not in dry.stdout

    kept = stage(URI, "--code", str(folder))
    assert kept.returncode == 0, kept.stderr
    after = keys(s3)
    assert after["my_train.py"] == b"import mypkg  # changed\n"
    assert "mypkg/layers/attention.py" in after, "nothing is deleted without --delete"

    deleted = stage(URI, "--code", str(folder), "--delete")
    assert deleted.returncode == 0, deleted.stderr
    after = keys(s3)
    assert "mypkg/layers/attention.py" not in after, "staged before and gone from the folder: deleted"
    assert after["notes.txt"] == b"by hand", "never staged by stage.sh: never deleted"
    assert {"my_train.py", "mypkg/__init__.py", "checkpoint.py"} <= set(after)


def test_files_a_failed_delete_left_are_deleted_by_the_next_run(s3, s3_endpoint, tmp_path):
    # Before: the record that went up with the code named the folder's files alone, so after a
    # failed delete the stale file counted as the user's and no rerun ever deleted it.
    folder = user_folder(tmp_path / "mycode")
    assert stage(URI, "--code", str(folder)).returncode == 0
    (folder / "mypkg" / "layers" / "attention.py").unlink()
    with FaultProxy(upstream=s3_endpoint, error_rate=1.0, error_match="?delete") as proxy:
        failed = stage(URI, "--code", str(folder), "--delete",
                       env={**tool_env(), "AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1"})
    assert failed.returncode == 75, failed.stdout + failed.stderr
    assert "mypkg/layers/attention.py" in keys(s3) and "staged code" not in failed.stdout

    again = stage(URI, "--code", str(folder), "--delete")
    assert again.returncode == 0, again.stderr
    after = keys(s3)
    assert "mypkg/layers/attention.py" not in set(after), "staged before, left by the failed delete: deleted now"
    assert "mypkg/layers/attention.py" not in json.loads(after[".stage-record.json"])["files"]


def bad_folder(tmp_path: Path, case: str) -> list[str]:
    """stage.sh's arguments for a folder with one problem."""
    folder = user_folder(tmp_path / "mycode")
    if case == "a .env file":
        (folder / ".env").write_text("AWS_SECRET_ACCESS_KEY=x\n")
    elif case == "a private key in a package":
        (folder / "mypkg" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    elif case == "a dangling link":
        (folder / "gone.py").symlink_to(tmp_path / "nowhere.py")
    elif case == "a loop of folders":
        (folder / "mypkg" / "again").symlink_to(folder)
    elif case == "the pod's out/ folder":
        (folder / "out" / "checkpoints").mkdir(parents=True)
        (folder / "out" / "checkpoints" / "x").write_text("")
    elif case == "a newline in a name":
        (folder / "bad\nname.py").write_text("")
    elif case == "no folder":
        return [URI, "--code", str(tmp_path / "missing")]
    elif case == "no python file":
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "notes.md").write_text("")
        return [URI, "--code", str(empty)]
    elif case == "the data inside the code prefix":
        return [URI, "--code", str(folder), "--data", str(folder), URI + "data/"]
    elif case == "an unknown option":
        return [URI, "--code", str(folder), "--force"]
    return [URI, "--code", str(folder)]


BAD = {
    "a .env file": "looks like a secret (.env)",
    "a private key in a package": "looks like a secret (id_rsa)",
    "a dangling link": "which does not exist; fix or remove the link",
    "a loop of folders": "a loop",
    "the pod's out/ folder": "out would land in one",
    "a newline in a name": "control character",
    "no folder": "is not a folder",
    "no python file": "holds no .py file",
    "the data inside the code prefix": "overlap; give each its own prefix",
    "an unknown option": "unknown option --force",
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_exits_64_with_one_line_before_anything_is_uploaded(s3, tmp_path, case):
    result = stage(*bad_folder(tmp_path, case))
    assert result.returncode == 64, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stage.sh: error: ") and BAD[case] in lines[0], lines
    assert keys(s3, "") == {}, "nothing uploaded"


@pytest.mark.parametrize("where,code", [("no such bucket", 64), ("no S3 at the endpoint", 75)])
def test_an_s3_error_exits_with_one_line_and_never_says_staged(s3, tmp_path, where, code):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "val.bin"):
        (data / name).write_bytes(b"\0\0" * 100)
    env = tool_env()
    uri = URI
    if where == "no such bucket":
        uri = "s3://no-such-bucket-here/code/"
    else:
        env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1")
    result = stage(uri, "--data", str(data), f"s3://{BUCKET}/data/", env=env)
    assert result.returncode == code, result.stdout + result.stderr
    errors = result.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("stage.sh: error: "), errors
    assert ("does not exist" in errors[0]) if code == 64 else ("run stage.sh again" in errors[0])
    assert "staged" not in result.stdout


def test_a_failed_data_upload_after_the_code_never_says_staged_data(s3, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "val.bin"):
        (data / name).write_bytes(b"\0\0" * 100)
    result = stage(URI, "--data", str(data), "s3://no-such-bucket-here/data/")
    assert result.returncode == 64, result.stdout + result.stderr
    assert "staged code" in result.stdout and "staged data" not in result.stdout
    assert result.stderr.splitlines() == [
        "stage.sh: error: bucket no-such-bucket-here does not exist; create it or fix the URI s3://no-such-bucket-here/data/"]


def test_help_prints_usage_and_exits_0():
    result = subprocess.run([STAGE, "--help"], capture_output=True, text=True, env=tool_env())
    assert result.returncode == 0 and not result.stderr
    assert "scripts/stage.sh S3_CODE_URI" in result.stdout
    for option in ("--code", "--exclude", "--delete", "--dry-run", "--data", "--model"):
        assert option in result.stdout


def test_no_arguments_exit_64_with_the_usage_in_one_line():
    result = subprocess.run([STAGE], capture_output=True, text=True, env={**os.environ})
    assert result.returncode == 64
    assert len(result.stderr.splitlines()) == 1 and "usage: scripts/stage.sh S3_CODE_URI" in result.stderr
