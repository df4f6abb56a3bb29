"""What the checkpoint protocol accepts from a bucket someone else can write: step names, file
names, manifest shapes and formats, signatures, and the torch that may unpickle a checkpoint.
Pure rules: no S3, no root."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

import pytest

import checkpoint
from train import torch_version_problem

SHA = "0" * 64
KEY = "unit-test-key-5f1c"


def manifest(**change) -> dict:
    value = {"format": 1, "files": {"model.pt": {"size": 7, "sha256": SHA}}, "meta": {"step": 5},
             "committed_at": 1.5}
    value.update(change)
    return value


@pytest.mark.parametrize("name,step", [
    ("step-00000010", 10),
    ("step-123456789", 123456789),
    ("step-00000010\n", None),          # $ matched before a trailing newline
    ("step-\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668", None),  # Arabic-Indic digits are \d
    ("step-0000001\uff10", None),       # a fullwidth zero
    ("step-0000010", None),             # fewer than 8 digits
    ("step-999999999999", 999999999999),  # 12 digits: the most
    ("step-0000000000001", None),       # 13
    ("step-" + "1" * 240, None),        # seen: its staging folder's name was too long for the disk, exit 1
    ("step-00000010/", None),
    (" step-00000010", None),
    ("best", None),
])
def test_parse_step_takes_only_ascii_step_names(name, step):
    assert checkpoint.parse_step(name) == step


@pytest.mark.parametrize("name,ok", [
    ("model.pt", True),
    ("state.pt", True),
    ("with space.pt", True),
    ("a" * 255, True),
    ("a" * 256, False),
    ("", False),
    (".", False),
    ("..", False),
    ("../../train.py", False),
    ("/etc/passwd", False),
    ("sub/model.pt", False),
    ("..\\train.py", False),
    ("manifest.json", False),
    ("model\n.pt", False),
    ("mod\x00el.pt", False),
    ("mod\u00e9l.pt", False),
    (7, False),
])
def test_a_checkpoint_file_name_is_a_plain_printable_ascii_name(name, ok):
    assert checkpoint.is_file_name(name) is ok
    files = {name: {"size": 7, "sha256": SHA}} if isinstance(name, str) else {}
    if isinstance(name, str):
        assert checkpoint.is_manifest(manifest(files=files), "step-00000005") is ok


@pytest.mark.parametrize("value,problem", [
    (manifest(), None),
    ([], "does not list files with size and sha256"),
    (manifest(files=[]), "does not list files with size and sha256"),
    (manifest(files={}), "does not list files with size and sha256"),  # nothing to load
    (manifest(files={"model.pt": "abc"}), "does not list files with size and sha256"),
    (manifest(files={"model.pt": {"size": "7", "sha256": SHA}}), "does not list files with size and sha256"),
    (manifest(files={"model.pt": {"size": True, "sha256": SHA}}), "does not list files with size and sha256"),
    (manifest(files={"model.pt": {"size": -1, "sha256": SHA}}), "does not list files with size and sha256"),
    (manifest(files={"model.pt": {"size": 7, "sha256": "abc"}}), "does not list files with size and sha256"),
    (manifest(meta=[]), "does not list files with size and sha256"),
    (manifest(files={"../../train.py": {"size": 7, "sha256": SHA}}), "names '../../train.py'"),
    (manifest(format=2), "has format 2"),
    (manifest(format="1"), "has format '1'"),
    (manifest(format=True), "has format True"),
    ({k: v for k, v in manifest().items() if k != "format"}, "has format None"),
])
def test_manifest_problem_names_what_is_wrong(value, problem):
    found = checkpoint.manifest_problem(value, "step-00000005")
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
    assert checkpoint.is_manifest(value, "step-00000005") is (problem is None)


def test_a_hostile_name_is_shown_escaped_and_short():
    found = checkpoint.manifest_problem(manifest(files={"x\n" * 500: {"size": 1, "sha256": SHA}}), "step-00000005")
    assert "\n" not in found and len(found) < 200


RUN = "s3://bucket/runs/a/"


def signed(value: dict, key: str = KEY, folder: str = "step-00000005", run: str = RUN) -> dict:
    """Signed as commit() signs: bound to the folder it is committed as and the run."""
    value = {**value, "folder": folder, "run": run}
    return {**value, "hmac": checkpoint.manifest_hmac(value, key.encode())}


def signed_unbound(value: dict, key: str = KEY) -> dict:
    """Signed as the runtime signed before it bound folder and run."""
    return {**value, "hmac": checkpoint.manifest_hmac(value, key.encode())}


@pytest.mark.parametrize("key,value,problem", [
    (None, manifest(), None),                               # no key: as before
    (None, manifest(hmac="anything"), None),                # no key: an hmac field is ignored
    ("", manifest(), None),                                 # an empty key is no key
    (KEY, signed(manifest()), None),
    (KEY, manifest(), "is not signed"),
    (KEY, manifest(hmac=7), "is not signed"),
    (KEY, signed(manifest(), key="another key"), "does not match CHECKPOINT_HMAC_KEY"),
    (KEY, {**signed(manifest()), "meta": {"step": 6}}, "does not match CHECKPOINT_HMAC_KEY"),
    (KEY, {**signed(manifest()), "committed_at": 2.5}, "does not match CHECKPOINT_HMAC_KEY"),
    (KEY, {**signed(manifest()), "files": {"model.pt": {"size": 8, "sha256": SHA}}},
     "does not match CHECKPOINT_HMAC_KEY"),
    # Seen before: a signed step-00000010/ copied to step-99999999/ was restored by every later pod.
    (KEY, signed(manifest(), folder="step-00000010"), "was signed for folder 'step-00000010', not 'step-00000005'"),
    (KEY, signed(manifest(), folder="best"), "was signed for folder 'best'"),  # best/ is no step
    (KEY, signed(manifest(), run="s3://bucket/runs/b/"), "was signed for run 's3://bucket/runs/b/'"),
    (KEY, {**signed(manifest()), "folder": "step-00000005x"}, "does not match CHECKPOINT_HMAC_KEY"),
    (KEY, signed_unbound(manifest()), "names no folder and run"),  # an older runtime's: binds nothing
    (None, signed(manifest(), folder="step-00000010", run="s3://x/y/"), None),  # no key: not looked at
])
def test_with_a_key_only_manifests_signed_with_it_for_this_folder_and_run_count(monkeypatch, key, value, problem):
    monkeypatch.setenv("S3_OUTPUT_URI", RUN)
    if key is None:
        monkeypatch.delenv("CHECKPOINT_HMAC_KEY", raising=False)
    else:
        monkeypatch.setenv("CHECKPOINT_HMAC_KEY", key)
    found = checkpoint.manifest_problem(value, "step-00000005")
    assert (found is None) if problem is None else (problem in found)
    if found:
        assert KEY not in found


def test_the_signature_survives_the_trip_through_json():
    value = manifest(meta={"step": 5, "val_loss": 0.1 + 0.2, "best_val_loss": float("inf"), "name": "\u00e9"})
    mac = checkpoint.manifest_hmac(value, KEY.encode())
    again = json.loads(json.dumps({**value, "hmac": mac}, indent=1, sort_keys=True))
    assert checkpoint.manifest_hmac(again, KEY.encode()) == mac


def write_checkpoint(folder) -> None:
    with checkpoint.stage(folder) as staged:
        with staged.open("model.pt") as file:
            file.write(b"weights")
        staged.commit(meta={"step": 5})


def test_commit_signs_and_readers_check_the_signature(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    signed_folder, unsigned_folder = tmp_path / "step-00000005", tmp_path / "step-00000010"
    write_checkpoint(signed_folder)
    written = json.loads((signed_folder / "manifest.json").read_text())
    assert len(written["hmac"]) == 64 and KEY not in json.dumps(written)
    assert checkpoint.verify(signed_folder) is None
    monkeypatch.delenv("CHECKPOINT_HMAC_KEY")
    write_checkpoint(unsigned_folder)
    assert checkpoint.newest_valid(tmp_path) == unsigned_folder  # no key: the newest, as before
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    skipped = []
    assert checkpoint.newest_valid(tmp_path, on_skip=lambda f, p: skipped.append(f)) == signed_folder
    assert not checkpoint.is_committed(unsigned_folder)
    assert "is not signed" in checkpoint.verify(unsigned_folder)


def test_a_signed_folder_copied_under_a_newer_name_or_from_another_run_is_skipped(tmp_path, monkeypatch):
    # What the trainer and hf_resume load goes through newest_valid: a copy is damaged there too.
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    monkeypatch.setenv("S3_OUTPUT_URI", RUN)
    ours = tmp_path / "step-00000005"
    write_checkpoint(ours)
    written = json.loads((ours / "manifest.json").read_text())
    assert (written["folder"], written["run"]) == ("step-00000005", RUN)
    shutil.copytree(ours, tmp_path / "step-99999999")
    shutil.copytree(ours, tmp_path / "best")
    monkeypatch.setenv("S3_OUTPUT_URI", "s3://bucket/runs/other")  # its trailing / is added
    theirs = tmp_path / "step-00000007"
    write_checkpoint(theirs)
    assert json.loads((theirs / "manifest.json").read_text())["run"] == "s3://bucket/runs/other/"
    monkeypatch.setenv("S3_OUTPUT_URI", RUN)
    assert checkpoint.newest_valid(tmp_path) == ours
    assert [p.name for _, p in checkpoint.committed_steps(tmp_path)] == ["step-00000005"], "the copies count for nothing"
    assert "signed for folder 'step-00000005', not 'step-99999999'" in checkpoint.verify(tmp_path / "step-99999999")
    assert "signed for run 's3://bucket/runs/other/'" in checkpoint.verify(theirs)
    assert checkpoint.read_manifest(tmp_path / "best") is None, "a step's manifest does not count as best/'s"
    assert checkpoint.read_manifest(ours) is not None


def deepest_json_the_parser_takes_here() -> bytes:
    """A forger's deepest nesting that json.loads still parses at this stack depth: json.dumps of it
    (a signature's) recurses one level further."""
    low, high = 1, 5000
    while low < high:
        middle = (low + high + 1) // 2
        try:
            json.loads("[" * middle + "]" * middle)
            low = middle
        except RecursionError:
            high = middle - 1
    return b'{"hmac": "x", "a": ' + b"[" * (low - 1) + b"]" * (low - 1) + b"}"


def test_a_forged_complete_or_manifest_nested_as_deep_as_the_parser_goes_is_not_signed(monkeypatch, tmp_path):
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    monkeypatch.setenv("S3_OUTPUT_URI", RUN)
    deep = deepest_json_the_parser_takes_here()
    assert "is not signed" in checkpoint.complete_problem(deep)
    (tmp_path / checkpoint.MANIFEST).write_bytes(deep)
    assert checkpoint.read_manifest(tmp_path) is None


def test_complete_is_signed_for_the_run_and_judged_like_a_manifest(monkeypatch):
    summary = {"steps": 10, "train_loss": 1.5, "completed_at": 2.5}
    monkeypatch.delenv("CHECKPOINT_HMAC_KEY", raising=False)
    assert checkpoint.signed_complete(summary) == summary, "no key: as before"
    assert checkpoint.complete_problem(b"anything at all") is None, "no key: any object ends the run, as before"
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    monkeypatch.setenv("S3_OUTPUT_URI", RUN)
    body = checkpoint.signed_complete(summary)
    assert body["run"] == RUN and len(body["hmac"]) == 64 and KEY not in json.dumps(body)
    assert checkpoint.complete_problem(json.dumps(body).encode()) is None
    as_manifest = signed(manifest())  # a manifest's signature is never a COMPLETE's
    forged = {
        b"": "is not signed", b"{}": "is not signed", json.dumps(summary).encode(): "is not signed",
        b"[" * 100_000: "is not signed", json.dumps({**body, "steps": 11}).encode(): "does not match",
        json.dumps(as_manifest).encode(): "does not match",
        json.dumps({**body, "pad": "x" * 70_000}).encode(): "is not signed",  # larger than a COMPLETE gets
    }
    for raw, problem in forged.items():
        assert problem in checkpoint.complete_problem(raw), raw[:80]
    monkeypatch.setenv("S3_OUTPUT_URI", "s3://bucket/runs/b/")
    assert "was signed for run 's3://bucket/runs/a/'" in checkpoint.complete_problem(json.dumps(body).encode())


@pytest.mark.parametrize("name", ["../escape.pt", "/tmp/abs.pt", "sub/x.pt", "", "..", "manifest.json", "\u00e9.pt"])
def test_staged_refuses_a_name_that_is_not_a_plain_file_name(tmp_path, name):
    with checkpoint.stage(tmp_path / "step-00000001") as staged:
        with pytest.raises(ValueError):
            with staged.open(name):
                pass
        with pytest.raises(ValueError):
            with staged.receive(name, {"size": 0, "sha256": SHA}):
                pass
    assert not (tmp_path / "escape.pt").exists()


@pytest.mark.parametrize("version,ok", [
    ("2.5.1+cu121", False),
    ("2.5.0", False),
    ("2.4.1", False),
    ("1.13.1", False),
    ("2.6.0a0+git1234", True),
    ("2.6.0", True),
    ("2.6.0+cu124", True),
    ("2.13.0", True),
    ("3.0.0", True),
    ("not a version", False),
])
def test_torch_older_than_2_6_may_not_load_a_checkpoint(version, ok):
    problem = torch_version_problem(version)
    assert (problem is None) is ok
    if problem:
        assert version in problem and "torch>=2.6" in problem and "\n" not in problem


def test_the_folder_restore_just_hashed_is_checked_by_size_only_and_no_other(tmp_path):
    older, newer = tmp_path / "step-00000005", tmp_path / "step-00000010"
    write_checkpoint(older)
    write_checkpoint(newer)
    record = tmp_path / "restore-verified.json"
    checkpoint.note_verified(record, newer)
    (newer / "model.pt").write_bytes(b"WEIGHTS")  # same size, other bytes: only a hash sees it
    verified = checkpoint.read_verified(record)
    assert checkpoint.is_verified(newer, verified) and not checkpoint.is_verified(older, verified)
    assert checkpoint.newest_valid(tmp_path, verified=verified) == newer, "not hashed again"
    skipped = []
    assert checkpoint.newest_valid(tmp_path, on_skip=lambda f, p: skipped.append((f, p))) == older
    assert skipped == [(newer, "model.pt does not match its sha256 in the manifest")]


def test_a_record_of_an_earlier_commit_of_the_same_name_vouches_for_nothing(tmp_path):
    folder = tmp_path / "step-00000005"
    write_checkpoint(folder)
    record = tmp_path / "restore-verified.json"
    checkpoint.note_verified(record, folder)
    checkpoint.discard(folder)
    with checkpoint.stage(folder) as staged:  # saved again: another manifest (committed_at differs)
        with staged.open("model.pt") as file:
            file.write(b"weights")
        staged.commit(meta={"step": 5, "again": True})
    (folder / "model.pt").write_bytes(b"WEIGHTS")
    assert not checkpoint.is_verified(folder, checkpoint.read_verified(record))
    assert checkpoint.newest_valid(tmp_path, verified=checkpoint.read_verified(record)) is None


@pytest.mark.parametrize("content", [None, "", "not json", "[]", '{"name": "step-00000005"}',
                                     '{"name": 5, "manifest_sha256": "x"}'])
def test_read_verified_takes_only_what_note_verified_writes(tmp_path, content):
    path = tmp_path / "record.json"
    if content is not None:
        path.write_text(content)
    assert checkpoint.read_verified(path) is None
    assert checkpoint.read_verified(None) is None


def test_a_received_file_stops_at_its_manifest_size_and_counts_only_when_it_matches(tmp_path):
    body = b"weights!"
    entry = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    with checkpoint.stage(tmp_path / "step-00000001") as staged:
        with pytest.raises(ValueError, match="more than 8 bytes"):  # replaced after it was listed: bigger
            with staged.receive("model.pt", entry) as stream:
                stream.write(body)
                stream.write(b"x" * 1000)
        assert (staged.path / "model.pt").stat().st_size == len(body), "not a byte past the manifest's size"
        with pytest.raises(ValueError, match="does not match its sha256"):
            with staged.receive("model.pt", entry) as stream:
                stream.write(b"weights?")
        with staged.receive("model.pt", entry) as stream:
            stream.write(body[:3])
            stream.write(body[3:])
        staged.commit(meta={"step": 1})
    assert checkpoint.verify(tmp_path / "step-00000001") is None


@pytest.mark.parametrize("durable", [True, False])
def test_a_received_file_is_on_disk_before_it_counts_unless_it_is_a_copy_of_s3s(tmp_path, fsynced, durable):
    """Its manifest is written after it, so a crash cannot leave a local manifest over bytes the
    disk never got. The restore's copies are not fsynced (durable=False): each start hashes the
    copy before it counts (tests/test_reliability.py: a damaged local copy is replaced)."""
    synced = fsynced
    body = b"weights!"
    with checkpoint.stage(tmp_path / "step-00000001") as staged:
        entry = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        with staged.receive("model.pt", entry, durable=durable) as stream:
            stream.write(body)
        assert synced == (["model.pt"] if durable else [])
        staged.commit(meta={"step": 1})
    assert synced[1 if durable else 0] == "manifest.json", "the file first, the manifest after"
    assert checkpoint.verify(tmp_path / "step-00000001") is None


@pytest.mark.parametrize("error,kind", [(errno.EIO, ValueError), (errno.ENAMETOOLONG, ValueError),
                                        (errno.ENOSPC, OSError), (errno.EROFS, OSError)])
def test_a_local_error_receiving_a_file_makes_the_checkpoint_unusable_not_a_crash(tmp_path, monkeypatch, error, kind):
    # A disk error (the OS's, simulated: there is no failing disk here) is this checkpoint's problem
    # here, like damage; a full or read-only volume stays itself: bad input, its own line.
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(error, os.strerror(error))))
    with checkpoint.stage(tmp_path / "step-00000001") as staged:
        with pytest.raises(kind) as raised:
            with staged.receive("model.pt", {"size": 3, "sha256": SHA}) as stream:
                stream.write(b"abc")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert type(raised.value) is kind
    if kind is ValueError:
        assert str(raised.value) == f"model.pt could not be written here ({os.strerror(error)})"


@pytest.mark.parametrize("output_uri, durable", [(None, True), ("", True), ("s3://bucket/runs/r/", False)])
def test_the_save_after_a_stop_skips_its_fsync_only_in_a_pod(monkeypatch, output_uri, durable):
    """Outside a pod (train.py on a laptop, Ctrl-C) the local copy is the only one."""
    import trainer_kit

    if output_uri is None:
        monkeypatch.delenv("S3_OUTPUT_URI", raising=False)
    else:
        monkeypatch.setenv("S3_OUTPUT_URI", output_uri)
    assert trainer_kit.stop_save_durable() is durable


@pytest.mark.parametrize("raw,fault", [
    (b'{"files": {"model.pt": {"size": 1}}}', None),
    (b"[" * 64 + b"]" * 64, None),
    (b"[" * 65 + b"]" * 65, "nested deeper than 64 levels"),
    (b'{"a": ' * 65 + b"1" + b"}" * 65, "nested deeper than 64 levels"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than the parser goes"),
    (b"{not json", "Expecting property name"),
])
def test_untrusted_json_is_bounded_in_depth(raw, fault):
    if fault is None:
        assert checkpoint.untrusted_json(raw) == json.loads(raw)
    else:
        with pytest.raises(checkpoint.TooDeep if "nested" in fault else ValueError, match=fault):
            checkpoint.untrusted_json(raw)


def test_checkpoint_py_alone_imports_with_the_standard_library_only(tmp_path):
    # Its promise to any trainer (docs/own-trainer.md): copied beside a script, it needs nothing else.
    import subprocess
    import sys

    shutil.copy(checkpoint.__file__, tmp_path / "checkpoint.py")
    result = subprocess.run([sys.executable, "-S", "-c", "import checkpoint, sys; print(sorted(m for m in sys.modules "
                             "if m in ('contract', 'torch', 'numpy')))"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
