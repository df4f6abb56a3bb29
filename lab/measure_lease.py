"""What the lease's TTL costs, both ways, through the real job.yaml (local pod runner, local S3).

    sudo .venv/bin/python lab/measure_lease.py kill 120 30    # kill_to_training_s per LEASE_TTL_SECONDS
    sudo .venv/bin/python lab/measure_lease.py outage 30      # a 2-minute S3 outage under a live pod

kill: a pod trains; once a checkpoint is in S3 its PID 1 gets SIGKILL (a lost node: no EXIT trap,
the lease stays in S3); then the Job's next pod starts at once. Prints the seconds from the
SIGKILL to the next pod's first training step, and how long that pod waited for the lease.

outage: as tests/test_reliability.py's outage test, with the TTL given: a pod talks to S3 through
lab/s3_fault_proxy.py, S3 goes away for 120 s during training. Prints the exit code, the steps
trained during the outage, the requests sent during it, how soon after it a newer checkpoint is in
S3, and whether the lease was ever lost.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from podlab import Run, local_s3
import contract  # noqa: E402 - on the path podlab set: the trainer's events, not its prose

LONG = "--set train.max_steps=100000 --set log.interval=1"


def kill_to_training(s3, endpoint: str, folder: Path, ttl: int) -> tuple[float, float]:
    run = Run(s3, endpoint, folder / f"ttl-{ttl}", name=f"ttl-{ttl}").stage()
    pod = run.start(LEASE_TTL_SECONDS=str(ttl), TRAIN_ARGS=LONG)
    pod.wait_for_event("uploaded", timeout=300)
    return restart_after_lost_node(run, pod, ttl)


def restart_after_lost_node(run: Run, pod, ttl: int, train_args: str = LONG,
                            first_resumed_step=None) -> tuple[float, float]:
    """SIGKILL a training pod's PID 1, start the next pod at once: seconds to that pod's first
    resumed training step (`first_resumed_step(pod, timeout)` waits for it), and its lease wait."""
    killed = time.monotonic()
    pod.lose_node()
    pod.wait()
    second = run.start(LEASE_TTL_SECONDS=str(ttl), TRAIN_ARGS=train_args)
    try:
        if first_resumed_step is None:
            resumed = second.wait_for_event("resumed", timeout=ttl + 300, source="train")["step"]
            second.wait_for_event("step", timeout=120, step=resumed + 1)
        else:
            first_resumed_step(second, ttl + 300)
        took = time.monotonic() - killed
        waited = second.wait_for_event("lease", state="held")["waited"]
    finally:
        second.delete()
        second.wait()
    return took, waited


def outage(s3, endpoint: str, folder: Path, ttl: int) -> dict:
    from s3_fault_proxy import FaultProxy

    run = Run(s3, endpoint, folder / f"outage-{ttl}", name=f"outage-{ttl}").stage()
    with FaultProxy(upstream=endpoint, seed=7) as proxy:
        run.endpoint = proxy.url
        pod = run.start(LEASE_TTL_SECONDS=str(ttl), S3_RETRY_SECONDS="600",
                        TRAIN_ARGS="--set train.max_steps=1500 --set log.interval=20")
        pod.wait_for_event("uploaded", timeout=300)
        trained_before, committed_before = _steps(pod.output), run.committed_steps()[0]
        proxy.configure(outage=True, outage_seconds=120)
        started = time.monotonic()
        time.sleep(120)
        during = [r for r in proxy.stats()["recent"] if started <= r[0] <= started + 120 and r[3] == "outage"]
        trained_during = _steps(pod.output) - trained_before
        committed_at_end = _steps(pod.output)
        # Uploads catch up: a checkpoint committed after the outage's end reaches S3.
        while not run.committed_steps() or run.committed_steps()[0] <= committed_at_end:
            time.sleep(0.5)
        catch_up = time.monotonic() - started - 120
        code = pod.wait(timeout=900)
        after = time.monotonic() - started - 120
    lost = [line for line in pod.lines if "another pod" in line or "lease lost" in line.lower()]
    return {"exit_code": code, "complete": "COMPLETE" in run.keys(), "newest_in_s3_before": committed_before,
            "steps_trained_during_outage": trained_during, "requests_during_outage": len(during),
            "seconds_from_outage_end_to_a_newer_checkpoint_in_s3": round(catch_up, 1),
            "seconds_from_outage_end_to_pod_end": round(after, 1), "lease_lost_lines": lost,
            "newest_committed": run.committed_steps()[:1]}


def _steps(output: str) -> int:
    found = [e["step"] for e in map(contract.parse_event, output.splitlines()) if e and e["event"] == "step"]
    return found[-1] if found else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["kill", "outage"])
    parser.add_argument("ttls", nargs="+", type=int)
    args = parser.parse_args()
    import boto3

    with local_s3() as endpoint, tempfile.TemporaryDirectory() as tmp:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        for ttl in args.ttls:
            if args.what == "kill":
                took, waited = kill_to_training(s3, endpoint, Path(tmp), ttl)
                print(f"LEASE_TTL_SECONDS={ttl}: kill_to_training_s {took:.1f} (lease wait {waited:.1f}s)", flush=True)
            else:
                print(f"LEASE_TTL_SECONDS={ttl}: 120 s outage: {outage(s3, endpoint, Path(tmp), ttl)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
