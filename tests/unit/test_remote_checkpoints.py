"""The S3 side of the checkpoint protocol, its pure parts: which steps retention removes, how a
manifest read from S3 is judged, and the order of writes that keeps S3 from showing half a
checkpoint as committed. The client below stands for the network only: it hands back given bodies
and records requests; the code under test is remote_checkpoints itself."""

from __future__ import annotations

import hashlib
import io
import json

import botocore.exceptions
import pytest

import checkpoint
import remote_checkpoints
import s3 as s3lib

CKPTS = s3lib.Location("bucket", "runs/r/checkpoints/")
SHA = "0" * 64
GOOD = {"format": 1, "files": {"model.pt": {"size": 3, "sha256": SHA}}, "meta": {"step": 5}}


def step(n: int) -> str:
    return checkpoint.step_dir_name(n)


def folder(n: int, *files: str, committed: bool = True) -> list[str]:
    """The keys of one step folder, relative to checkpoints/."""
    return [f"{step(n)}/{f}" for f in files + (("manifest.json",) if committed else ())]


@pytest.mark.parametrize("listed, keep, ours, removed", [
    ([], 3, set(), []),
    (folder(1, "a") + folder(2, "a", committed=False), 1, set(), []),   # nothing committed: nothing goes
    (folder(1, "a") + folder(2, "a") + folder(3, "a"), 2, set(), [1]),
    (folder(1, "a") + folder(2, "a") + folder(3, "a"), 3, set(), []),
    (folder(1, "a") + folder(2, "a") + folder(3, "a"), 0, set(), [1, 2]),  # at least the newest stays
    (folder(1, "a") + folder(2, "a") + folder(3, "a"), -1, set(), [1, 2]),
    (folder(1, "a") + folder(2, "a") + folder(3, "a"), 1, {1}, [2]),      # this pod's own line stays
    (folder(1, "a") + folder(2, "a", committed=False) + folder(3, "a"), 2, set(), [2]),  # between kept ones
    (folder(1, "a") + folder(2, "a", committed=False) + folder(3, "a"), 1, set(), [1, 2]),  # a dead upload
    (folder(3, "a") + folder(4, "a", committed=False), 1, set(), []),    # newer than the newest: under way
    (folder(1, "a") + folder(2, "a") + ["best/manifest.json", "best/a", "step-1/manifest.json",
                                         "step-00000001x/a", "notes.txt"], 1, set(), [1]),  # not step folders
    (folder(2, "a") + folder(1, "a") + folder(10, "a"), 1, set(), [1, 2]),  # by step, not listing order
])
def test_which_steps_retention_removes(listed, keep, ours, removed):
    assert [name for name, _ in remote_checkpoints.to_prune(listed, keep, ours)] == [step(n) for n in removed]


def test_a_pruned_step_goes_with_all_its_keys_and_nothing_else():
    listed = folder(1, "a", "b") + folder(2, "a") + ["best/a", "step-00000001x/a"]
    assert remote_checkpoints.to_prune(listed, 1, set()) == [
        (step(1), ["step-00000001/a", "step-00000001/b", "step-00000001/manifest.json"])]


class Network:
    """Stands for S3 on the wire: GET answers from `bodies` (absent: NoSuchKey), writes are recorded."""

    def __init__(self, bodies: dict[str, bytes] | None = None):
        self.bodies, self.requests, self.sent = bodies or {}, [], {}
        self.part, self.reread = 2, False
        self.between_passes = lambda: None

    def get_object(self, Bucket, Key):
        if Key not in self.bodies:
            raise botocore.exceptions.ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        return {"Body": io.BytesIO(self.bodies[Key]), "ETag": '"e"'}

    def upload_fileobj(self, fileobj, bucket, key, **_):
        """Reads as s3transfer does (a part at a time from the front); botocore may read a part
        again from its start (a checksum, a retry): `reread` does that to the first part."""
        first = fileobj.read(self.part)
        if self.reread:
            fileobj.read()  # a checksum's pass over the whole body
            self.between_passes()
            fileobj.seek(0)
            first = fileobj.read(self.part)
        body = first + b"".join(iter(lambda: fileobj.read(self.part), b""))
        fileobj.close()  # s3transfer closes the body of a single PutObject
        self.requests.append(("upload_fileobj", key))
        self.sent[key] = body

    def __getattr__(self, operation):  # put_object, copy, delete_object(s)
        def record(*args, **kwargs):
            key = kwargs.get("Key") or (args[2] if operation in ("upload_fileobj", "copy") else None)
            self.requests.append((operation, key or [o["Key"] for o in kwargs["Delete"]["Objects"]]))
        return record


def no_retry(call, *args, **kwargs):
    return call(*args, **kwargs)


MANIFEST_KEY = CKPTS.key(step(5), "manifest.json")


@pytest.mark.parametrize("body, judged, problem", [
    (None, False, None),                                               # never committed
    (b"{not json", False, "its manifest.json is not JSON"),
    (b"[" * 100_000, False, "its manifest.json is not JSON"),          # deeper than the parser goes
    (json.dumps({**GOOD, "meta": {"a": [[[[]]]] * 1}}).encode().replace(b"[[[[]]]]", b"[" * 70 + b"]" * 70), False,
     "its manifest.json is not JSON (nested deeper than 64 levels)"),  # parsed, but a signature's json.dumps may not
    (b" " * (s3lib.MAX_JSON_BYTES + 1), False, "larger than 16 MiB"),
    (json.dumps(GOOD).encode(), True, None),
    (b"[]", True, "does not list files with size and sha256"),
    (json.dumps({**GOOD, "files": {}}).encode(), True, "does not list files"),
    (json.dumps({**GOOD, "files": {"../x": GOOD["files"]["model.pt"]}}).encode(), True, "not a plain file name"),
    (json.dumps({**GOOD, "format": 2}).encode(), True, "has format 2"),
])
def test_a_manifest_read_from_s3_is_judged_in_one_place(body, judged, problem):
    network = Network({} if body is None else {MANIFEST_KEY: body})
    manifest, found = remote_checkpoints.manifest_of(network, CKPTS, step(5), no_retry)
    assert (manifest is not None) == judged, "a manifest comes back only when it parsed"
    assert (found is None) == (problem is None) and (problem is None or problem in found), found


def test_with_a_key_an_unsigned_manifest_does_not_count(monkeypatch):
    monkeypatch.setenv(checkpoint.HMAC_KEY_ENV, "k")
    monkeypatch.setenv("S3_OUTPUT_URI", "s3://bucket/runs/r/")
    network = Network({MANIFEST_KEY: json.dumps(GOOD).encode()})
    assert "is not signed" in remote_checkpoints.manifest_of(network, CKPTS, step(5), no_retry)[1]
    bound = {**GOOD, "folder": step(5), "run": "s3://bucket/runs/r/"}
    signed = {**bound, "hmac": checkpoint.manifest_hmac(bound, b"k")}
    network = Network({MANIFEST_KEY: json.dumps(signed).encode()})
    assert remote_checkpoints.manifest_of(network, CKPTS, step(5), no_retry) == (signed, None)
    # The same object under a newer step's name: what S3 lists there is judged by that name.
    network = Network({CKPTS.key(step(99999999), "manifest.json"): json.dumps(signed).encode()})
    _, problem = remote_checkpoints.manifest_of(network, CKPTS, step(99999999), no_retry)
    assert "signed for folder 'step-00000005', not 'step-99999999'" in problem


def test_committed_lists_step_folders_newest_first():
    names = ["step-00000002", "best", "step-00000010", "step-1", "step-00000001\n", "step-0000000١"]
    assert remote_checkpoints.newest_first(names) == ["step-00000010", "step-00000002"]


def entries(**bodies: bytes) -> dict:
    return {name.replace("_", "."): {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
            for name, body in bodies.items()}


def test_files_go_up_first_and_the_manifest_last():
    network = Network()
    handles = {"a.pt": io.BytesIO(b"a"), "b.pt": io.BytesIO(b"b")}
    remote_checkpoints.put_checkpoint(network, CKPTS, "best", handles, b"{}", entries(a_pt=b"a", b_pt=b"b"),
                                      no_retry, lambda _: None, copies={"b.pt": CKPTS.key(step(5), "b.pt")})
    assert network.requests == [("upload_fileobj", CKPTS.key("best", "a.pt")),
                                ("copy", CKPTS.key("best", "b.pt")),
                                ("put_object", CKPTS.key("best", "manifest.json"))]


@pytest.mark.parametrize("reread", [False, True])
def test_a_file_that_differs_from_its_manifest_goes_up_but_the_manifest_does_not(reread):
    network = Network()
    network.reread = reread  # bytes read twice are hashed once: a whole file still matches
    files = entries(a_pt=b"weights", b_pt=b"moments")
    good = {"a.pt": io.BytesIO(b"weights"), "b.pt": io.BytesIO(b"moments")}
    remote_checkpoints.put_checkpoint(network, CKPTS, step(5), good, b"{}", files, no_retry, lambda _: None)
    assert network.sent[CKPTS.key(step(5), "b.pt")] == b"moments"
    assert network.requests[-1] == ("put_object", MANIFEST_KEY)

    for damaged in (b"moMents", b"moment", b"moments!"):  # a flipped byte, one lost, one more
        network = Network()
        network.reread = reread
        handles = {"a.pt": io.BytesIO(b"weights"), "b.pt": io.BytesIO(damaged)}
        with pytest.raises(remote_checkpoints.NotAsCommitted, match="b.pt"):
            remote_checkpoints.put_checkpoint(network, CKPTS, step(5), handles, b"{}", files, no_retry,
                                              lambda _: None)
        assert [op for op, _ in network.requests] == ["upload_fileobj", "upload_fileobj"], "no manifest"


@pytest.mark.parametrize("first_pass, sent, committed", [
    (b"moMents", b"moments", True),    # what counts is what was sent
    (b"moments", b"moMents", False),
])
def test_the_pass_that_is_checked_is_the_one_sent(first_pass, sent, committed):
    """A disk that returns other bytes when read again: botocore reads a body for its checksum,
    then from the start to send it."""
    files = entries(a_pt=b"moments")
    disk = io.BytesIO(first_pass)
    network = Network()
    network.reread = True
    network.between_passes = lambda: disk.getbuffer().__setitem__(slice(0, len(sent)), sent)
    try:
        remote_checkpoints.put_checkpoint(network, CKPTS, step(5), {"a.pt": disk}, b"{}", files, no_retry,
                                          lambda _: None)
    except remote_checkpoints.NotAsCommitted:
        assert not committed
    else:
        assert committed and network.sent[CKPTS.key(step(5), "a.pt")] == b"moments"


def test_a_redone_step_replaces_s3s_copy_only_when_every_file_here_matches():
    files = entries(a_pt=b"weights", b_pt=b"moments")
    network = Network()
    handles = {"a.pt": io.BytesIO(b"weights"), "b.pt": io.BytesIO(b"moMents")}
    with pytest.raises(remote_checkpoints.NotAsCommitted, match="b.pt does not match its sha256"):
        remote_checkpoints.put_checkpoint(network, CKPTS, step(5), handles, b"{}", files, no_retry, lambda _: None,
                                          replaces=True)
    assert network.requests == [], "S3's committed copy is left as it was"

    handles = {"a.pt": io.BytesIO(b"weights"), "b.pt": io.BytesIO(b"moments")}
    remote_checkpoints.put_checkpoint(network, CKPTS, step(5), handles, b"{}", files, no_retry, lambda _: None,
                                      replaces=True)
    assert [op for op, _ in network.requests] == ["delete_object", "upload_fileobj", "upload_fileobj", "put_object"]
    assert network.sent[CKPTS.key(step(5), "a.pt")] == b"weights", "hashed first, then sent whole"


def test_a_pruned_step_is_uncommitted_before_its_files_go():
    network = Network()
    keys = folder(1, "a", "b")
    remote_checkpoints.prune(network, CKPTS, step(1), keys, no_retry)
    assert network.requests == [("delete_object", CKPTS.key(step(1), "manifest.json")),
                                ("delete_objects", [CKPTS.key(step(1), "a"), CKPTS.key(step(1), "b")])]
