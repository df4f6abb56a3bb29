"""A bucket someone else can write: what restore and the trainer do with what they find there.

A manifest naming a path out of the checkpoint folder, an object of another size than its
manifest says, a format this runtime does not know, a checkpoint that cannot fit on the disk, an
unsigned or wrongly signed checkpoint when CHECKPOINT_HMAC_KEY is set. Real S3 (moto over HTTP),
the real restore, and the real job.yaml through the local pod runner."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import checkpoint
import restore as restorelib
import s3 as s3lib
from helpers import train_command, train_env, write_config, write_corpus
from podlab import BUCKET, JOB_YAML, ROOT

PREFIX = "hostile/"
OLD, NEW = "step-00000005", "step-00000010"
KEY = "hmac-key-" + secrets.token_hex(16)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner and mounts need root")


def make_checkpoint(folder: Path, files: dict[str, bytes], step: int) -> Path:
    with checkpoint.stage(folder) as staged:
        for name, data in files.items():
            with staged.open(name) as file:
                file.write(data)
        staged.commit(meta={"step": step})
    return folder


def upload(s3, folder: Path, name: str, prefix: str = PREFIX) -> None:
    """Files first, manifest last, as the uploader does."""
    for path in sorted(folder.iterdir(), key=lambda p: p.name == checkpoint.MANIFEST):
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}checkpoints/{name}/{path.name}", Body=path.read_bytes())


def put_manifest(s3, name: str, manifest: dict) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}checkpoints/{name}/manifest.json", Body=json.dumps(manifest).encode())


def entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def old_checkpoint_in_s3(s3, tmp_path: Path) -> None:
    upload(s3, make_checkpoint(tmp_path / "made" / OLD, {"model.pt": b"old weights"}, 5), OLD)


def restore(s3, out: Path) -> str | None:
    return restorelib.restore(s3, s3lib.Location.parse(f"s3://{BUCKET}/{PREFIX}"), out)


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


PAYLOAD = b"print('HIJACKED')\n"


@pytest.mark.parametrize("name", ["../../train.py", "../../../train.py", "ABSOLUTE", "sub/model.pt", "..",
                                  "manifest.json", "mod\u00e9l.pt", "a" * 300, ""])
def test_a_manifest_may_name_only_plain_files_and_nothing_is_written_outside(s3, tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv("S3_RETRY_SECONDS", "3")  # an error taken for an outage would end the test soon
    if name == "ABSOLUTE":
        name = str(tmp_path / "absolute-target.py")
    old_checkpoint_in_s3(s3, tmp_path)
    before = files_under(tmp_path)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}checkpoints/{NEW}/{name}", Body=PAYLOAD)
    put_manifest(s3, NEW, {"format": 1, "files": {name: entry(PAYLOAD)}, "meta": {"step": 10}})
    out = tmp_path / "work" / "out"
    assert restore(s3, out) == OLD
    said = capsys.readouterr().out
    assert f"warning: {NEW} in S3 is damaged (its manifest names " in said, said
    assert "which is not a plain file name); trying the one before it" in said
    new_files = files_under(tmp_path) - before
    assert new_files == files_under(out / "checkpoints" / OLD), "nothing written outside the restored checkpoint"
    assert not any(PAYLOAD in p.read_bytes() for p in files_under(tmp_path))


@pytest.mark.parametrize("planted,problem", [
    ({"format": 2}, "its manifest has format 2, this runtime reads format 1"),
    ({"format": "1"}, "its manifest has format '1'"),
    ({"files": {"model.pt": {"size": 5, "sha256": "not hex"}}}, "its manifest does not list files with size and sha256"),
])
def test_a_manifest_of_unknown_format_or_shape_is_damaged(s3, tmp_path, capsys, planted, problem):
    old_checkpoint_in_s3(s3, tmp_path)
    new = make_checkpoint(tmp_path / "made" / NEW, {"model.pt": b"new weights"}, 10)
    upload(s3, new, NEW)
    put_manifest(s3, NEW, {**json.loads((new / checkpoint.MANIFEST).read_text()), **planted})
    assert restore(s3, tmp_path / "out") == OLD
    assert f"warning: {NEW} in S3 is damaged ({problem}" in capsys.readouterr().out


@pytest.mark.parametrize("body,problem", [
    (b"[" * 200_000 + b"]" * 200_000, "its manifest.json is not JSON"),     # RecursionError, not ValueError
    (b'{"format": 1, "files": {}, "meta": {"pad": "' + b"x" * (17 << 20) + b'"}}', "its manifest.json is larger than"),
])
def test_a_manifest_too_deep_or_too_large_is_damaged(s3, tmp_path, capsys, body, problem):
    old_checkpoint_in_s3(s3, tmp_path)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}checkpoints/{NEW}/manifest.json", Body=body)
    assert restore(s3, tmp_path / "out") == OLD
    assert f"warning: {NEW} in S3 is damaged ({problem}" in capsys.readouterr().out


@pytest.mark.parametrize("in_s3", [b"new weights, and then some more", b"new"])
def test_an_object_of_another_size_than_its_manifest_says_is_damage_found_before_any_download(
        s3, tmp_path, capsys, monkeypatch, in_s3):
    monkeypatch.setenv("S3_RETRY_SECONDS", "3")
    old_checkpoint_in_s3(s3, tmp_path)
    new = make_checkpoint(tmp_path / "made" / NEW, {"model.pt": b"new weights", "state.pt": b"state"}, 10)
    upload(s3, new, NEW)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}checkpoints/{NEW}/model.pt", Body=in_s3)
    fetched = []
    s3.meta.events.register("before-parameter-build.s3.GetObject", lambda params, **_: fetched.append(params["Key"]))
    assert restore(s3, tmp_path / "out") == OLD
    said = capsys.readouterr().out
    assert f"warning: {NEW} in S3 is damaged (model.pt has {len(in_s3)} bytes in S3, manifest says 11)" in said, said
    assert not any(f"/{NEW}/" in key and not key.endswith(checkpoint.MANIFEST) for key in fetched), fetched


@root_only
def test_a_checkpoint_larger_than_the_free_disk_exits_64_with_one_line(s3, tmp_path):
    new = make_checkpoint(tmp_path / "made" / NEW, {"model.pt": os.urandom(3 << 20)}, 10)
    upload(s3, new, NEW)
    small = tmp_path / "small"
    small.mkdir()
    # The restore in a mount namespace of its own, on a 1 MiB tmpfs: a full disk, for real.
    script = (f"mount -t tmpfs -o size=1m tmpfs {small} && exec {sys.executable} {ROOT / 'job' / 'restore.py'} "
              f"s3://{BUCKET}/{PREFIX} {small / 'out'}")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 64, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stdout
    assert re.search(rf"checkpoint {NEW} needs 3\.1 MB, 1\.0 MB free in {small / 'out'}\S*; give the workspace "
                     r"volume more room", errors[0]), errors[0]


@pytest.mark.parametrize("forged", ["unsigned", "signed with another key", "signed, then edited"])
def test_with_a_key_only_a_signed_checkpoint_is_restored(s3, tmp_path, capsys, monkeypatch, forged):
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    old_checkpoint_in_s3(s3, tmp_path)
    if forged == "unsigned":
        monkeypatch.delenv("CHECKPOINT_HMAC_KEY")
    elif forged == "signed with another key":
        monkeypatch.setenv("CHECKPOINT_HMAC_KEY", "another key")
    new = make_checkpoint(tmp_path / "made" / NEW, {"model.pt": b"new weights"}, 10)
    upload(s3, new, NEW)
    if forged == "signed, then edited":
        manifest = json.loads((new / checkpoint.MANIFEST).read_text())
        put_manifest(s3, NEW, {**manifest, "meta": {"step": 11}})

    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    assert restore(s3, tmp_path / "signed-out") == OLD
    said = capsys.readouterr().out
    assert f"warning: {NEW} in S3 is damaged (its manifest" in said, said
    assert KEY not in said
    restored = tmp_path / "signed-out" / "checkpoints" / OLD
    assert checkpoint.verify(restored) is None, "re-committed locally, signed with the same key"
    assert KEY not in (restored / checkpoint.MANIFEST).read_text()

    monkeypatch.delenv("CHECKPOINT_HMAC_KEY")
    assert restore(s3, tmp_path / "plain-out") == NEW, "without a key, signatures are not looked at"


def test_a_step_name_too_long_for_the_disk_is_no_checkpoint(s3, tmp_path, capsys):
    # Seen before: "step-" and 240 digits, newest of all, raised "File name too long" (exit 1, every pod).
    old_checkpoint_in_s3(s3, tmp_path)
    made = make_checkpoint(tmp_path / "made" / NEW, {"model.pt": b"new weights"}, 10)
    upload(s3, made, "step-" + "9" * 240)
    assert restore(s3, tmp_path / "out") == OLD
    assert "Traceback" not in capsys.readouterr().out


def test_a_disk_error_while_receiving_makes_the_checkpoint_damaged_not_a_crash(s3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("S3_RETRY_SECONDS", "3")  # taken for an outage, it would be retried this long, then 75
    old_checkpoint_in_s3(s3, tmp_path)
    upload(s3, make_checkpoint(tmp_path / "made" / NEW, {"model.pt": b"new weights"}, 10), NEW)

    class FailingDisk(io.FileIO):  # the OS's error, for NEW's files only: no failing disk here
        def write(self, data):
            if f".staging-{NEW}-" in self.name:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return super().write(data)

    monkeypatch.setattr(checkpoint, "open", lambda path, mode: FailingDisk(str(path), mode), raising=False)
    assert restore(s3, tmp_path / "out") == OLD
    said = capsys.readouterr().out
    assert f"warning: {NEW} in S3 is damaged (model.pt could not be written here (Input/output error))" in said, said


RUN_URI = f"s3://{BUCKET}/{PREFIX}"


@pytest.mark.parametrize("copy", ["under a newer step's name", "from another run", "best/ as a step"])
def test_with_a_key_a_signed_checkpoint_counts_only_as_the_folder_and_run_it_was_signed_for(
        s3, tmp_path, capsys, monkeypatch, copy):
    # Seen before: a writer without the key copied a signed step-00000010/ to step-99999999/, and every
    # later pod restored it and resumed at step 10, forever.
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    monkeypatch.setenv("S3_OUTPUT_URI", RUN_URI)
    old_checkpoint_in_s3(s3, tmp_path)
    if copy == "from another run":
        monkeypatch.setenv("S3_OUTPUT_URI", f"s3://{BUCKET}/another-run/")
    source = "best" if copy == "best/ as a step" else NEW
    made = make_checkpoint(tmp_path / "made" / source, {"model.pt": b"new weights"}, 10)
    target = NEW if copy == "from another run" else "step-99999999"
    upload(s3, made, target)
    monkeypatch.setenv("S3_OUTPUT_URI", RUN_URI)
    assert restore(s3, tmp_path / "out") == OLD
    said = capsys.readouterr().out
    expected = (f"its manifest was signed for run 's3://{BUCKET}/another-run/', not '{RUN_URI}'"
                if copy == "from another run" else f"its manifest was signed for folder '{source}', not 'step-99999999'")
    assert f"warning: {target} in S3 is damaged ({expected}" in said, said
    monkeypatch.delenv("CHECKPOINT_HMAC_KEY")
    assert restore(s3, tmp_path / "plain-out") == target, "without a key, as before: nothing is bound"


def test_a_torch_older_than_2_6_refuses_to_load_a_checkpoint_with_exit_64(tmp_path):
    data, cfg, out = write_corpus(tmp_path / "data"), write_config(tmp_path / "tiny.yaml"), tmp_path / "out"
    first = subprocess.run(train_command(cfg, data, out, extra=("--set", "train.max_steps=5")),
                           capture_output=True, text=True, env=train_env())
    assert first.returncode == 0 and checkpoint.committed_steps(out / "checkpoints"), first.stderr
    # No torch 2.5 can be installed here: this interpreter's torch reports itself as one.
    old = tmp_path / "old-torch"
    old.mkdir()
    (old / "sitecustomize.py").write_text("import torch, torch.torch_version\n"
                                          "torch.__version__ = torch.torch_version.TorchVersion('2.5.1+cu121')\n")
    again = subprocess.run(train_command(cfg, data, out, extra=("--set", "train.max_steps=10")),
                           capture_output=True, text=True, env=train_env(PYTHONPATH=str(old)))
    assert again.returncode == 64, again.stdout + again.stderr
    assert again.stderr.count("\n") == 1, again.stderr
    assert "torch 2.5.1+cu121 cannot load a checkpoint safely" in again.stderr
    assert "use an image with torch>=2.6" in again.stderr
    assert "resumed from" not in again.stdout


# -- through the real job.yaml -----------------------------------------------------------------

def trained_steps(pod) -> list[int]:
    return [e["step"] for e in pod.events if e["event"] == "step"]  # the trainer's events, not its prose


@root_only
@pytest.mark.slow
def test_a_manifest_naming_the_trainer_cannot_replace_it(run):
    """WORK_DIR/train.py is three levels up from the restore's staging folder."""
    hijack = b"print('HIJACKED')\nimport sys\nsys.exit(0)\n"
    name = "../../../train.py"
    run.s3.put_object(Bucket=BUCKET, Key=f"{run.prefix}checkpoints/{NEW}/{name}", Body=hijack)
    run.s3.put_object(Bucket=BUCKET, Key=f"{run.prefix}checkpoints/{NEW}/manifest.json", Body=json.dumps(
        {"format": 1, "files": {name: entry(hijack)}, "meta": {"step": 10}}).encode())
    code, pod = run.run(TRAIN_ARGS="--set train.max_steps=10")
    assert code == 0, pod.output[-3000:]
    assert "HIJACKED" not in pod.output
    assert f"warning: {NEW} in S3 is damaged (its manifest names '../../../train.py'" in pod.output
    assert trained_steps(pod)[0] == 1 and "COMPLETE" in run.keys()


@root_only
@pytest.mark.slow
def test_a_signed_run_skips_a_forged_checkpoint_and_never_shows_its_key(run, monkeypatch):
    code, pod = run.run(CHECKPOINT_HMAC_KEY=KEY, TRAIN_ARGS="--set train.max_steps=10")
    assert code == 0, pod.output[-3000:]
    manifests = [k for k in run.keys() if k.endswith(checkpoint.MANIFEST)]
    assert manifests
    for key in manifests:
        manifest = run.json(key)
        assert manifest["hmac"] == checkpoint.manifest_hmac(manifest, KEY.encode()), key
        assert f"checkpoints/{manifest['folder']}/manifest.json" == key and manifest["run"] == run.output_uri, key
    monkeypatch.setenv("CHECKPOINT_HMAC_KEY", KEY)
    monkeypatch.setenv("S3_OUTPUT_URI", run.output_uri)
    assert checkpoint.complete_problem(run.read("COMPLETE")) is None, "COMPLETE signed for this run"

    # Someone with write access to the bucket plants a newer checkpoint: whole, but unsigned; copies
    # the signed one under a newer step's name; and puts an unsigned COMPLETE in place of the real one.
    forged = dict(run.json(f"checkpoints/{NEW}/manifest.json"))
    del forged["hmac"]
    for step, manifest in (("step-00000020", forged), ("step-99999999", run.json(f"checkpoints/{NEW}/manifest.json"))):
        for file in forged["files"]:
            run.s3.copy_object(Bucket=BUCKET, Key=f"{run.prefix}checkpoints/{step}/{file}",
                               CopySource={"Bucket": BUCKET, "Key": f"{run.prefix}checkpoints/{NEW}/{file}"})
        run.s3.put_object(Bucket=BUCKET, Key=f"{run.prefix}checkpoints/{step}/manifest.json",
                          Body=json.dumps(manifest).encode())
    run.s3.put_object(Bucket=BUCKET, Key=f"{run.prefix}COMPLETE", Body=b'{"steps": 15}')
    code, second = run.run(CHECKPOINT_HMAC_KEY=KEY, TRAIN_ARGS="--set train.max_steps=15")
    assert code == 0, second.output[-3000:]
    assert f"warning: {run.output_uri}COMPLETE does not end this run: it is not signed" in second.output, second.output[-3000:]
    assert ("warning: step-99999999 in S3 is damaged (its manifest was signed for folder 'step-00000010', "
            "not 'step-99999999'" in second.output), second.output[-3000:]
    assert ("warning: step-00000020 in S3 is damaged (its manifest is not signed (CHECKPOINT_HMAC_KEY is set))"
            in second.output), second.output[-3000:]
    assert f"resumed from {NEW}" in second.output
    assert trained_steps(second)[0] == 11
    assert checkpoint.complete_problem(run.read("COMPLETE")) is None and run.json("COMPLETE")["steps"] == 15

    uploaded = b"".join(run.read(key) for key in run.keys())
    for output in (pod.output, second.output):
        assert KEY not in output, "printed"
    assert KEY.encode() not in uploaded, "uploaded"
    assert any(k.startswith("logs/") for k in run.keys()), "the scan covered the pods' logs"


@root_only
@pytest.mark.slow
def test_a_checkpoint_larger_than_the_workspace_fails_the_pod_with_64(run, tmp_path):
    job = yaml.safe_load(JOB_YAML.read_text())
    for volume in job["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "home":  # code and data fit, a 3 MB checkpoint does not
            volume["emptyDir"] = {"medium": "Memory", "sizeLimit": "1Mi"}
    small = tmp_path / "job-small-disk.yaml"
    small.write_text(yaml.safe_dump(job))
    big = make_checkpoint(tmp_path / "made" / NEW, {"model.pt": os.urandom(3 << 20)}, 10)
    upload(run.s3, big, NEW, prefix=run.prefix)
    before = run.keys()
    pod = run.start(small)
    assert pod.wait(timeout=300) == 64, pod.output[-3000:]
    errors = [line for line in pod.lines if re.search(r"\berror: ", line)]
    assert len(errors) == 1, errors
    assert re.search(rf"restore: error: checkpoint {NEW} needs 3\.1 MB, \d\.\d MB free in "
                     r"/home/eai_role/\S+; give the workspace volume more room", errors[0]), errors[0]
    attempt = run.json("status.json")["attempts"][-1]  # the restore's line is why the attempt failed
    assert attempt["exit_code"] == 64 and attempt["error"].startswith(f"restore: checkpoint {NEW} needs 3.1 MB"), attempt
    after = run.keys()
    assert all(after.get(key) == etag for key, etag in before.items()), "nothing in S3 changed"
