#!/usr/bin/env python3
"""The multi-node half of scripts/demo.sh (`demo.sh --nodes N`): a group of pods trains, one node is
lost, the whole group comes back and finishes from S3.

    python lab/demo_group.py MANIFEST LOG_DIR [--env KEY=VALUE]... [--kill-at STEP] [--kill-index I]

MANIFEST is what `scripts/submit.py --engine indexed --nodes N` renders. Its pods run side by side
through lab/local_job.py (each pod's output on stdout, prefixed [index.attempt], and in
LOG_DIR/pod-<index>-<attempt>.log). Once node 0 has put step STEP in S3, pod I's PID 1 gets SIGKILL,
as when its node is lost. Exit 0 when the Job is Complete, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import local_job
import local_pod


def say(message: str) -> None:
    print(f"\n\033[1m== {message}\033[0m", flush=True)


def save_logs(job: local_job.IndexedJob, folder: Path) -> None:
    for index in range(job.size):
        for pod in job.pods(index):
            (folder / f"pod-{index}-{pod.attempt}.log").write_text(pod.output)


def last_error_line(output: str) -> str:
    """Why a pod failed: its last line that says error, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip() and not line.startswith("EVENT ")]
    return next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "no output")


def restored_steps(job: local_job.IndexedJob, index: int) -> list:
    return [e.get("name") for pod in job.pods(index) for e in pod.events if e["event"] == "restore"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--kill-at", type=int, default=100, metavar="STEP")
    parser.add_argument("--kill-index", type=int, default=1, metavar="I")
    args = parser.parse_args(argv)
    env = dict(local_pod.key_value(text, "--env") for text in args.env)
    job = local_job.IndexedJob(args.manifest, env, echo=True).start()
    try:
        try:
            job.pod(0).wait_for_event("uploaded", timeout=3600, step=args.kill_at)
        except AssertionError:  # node 0 ended without it: it failed
            pod = job.pod(0)
            print(f"demo_group: error: pod 0 failed (exit {pod.exit_code()}): {last_error_line(pod.output)}",
                  file=sys.stderr)
            return 1
        time.sleep(2)
        job.pod(args.kill_index).lose_node()
        say(f"node of pod {args.kill_index} lost (SIGKILL to its PID 1) after step {args.kill_at} reached S3; "
            f"its peers see it go and exit 138, and the Job brings the whole group back")
        state, reason = job.wait(timeout=3600)
    finally:
        job.stop(grace=60)
        save_logs(job, args.log_dir)
    say(f"the Job is {state} ({reason}); every pod it ran, as (index, exit code, what the Job made of it):")
    for entry in job.history:
        print(f"  {entry}")
    for index in range(job.size):
        print(f"  node {index} restored: {restored_steps(job, index)}")
    return 0 if state == "Complete" else 1


if __name__ == "__main__":
    sys.exit(main())
