"""Credentials in URLs never reach the pod's output or its log: job/redact.sed hides every URL's
userinfo (scheme://user:pass@ -> scheme://***@) and the values of query parameters with secret-looking
names (?private_token=... -> ?private_token=***), in script.sh's log pipeline (stdout, stderr and
the log file the uploader puts in S3) and in python_env.sh's own messages.

No root, no S3 server: sed on a table; script.sh and python_env.sh as plain processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from podlab import ROOT

REDACT = ROOT / "job" / "redact.sed"
TOKEN = "s3cr3t-T0KEN-value"


def redact(text: str) -> str:
    return subprocess.run(["sed", "-E", "-f", str(REDACT)], input=text, capture_output=True, text=True,
                          check=True, env={"LC_ALL": "C"}).stdout


CASES = [
    ("--extra-index-url https://user:TOKEN@pypi.example.com/simple", "--extra-index-url https://***@pypi.example.com/simple"),
    ("--index-url=http://TOKEN@10.0.0.1:8080/simple/", "--index-url=http://***@10.0.0.1:8080/simple/"),
    ("git+https://oauth2:TOKEN@gitlab.com/a/b.git@v1.0#egg=b", "git+https://***@gitlab.com/a/b.git@v1.0#egg=b"),
    ("'https://u:p@ss@h/x' and s3+https://k:TOKEN@h2", "'https://***@h/x' and s3+https://***@h2"),
    ("Looking in indexes: https://pypi.org/simple, https://user:****@host/simple",
     "Looking in indexes: https://pypi.org/simple, https://***@host/simple"),
    # Seen: GitLab's package index takes its token in the query; pip prints the URL as it is.
    ("Looking in indexes: https://gitlab.example.com/api/v4/projects/7/packages/pypi/simple?private_token=TOKEN",
     "Looking in indexes: https://gitlab.example.com/api/v4/projects/7/packages/pypi/simple?private_token=***"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F1&X-Amz-Security-Token=TOKEN"
     "&X-Amz-Signature=TOKEN&x-id=GetObject",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=***&X-Amz-Credential=***&X-Amz-Security-Token=***"
     "&X-Amz-Signature=***&x-id=GetObject"),
    ("http://h/p?user=bob&api_key=TOKEN;Password=TOKEN&sig=TOKEN#top 'https://h/?AccessToken=TOKEN' done",
     "http://h/p?user=bob&api_key=***;Password=***&sig=***#top 'https://h/?AccessToken=***' done"),
    ("https://u:TOKEN@h/simple?client_secret=TOKEN&page=2", "https://***@h/simple?client_secret=***&page=2"),
    # Nothing else changes: no userinfo, an @ in a path, an e-mail address, a bare host:port, a query
    # without secret-looking names, prose with a question mark.
    ("s3://bucket/prefix/a@b.txt http://host:9000/x", "s3://bucket/prefix/a@b.txt http://host:9000/x"),
    ("mail admin@example.com, step 10/20 | loss 1.23", "mail admin@example.com, step 10/20 | loss 1.23"),
    ("https://h/simple?page=2&per_page=50 why? key=value a&b=c", "https://h/simple?page=2&per_page=50 why? key=value a&b=c"),
]


@pytest.mark.parametrize("line,shown", CASES)
def test_url_userinfo_is_hidden_and_nothing_else_changes(line, shown):
    assert redact(line + "\n") == shown + "\n"


def test_a_line_without_a_newline_at_the_end_is_kept_and_redacted():
    assert redact("https://a:TOKEN@h") == "https://***@h"


def fake_bin(folder: Path, says: str, tool: str = "aws") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / tool
    fake.write_text(f"#!/bin/sh\necho '{says}' >&2\nexit 255\n")
    fake.chmod(0o755)
    return folder


@pytest.mark.parametrize("tool", ["aws", "s5cmd"])
def test_script_output_and_its_log_file_show_no_url_credentials(tmp_path, tool):
    """An error that quotes a URL with credentials (here the S3 tool's, retried until
    S3_RETRY_SECONDS): neither the pod's output nor the log file it uploads carries the token, and
    the log still ends with the pod's last line (the EXIT trap waits for the pipeline)."""
    bin_dir = fake_bin(tmp_path / "bin", f'Could not connect to the endpoint URL: "https://key:{TOKEN}@s3.example.com/b"',
                       tool)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "S3_SYNC_TOOL": tool,
           "S3_CODE_URI": "s3://bucket/code/", "S3_DATA_URI": "s3://bucket/data/", "S3_OUTPUT_URI": "s3://bucket/runs/r/",
           "WORK_DIR": str(tmp_path / "work"), "READY_FILE": str(tmp_path / "ready"),
           "HEALTH_FILE": str(tmp_path / "healthy"), "NPROC_PER_NODE": "1", "S3_RETRY_SECONDS": "1",
           "AWS_ENDPOINT_URL": f"https://key:{TOKEN}@s3.example.com"}
    result = subprocess.run(["bash", str(ROOT / "job" / "script.sh")], env=env, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    log = (tmp_path / "work" / ".pod" / "pod.log").read_text()
    assert result.returncode == 75, output
    assert "https://key:***@" not in output and "https://***@s3.example.com" in output, output
    for text in (output, log):
        assert TOKEN not in text
    assert "script: exit 75 after" in log.splitlines()[-2], log
    assert '"event": "exit"' in log.splitlines()[-1] and '"code": 75' in log.splitlines()[-1], log


def test_python_env_messages_show_no_url_credentials(tmp_path):
    """A requirements file with an index URL that carries a token: requirements_met.py names the
    option as missing and pip fails (no index, no network); python_env.sh says so without the token."""
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"--extra-index-url https://user:{TOKEN}@pypi.example.com/simple\nno-such-package-here==1.0\n")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PIP_NO_INDEX": "1", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(ROOT / "job" / "python_env.sh"), str(tmp_path / "work"), str(tmp_path / "python"),
                             str(requirements)], env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 64, output
    assert "https://***@pypi.example.com/simple" in output, "the option is still named"
    assert TOKEN not in output


def test_python_env_messages_show_no_token_in_an_index_urls_query(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"--extra-index-url https://gitlab.example.com/simple?private_token={TOKEN}\n"
                            "no-such-package-here==1.0\n")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PIP_NO_INDEX": "1", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(ROOT / "job" / "python_env.sh"), str(tmp_path / "work"), str(tmp_path / "python"),
                             str(requirements)], env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 64, output
    assert "https://gitlab.example.com/simple?private_token=***" in output, "the option is still named"
    assert TOKEN not in output


def test_a_helpers_error_line_kept_for_status_json_shows_no_url_credentials(tmp_path, monkeypatch):
    # s3.main_guard's helpers (restore, lease, uploader) leave their error line for status.json, which
    # goes to S3: an S3 error's text can quote the endpoint's URL, userinfo and all.
    import contract
    import s3

    monkeypatch.setenv("STATE_DIR", str(tmp_path))

    def unreachable():
        raise s3.Unavailable(f'Could not connect to the endpoint URL: "http://user:{TOKEN}@10.0.0.1:9000/b"\nretried')

    assert s3.main_guard("restore", unreachable) == contract.EXIT_UNAVAILABLE
    kept = (tmp_path / contract.POD_ERROR).read_text()
    assert kept == 'restore: Could not connect to the endpoint URL: "http://***@10.0.0.1:9000/b" retried', kept
