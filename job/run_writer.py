"""The uploader's one way to change what S3 shows of a run: every write waits on the run's lease.

    writer = RunWriter(run, retry_seconds=30, state_dir=Path(".pod"))
    writer.hold_lease()                      # the lease lease.py took; renewed from a thread
    writer.write(writer.s3.put_object, Bucket=..., Key=..., Body=...)   # retried, lease proven per try
    writer.let_go()                          # at the end of `final`: the next pod need not wait

Every request that can change S3 (each of botocore's retries and each part of a multipart upload
included) goes out only while the lease is fresh: a check at the start of a write alone would let
a long upload run on past another pod's takeover (lease.py says what "fresh" means).
"""

from __future__ import annotations

from pathlib import Path

import s3 as s3lib
from lease import Keeper, Lease
from s3 import Location, log

WRITES = ("PutObject", "UploadPart", "CompleteMultipartUpload", "CopyObject", "UploadPartCopy",
          "DeleteObject", "DeleteObjects")


class RunWriter:
    def __init__(self, run: Location, retry_seconds: float, state_dir: Path):
        self.s3 = s3lib.client()
        self.run = run
        self.retry = s3lib.retrying("upload", run.bucket, seconds=retry_seconds, name="uploader")
        self.state_dir = state_dir
        self.keeper: Keeper | None = None

    def hold_lease(self) -> None:
        # The lease renews through a client of its own: this one's writes wait on the lease, its
        # renewals must not.
        self.keeper = Keeper(Lease.load(s3lib.client(), self.run, self.state_dir / "lease.json"))
        self.keeper.start()
        for operation in WRITES:
            self.s3.meta.events.register(f"before-send.s3.{operation}", lambda **_: self.keeper.check())

    def still_ours(self, _sent_bytes: int = 0) -> None:
        """LeaseLost unless the lease is fresh now: called as a body's bytes go, so a part that
        takes longer than ttl/2 to send stops once the lease is lost."""
        self.keeper.check()

    def write(self, call, *args, **kwargs):
        """A write to S3, retried; each try first proves this pod still holds the run's lease, so
        no retry outlives it."""
        def attempt():
            self.keeper.check(self.retry)
            return call(*args, **kwargs)

        return self.retry(attempt)

    def put_json(self, key: str, value: dict) -> None:
        s3lib.put_json(self.s3, self.run, key, value, self.write)

    def stop(self) -> None:
        """No more renewals; waited for, so `final` never takes over mid-renewal."""
        self.keeper.stop()
        self.keeper.join(timeout=5)

    def let_go(self) -> None:
        """Stop renewing and release the lease: the next pod starts at once. One that cannot be
        released lapses in its TTL."""
        self.keeper.stop()
        try:
            self.keeper.lease.release(self.retry)
        except (s3lib.BadInput, s3lib.Unavailable) as err:
            log("uploader", f"warning: the lease was not released ({err}); the next pod waits out its TTL")
