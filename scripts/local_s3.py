"""A local S3 on loopback (moto's server), for the demo and for trying the toolkit without AWS.

    python scripts/local_s3.py [--port 0] [--bucket NAME]... [--port-file FILE]

Prints the endpoint (http://127.0.0.1:PORT) and serves until SIGTERM or Ctrl-C. Point the AWS CLI,
boto3 and the pod at it with AWS_ENDPOINT_URL (s5cmd: S3_ENDPOINT_URL; TensorBoard: S3_ENDPOINT),
with any fake credentials. State lives in memory: it is gone when the server stops.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import boto3
from moto.server import ThreadedMotoServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    parser.add_argument("--port-file", help="write the port here once listening")
    args = parser.parse_args(argv)

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "local"),
                          aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "local"))
    for bucket in args.bucket:
        client.create_bucket(Bucket=bucket)
    if args.port_file:
        with open(args.port_file, "w") as file:
            file.write(str(port))
    print(f"local S3 at {endpoint} (buckets: {', '.join(args.bucket) or 'none'})", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
