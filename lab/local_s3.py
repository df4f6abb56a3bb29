"""A local S3 on loopback (moto's server), for the demo and for trying the toolkit without AWS.

    python lab/local_s3.py [--port 0] [--bucket NAME]... [--port-file FILE]

Prints the endpoint (http://127.0.0.1:PORT) and serves until SIGTERM or Ctrl-C. Point the AWS CLI,
boto3 and the pod at it with AWS_ENDPOINT_URL (s5cmd: S3_ENDPOINT_URL; TensorBoard: S3_ENDPOINT),
with any fake credentials. State lives in memory: it is gone when the server stops.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from podlab import local_s3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    parser.add_argument("--port-file", help="write the port here once listening")
    args = parser.parse_args(argv)

    with local_s3(args.bucket, args.port, set_environ=False) as endpoint:
        if args.port_file:
            with open(args.port_file, "w") as file:
                file.write(endpoint.rsplit(":", 1)[1])
        print(f"local S3 at {endpoint} (buckets: {', '.join(args.bucket) or 'none'})", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
