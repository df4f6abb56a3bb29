"""Every script a person runs from scripts/ runs as typed (its run bit and shebang) and answers
--help and -h with its usage and exit 0, before it needs root, a venv, S3 or arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())


def test_the_scripts_are_the_ones_this_file_knows():
    assert [p.name for p in SCRIPTS] == ["demo.sh", "prepare_data.py", "stage.sh", "status.py", "submit.py",
                                         "tensorboard.sh", "test.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_as_typed(script):
    assert os.access(script, os.X_OK), f"{script.name} has no run bit: chmod +x scripts/{script.name}"
    first = script.read_text().splitlines()[0]
    assert first in ("#!/usr/bin/env bash", "#!/usr/bin/env python3"), first


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_prints_its_usage_on_help(script, flag, tmp_path):
    # No AWS, no root needed, nothing written to the working folder.
    result = subprocess.run([str(script), flag], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                            env={**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower(), result.stdout
    assert result.stderr == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.name != "test.sh"], ids=lambda p: p.name)
def test_an_unknown_flag_is_bad_input_one_line_and_64(script, tmp_path):
    # test.sh hands its arguments to pytest, whose usage errors are its own
    result = subprocess.run([str(script), "--bogus-flag"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                            env={**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert result.returncode == 64, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "error: " in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,env,shown", [
    (["tensorboard.sh", "s3://AKIA1:hunter2@bkt/runs/"], {}, "s3://***@bkt/runs/ is not an s3://bucket/prefix/ URI"),
    (["tensorboard.sh", "s3://bkt/runs/"], {"S3_ENDPOINT": "minio:hunter2@store:9000"}, "S3_ENDPOINT=***@store:9000 has"),
    (["tensorboard.sh", "s3://bkt/runs/"], {"S3_ENDPOINT": "minio:ab/hunter2+@store:9000"}, "give it as http://***@store"),
    (["tensorboard.sh", "s3://bkt/runs/"], {"AWS_ENDPOINT_URL": "ftp://minio:hunter2@store"}, "=ftp://***@store has"),
    (["stage.sh", "s3://AKIA1:hunter2@bkt/code/"], {}, "s3://***@bkt/code/ is not an s3://bucket/prefix/ URI"),
    (["stage.sh", "s3://AKIA1:hunter2@b\nkt/a\x1b]0;x\x07/"], {}, "s3://***@b?kt/a?]0;x?/ is not an s3://bucket/"),
], ids=["tensorboard-uri", "tensorboard-endpoint", "tensorboard-endpoint-slash", "tensorboard-endpoint-scheme",
        "stage-uri", "stage-controls"])
def test_a_credential_in_a_bad_uri_or_endpoint_is_never_shown(args, env, shown, tmp_path):
    result = subprocess.run([str(ROOT / "scripts" / args[0]), *args[1:]], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env={**os.environ, **env})
    assert result.returncode == 64 and len(result.stderr.splitlines()) == 1, result.stderr
    assert shown in result.stderr and "hunter2" not in result.stderr, result.stderr


@pytest.mark.parametrize("script", ["stage.sh", "tensorboard.sh"])
def test_a_script_run_through_a_link_finds_the_checkout_it_belongs_to(script, tmp_path):
    # e.g. ln -s ~/toolkit/scripts/tensorboard.sh ~/bin/: job/s3_uri.sh is read from the checkout
    link = tmp_path / "bin" / script
    link.parent.mkdir()
    link.symlink_to(ROOT / "scripts" / script)
    result = subprocess.run([str(link), "https://bkt/x/"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 64 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "https://bkt/x/ is not an s3://bucket/prefix/ URI" in result.stderr, result.stderr
