"""script.sh's TRAIN_SCRIPT and S3_MODEL_URI checks (before any S3 call), and the TMPDIR every
child gets. script.sh runs as a plain process; its `aws` is a stand-in that records what it was
given and refuses the credentials."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from podlab import ROOT

SCRIPT = ROOT / "job" / "script.sh"


def run_pod(tmp_path: Path, **settings: str) -> tuple[int, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake_aws = bin_dir / "aws"
    fake_aws.write_text(f'#!/bin/sh\n[ -d "$TMPDIR" ] && echo "$TMPDIR" >{tmp_path}/aws-tmpdir\n'
                        "echo 'Unable to locate credentials' >&2\nexit 255\n")
    fake_aws.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "S3_CODE_URI": "s3://bucket/code/", "S3_DATA_URI": "s3://bucket/data/",
           "S3_OUTPUT_URI": "s3://bucket/runs/r/", "WORK_DIR": str(tmp_path / "work"),
           "READY_FILE": str(tmp_path / "ready"), "HEALTH_FILE": str(tmp_path / "healthy"),
           "NPROC_PER_NODE": "1", "S3_RETRY_SECONDS": "1", "S3_SYNC_TOOL": "aws", "TMPDIR": "/nonexistent", **settings}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


def test_every_child_gets_a_tmpdir_on_the_workspace_that_exists(tmp_path):
    code, output = run_pod(tmp_path)
    assert code == 64 and "no AWS credentials" in output, output
    assert (tmp_path / "aws-tmpdir").read_text().strip() == str(tmp_path / "work" / ".tmp")


@pytest.mark.parametrize("settings,line", [
    ({"TRAIN_SCRIPT": "/abs/train.py"}, "TRAIN_SCRIPT=/abs/train.py must be relative to the code, without .."),
    ({"TRAIN_SCRIPT": "sub/../../x.py"}, "TRAIN_SCRIPT=sub/../../x.py must be relative to the code, without .."),
    ({"TRAIN_CONFIG": "../conf.yaml"}, "TRAIN_CONFIG=../conf.yaml must be relative to the code, without .."),
    ({"S3_MODEL_URI": "models/x"}, "S3_MODEL_URI=models/x is not an s3://bucket/prefix/ URI"),
    ({"S3_MODEL_URI": "s3://bucket/runs/r/model/"}, "S3_OUTPUT_URI (s3://bucket/runs/r/) and S3_MODEL_URI"),
    ({"TRAIN_SCRIPT": "finetune.py"}, "S3_MODEL_URI is not set; TRAIN_SCRIPT=finetune.py needs a model snapshot"),
])
def test_bad_train_script_or_model_uri_stops_before_any_s3_call(tmp_path, settings, line):
    code, output = run_pod(tmp_path, **settings)
    errors = [text for text in output.splitlines() if "error: " in text]
    assert code == 64 and len(errors) == 1 and line in errors[0], output
    assert not (tmp_path / "aws-tmpdir").exists(), "no S3 call"


@pytest.mark.parametrize("settings", [{"TRAIN_SCRIPT": "scripts/ft.py"}, {"TRAIN_SCRIPT": "a..b.py"},
                                      {"S3_MODEL_URI": "s3://bucket/models/x"}, {"TRAIN_SCRIPT": ""}])
def test_good_train_script_and_model_uri_pass(tmp_path, settings):
    code, output = run_pod(tmp_path, **settings)
    assert code == 64 and "error: no AWS credentials" in output, output
