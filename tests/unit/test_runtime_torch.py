"""The pod refuses a torch older than 2.6 whatever the trainer: torch.load(weights_only=True) can
run code from a crafted file before 2.6 (CVE-2025-32434), and the pod loads checkpoints from S3.

No root, no S3 server: the version rule on a table, then the rule as script.sh's setup_python meets
it, with torch's installed metadata saying 2.5.1 (a dist-info folder first on PYTHONPATH)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import requirements_met
from podlab import ROOT


@pytest.mark.parametrize("version,refused", [
    ("2.5.1+cu121", True),
    ("2.5.1", True),
    ("1.13.1", True),
    ("2.6.0rc1", True),  # before the fixed release
    ("2.6.0a0+ecf3bae40a", True),
    ("2.6.0", False),
    ("2.6.0+cu124", False),
    ("2.7.0a0+79aa17489c.nv25.04", False),
    ("2.13.0", False),
    ("10.0", False),
])
def test_torch_before_2_6_is_refused(version, refused):
    problem = requirements_met.torch_refusal(version)
    if refused:
        assert problem and f"torch {version}" in problem and "2.6" in problem and "CVE-2025-32434" in problem
        assert "\n" not in problem
    else:
        assert problem is None


def test_a_version_that_cannot_be_read_is_refused():
    assert "cannot be read" in requirements_met.torch_refusal("not-a-version")


def old_torch_on_path(folder: Path) -> Path:
    info = folder / "torch-2.5.1+cu121.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1+cu121\n")
    return folder


def test_setup_python_refuses_an_old_torch_with_one_line_and_exit_64(tmp_path):
    """script.sh up to its Python environment: the code and data are already in WORK_DIR and the
    stand-in `aws` answers every call, so the first thing to stop the pod is torch's version."""
    work = tmp_path / "work"
    (work / "config").mkdir(parents=True)
    (work / "data").mkdir()
    (work / "train.py").write_text("")
    (work / "config" / "conf.yaml").write_text("")
    for split in ("train", "val"):
        (work / "data" / f"{split}.bin").write_bytes(b"\0\0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "aws").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "PYTHONPATH": str(old_torch_on_path(tmp_path / "site")),
           "S3_CODE_URI": "s3://bucket/code/", "S3_DATA_URI": "s3://bucket/data/", "S3_OUTPUT_URI": "s3://bucket/runs/r/",
           "WORK_DIR": str(work), "READY_FILE": str(tmp_path / "ready"), "HEALTH_FILE": str(tmp_path / "healthy"),
           "NPROC_PER_NODE": "1", "S3_SYNC_TOOL": "aws", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(ROOT / "job" / "script.sh")], env=env, capture_output=True, text=True, timeout=60)
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if "error: " in line]
    assert result.returncode == 64, lines
    assert len(errors) == 1 and "torch 2.5.1+cu121" in errors[0] and "CVE-2025-32434" in errors[0], lines
    assert not (tmp_path / "ready").exists()
