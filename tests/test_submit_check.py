"""scripts/submit.py --check: what the pods of a run would refuse, said from a laptop before any pod
starts: one line per finding, exit 0 / 64 / 75, against a real local S3 holding a staged run (staged
once; each case points its flags at a prefix of its own)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest

from podlab import BUCKET, ROOT, Run, free_ports

SUBMIT = ROOT / "scripts" / "submit.py"
sys.path.insert(0, str(ROOT / "scripts" / "lib"))
import preflight  # noqa: E402


@pytest.fixture(scope="module")
def run(module_s3, s3_endpoint, tmp_path_factory):
    return Run(module_s3, s3_endpoint, tmp_path_factory.mktemp("check")).stage()


def check(run, *flags: str, env: dict | None = None, data: str | None = None, config: str = "config/tiny.yaml",
          output: str | None = None) -> subprocess.CompletedProcess:
    argv = ["r", "--image", "x", "--code", run.code_uri, "--data", data or run.data_uri,
            "--output", output or run.output_uri, "--train-config", config, "--gpus-per-node", "1", *flags, "--check"]
    # No kubectl on PATH: --check renders no ConfigMap.
    return subprocess.run([sys.executable, str(SUBMIT), *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": "/usr/bin:/bin", **(env or {})})


def test_a_staged_run_passes_with_one_line_per_check(run):
    result = check(run)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["ok"] * 5, result.stdout
    assert f"{run.code_uri}config/tiny.yaml passes train.py --check for 1 process(es)" in result.stdout
    assert lines[-1] == "submit.py --check: no errors, 0 warning(s): submit it (--apply)"


def test_a_typo_in_the_staged_config_is_caught_before_any_pod(run):
    run.s3.put_object(Bucket=BUCKET, Key="code/config/typo.yaml", Body=b"train:\n  max_step: 5\n")
    result = check(run, config="config/typo.yaml")
    assert result.returncode == 64, result.stdout
    assert f"error    train.py refuses {run.code_uri}config/typo.yaml: " in result.stdout
    assert "unknown setting train.max_step; did you mean train.max_steps?" in result.stdout
    assert "the pods would refuse this run (exit 64)" in result.stdout


def test_a_staged_config_cannot_write_to_the_terminal(run):
    # a key that is a terminal's escape (YAML's \e: retitle the window): the trainer's line quotes it
    run.s3.put_object(Bucket=BUCKET, Key="code/config/escape.yaml", Body=b'train:\n  "\\e]0;pwned\\a": 5\n')
    result = check(run, config="config/escape.yaml")
    assert result.returncode == 64, result.stdout
    assert "unknown setting train." in result.stdout and "pwned" in result.stdout
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout


def test_data_that_is_missing_or_not_whole_tokens_is_named(run):
    run.s3.put_object(Bucket=BUCKET, Key="odd-data/train.bin", Body=b"\x01\x00\x02")  # 3 bytes: half a token
    result = check(run, data=f"s3://{BUCKET}/odd-data/")
    assert result.returncode == 64
    assert f"error    s3://{BUCKET}/odd-data/: train.bin is 3 bytes, not whole uint16 tokens" in result.stdout
    assert f"error    s3://{BUCKET}/odd-data/: holds no val.bin; make it with scripts/prepare_data.py" in result.stdout


def test_the_config_is_checked_for_the_processes_the_pods_will_start(run):
    # tiny.yaml's grad_accum_steps (2) is split between the processes: 3 pods of 1 cannot.
    result = check(run, "--engine", "indexed", "--nodes", "3")
    assert result.returncode == 64
    assert ("must be divisible by the number of processes (3); change it (--train-args \"--set "
            "train.grad_accum_steps=N\") or --nodes and --gpus-per-node") in result.stdout


def test_a_finished_run_is_a_warning_that_says_what_to_do(run):
    run.s3.put_object(Bucket=BUCKET, Key="runs/finished/COMPLETE", Body=b"{}")
    result = check(run, output=f"s3://{BUCKET}/runs/finished/")
    assert result.returncode == 0
    assert (f"warning  s3://{BUCKET}/runs/finished/COMPLETE exists: the run is finished and its pods would exit 0 at once; "
            "to train it further, raise train.max_steps and remove COMPLETE") in result.stdout


def test_a_bucket_that_does_not_exist_and_s3_unreachable(run):
    missing = subprocess.run([sys.executable, str(SUBMIT), "r", "--image", "x", "--code", "s3://no-such-bucket/c/",
                              "--data", run.data_uri, "--output", run.output_uri, "--check"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 64
    assert "error    S3_CODE_URI: bucket no-such-bucket does not exist" in missing.stdout
    gone = check(run, env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_ports()}"})
    assert gone.returncode == 75 and "S3 unreachable at http://127.0.0.1:" in gone.stdout


def pod_of(**env: str) -> list[dict]:
    return [{"kind": "Job", "spec": {"template": {"spec": {"containers": [
        {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": "1"}},
         "env": [{"name": k, "value": v} for k, v in env.items()]}]}}}}]


def test_train_args_and_the_pods_settings_are_checked_as_the_pod_checks_them(run):
    uris = {"S3_CODE_URI": run.code_uri, "S3_DATA_URI": run.data_uri, "S3_OUTPUT_URI": run.output_uri,
            "TRAIN_CONFIG": "config/tiny.yaml"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = preflight.check(pod_of(**uris, TRAIN_ARGS="--set train.max_steps=many", TRAIN_ARG="x",
                                      SYNC_INTERVAL_SECONDS="5\x1b"))
    said = out.getvalue()
    assert code == 64, said
    assert "warning  TRAIN_ARG is not a setting of the pod, so it is ignored; did you mean TRAIN_ARGS?" in said
    assert "error    SYNC_INTERVAL_SECONDS holds a control character" in said
    assert "config/tiny.yaml with TRAIN_ARGS --set train.max_steps=many: train.max_steps must be an integer, got 'many'" \
        in said
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = preflight.check(pod_of(**uris, TRAIN_ARGS="--sett train.max_steps=5"))
    assert code == 64 and "train.py: error: unrecognized arguments: --sett" in out.getvalue()

