"""The pod's settings: each bad one stops job/script.sh before it touches S3, with exit 64 and one
line that names the setting, the bad value and the fix; good ones pass. TRAIN_ARGS is split as a
shell splits words, with nothing evaluated.

Pure in the sense of the unit layer: script.sh runs as a plain process (no root, no S3 server). Its
`aws` is a stand-in that refuses the credentials, so a run whose settings pass stops at the first S3
call with "no AWS credentials", after its "pod ... starting" line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import train_args
from podlab import ROOT

SCRIPT = ROOT / "job" / "script.sh"
HMAC_KEY = "k3y-that-must-never-show"  # 24 bytes: long enough, so the short one below is its prefix
GROUP_SECRET = "gr0up-secret-never-shown"


@pytest.fixture
def pod(tmp_path):
    """Runs script.sh with these settings on top of good ones; returns (exit code, output lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_aws = bin_dir / "aws"
    fake_aws.write_text("#!/bin/sh\necho 'Unable to locate credentials' >&2\nexit 255\n")
    fake_aws.chmod(0o755)

    def run(**settings: str) -> tuple[int, list[str]]:
        env = {
            "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
            "S3_CODE_URI": "s3://bucket/code/", "S3_DATA_URI": "s3://bucket/data/",
            "S3_OUTPUT_URI": "s3://bucket/runs/r/", "WORK_DIR": str(tmp_path / "work"),
            "READY_FILE": str(tmp_path / "ready"), "HEALTH_FILE": str(tmp_path / "healthy"),
            "NPROC_PER_NODE": "1", "S3_RETRY_SECONDS": "1", "S3_SYNC_TOOL": "aws",
        }
        env.update(settings)
        env = {k: v for k, v in env.items() if v is not None}
        result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
        return result.returncode, (result.stdout + result.stderr).splitlines()
    return run


def passed_validation(code: int, lines: list[str]) -> bool:
    started = any(" starting: code " in line for line in lines)
    return code == 64 and started and any("error: no AWS credentials" in line for line in lines)


BAD = [
    # (setting, value, what the one line must say)
    ("LEASE_TTL_SECONDS", "0", "LEASE_TTL_SECONDS=0 must be a whole number of seconds, at least 3"),
    ("LEASE_TTL_SECONDS", "2", "LEASE_TTL_SECONDS=2 must be a whole number of seconds, at least 3"),
    ("LEASE_TTL_SECONDS", "1.5", "LEASE_TTL_SECONDS=1.5 must be a whole number of seconds, at least 3"),
    ("LEASE_WAIT_SECONDS", "-1", "LEASE_WAIT_SECONDS=-1 must be a whole number of seconds, at least 0"),
    ("LEASE_WAIT_SECONDS", "an hour", "LEASE_WAIT_SECONDS=an hour must be a whole number of seconds, at least 0"),
    ("UPLOAD_RETRY_SECONDS", "0", "UPLOAD_RETRY_SECONDS=0 must be a positive integer"),
    ("HEALTH_MAX_AGE_SECONDS", "5", "HEALTH_MAX_AGE_SECONDS=5 must be a whole number of seconds, at least 10"),
    ("HEALTH_MAX_AGE_SECONDS", "10m", "HEALTH_MAX_AGE_SECONDS=10m must be a whole number of seconds, at least 10"),
    ("S3_RETRY_SECONDS", "-5", "S3_RETRY_SECONDS=-5 must be a positive integer"),
    ("SYNC_INTERVAL_SECONDS", "soon", "SYNC_INTERVAL_SECONDS=soon must be a positive integer"),
    ("NPROC_PER_NODE", "0", "NPROC_PER_NODE=0 must be a positive integer"),
    ("AWS_MAX_ATTEMPTS", "0", "AWS_MAX_ATTEMPTS=0 must be a positive integer"),
    ("AWS_RETRY_MODE", "fast", "AWS_RETRY_MODE=fast must be standard, adaptive or legacy"),
    ("S3_LEASE", "no", "S3_LEASE=no must be on or off"),
    ("READY_FILE", "ready", "READY_FILE=ready must be an absolute path"),
    ("HEALTH_FILE", "tmp/healthy", "HEALTH_FILE=tmp/healthy must be an absolute path"),
    ("HEALTH_FILE", "/no/such/dir/healthy", "HEALTH_FILE=/no/such/dir/healthy is in no writable folder"),
    ("WORK_DIR", "work", "WORK_DIR=work must be an absolute path"),
    ("CHECKPOINT_HMAC_KEY", "", "CHECKPOINT_HMAC_KEY is set but shorter than 16 bytes"),
    ("CHECKPOINT_HMAC_KEY", HMAC_KEY[:15], "CHECKPOINT_HMAC_KEY is set but shorter than 16 bytes"),
    ("TRAIN_ARGS", "--set 'train.max_steps=10", "TRAIN_ARGS has an unbalanced quote"),
    ("TRAIN_ARGS", "--set train.max_steps=10 \\", "TRAIN_ARGS ends in a lone backslash"),
    ("EVENTS", "json", "EVENTS=json must be log (in the log file and its copy in S3) or stdout"),
    # Control characters: a newline in a URI reached the S3 calls (exit 75, retried), an escape the terminal.
    ("S3_OUTPUT_URI", "s3://bucket/runs/r/\nx", "S3_OUTPUT_URI=s3://bucket/runs/r/?x holds a control character"),
    ("S3_CODE_URI", "s3://bucket/code/\n", "S3_CODE_URI=s3://bucket/code/? holds a control character"),
    ("S3_DATA_URI", "s3://bucket/da\rta/", "S3_DATA_URI=s3://bucket/da?ta/ holds a control character"),
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000\n", "AWS_ENDPOINT_URL=http://127.0.0.1:9000? holds a control character"),
    ("AWS_ENDPOINT_URL", "http://user:pw@s3\n.local", "AWS_ENDPOINT_URL=http://***@s3?.local holds a control"),
    ("TRAIN_SCRIPT", "train\x1b[2J.py", "TRAIN_SCRIPT=train?[2J.py holds a control character"),
    ("TRAIN_ARGS", "--set a=1\x1b]0;pwned\x07", "TRAIN_ARGS=--set a=1?]0;pwned? holds a control character"),
    ("LEASE_TTL_SECONDS", "30\n", "LEASE_TTL_SECONDS=30? holds a control character"),
    ("S3_OUTPUT_URI", "s3://bucket/runs/\u009b2Jr/", "S3_OUTPUT_URI=s3://bucket/runs/?2Jr/ holds a control character"),
]


@pytest.mark.parametrize("name,value,message", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_setting_stops_the_pod_with_one_line_before_any_s3_call(pod, name, value, message):
    code, lines = pod(**{name: value})
    assert code == 64, lines
    errors = [line for line in lines if "error: " in line]
    assert len(errors) == 1 and message in errors[0], lines
    assert not any(c in errors[0] for c in "\r\x1b\x07"), "no control character reaches the terminal"
    assert "fix it in job.yaml" in errors[0] or "; " in errors[0], "the line says how to fix it"
    assert not any(" starting: code " in line for line in lines), "stopped before the S3 check"
    if name == "CHECKPOINT_HMAC_KEY" and value:
        assert value not in "\n".join(lines)


GROUP_BAD = [
    ({"NNODES": "0"}, "NNODES=0 must be a positive integer"),
    ({"NNODES": "2"}, "NNODES=2 but no node rank in the environment"),
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "2", "RDZV_ENDPOINT": "r-0.r:29400"},
     "JOB_COMPLETION_INDEX=2 is not a node rank below NNODES=2"),
    ({"NNODES": "2", "RANK": "-1", "RDZV_ENDPOINT": "r-0.r:29400"}, "RANK=-1 is not a node rank below NNODES=2"),
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "1"}, "RDZV_ENDPOINT= must be host:port of node 0"),
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "RDZV_ENDPOINT": "r-0.r"}, "RDZV_ENDPOINT=r-0.r must be host:port"),
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "RDZV_ENDPOINT": "r-0.r:65535"}, "RDZV_ENDPOINT=r-0.r:65535 must be"),
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "RDZV_ENDPOINT": "r-0.r:1;id"}, "RDZV_ENDPOINT=r-0.r:1;id must be"),
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "0", "RDZV_ENDPOINT": "r-0.r:29400", "RDZV_TIMEOUT_SECONDS": "5"},
     "RDZV_TIMEOUT_SECONDS=5 must be a whole number of seconds, at least 10"),
    # Node 0's door (job/group.py) takes only requests signed with the group's secret.
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "0", "RDZV_ENDPOINT": "r-0.r:29400"},
     "NNODES=2 but GROUP_SECRET is not set: node 0 would answer any pod on the network; render the group with "
     "scripts/submit.py"),
    ({"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "RDZV_ENDPOINT": "r-0.r:29400", "GROUP_SECRET": GROUP_SECRET[:15]},
     "GROUP_SECRET is set but shorter than 16 bytes (its value is not shown)"),
]


@pytest.mark.parametrize("settings,message", GROUP_BAD, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s, _ in GROUP_BAD])
def test_a_group_setting_that_cannot_work_stops_the_pod_with_one_line(pod, settings, message):
    code, lines = pod(**settings)
    assert code == 64, lines
    errors = [line for line in lines if "error: " in line]
    assert len(errors) == 1 and message in errors[0], lines
    assert "; " in errors[0], "the line says how to fix it"
    assert GROUP_SECRET[:15] not in "\n".join(lines)


GOOD = [
    {},  # the defaults
    {"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "RDZV_ENDPOINT": "r-0.r:29400",
     "GROUP_SECRET": GROUP_SECRET},  # an Indexed Job's pod
    {"NNODES": "3", "RANK": "2", "MASTER_ADDR": "r-master-0", "MASTER_PORT": "23456",
     "GROUP_SECRET": GROUP_SECRET},  # a PyTorchJob's
    {"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "RDZV_ENDPOINT": "r-0.r:29400",
     "CHECKPOINT_HMAC_KEY": HMAC_KEY},  # no GROUP_SECRET: the group's key comes from the signing key
    {"NNODES": "1", "RANK": "5"},  # one pod: a RANK in the environment means nothing
    {"LEASE_TTL_SECONDS": "3", "LEASE_WAIT_SECONDS": "0", "HEALTH_MAX_AGE_SECONDS": "10",
     "UPLOAD_RETRY_SECONDS": "1", "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "adaptive", "S3_LEASE": "off"},
    {"S3_LEASE": "on", "CHECKPOINT_HMAC_KEY": HMAC_KEY, "TRAIN_ARGS": "--set 'train.name=a b'\n--set log.interval=1"},
    {"LEASE_TTL_SECONDS": "", "HEALTH_MAX_AGE_SECONDS": "", "S3_LEASE": ""},  # empty: the default, as the probes read it
]


@pytest.mark.parametrize("settings", GOOD, ids=[",".join(s) or "defaults" for s in GOOD])
def test_good_settings_pass_and_a_key_never_shows(pod, settings):
    code, lines = pod(**settings)
    assert passed_validation(code, lines), lines
    assert HMAC_KEY not in "\n".join(lines) and GROUP_SECRET not in "\n".join(lines)
    assert not any("did you mean" in line for line in lines), lines


# -- names that are no setting ----------------------------------------------------------------------

@pytest.mark.parametrize("name,setting", [
    ("TRAIN_ARG", "TRAIN_ARGS"), ("SYNC_INTERVAL_SECOND", "SYNC_INTERVAL_SECONDS"), ("S3_OUTPUT_URL", "S3_OUTPUT_URI"),
    ("train_args", "TRAIN_ARGS"), ("LEASE_TLL_SECONDS", "LEASE_TTL_SECONDS"), ("NPROC_PER_NODES", "NPROC_PER_NODE"),
])
def test_a_mistyped_setting_gets_a_warning_that_names_the_setting_and_the_pod_goes_on(pod, name, setting):
    code, lines = pod(**{name: "secret-value-1"})
    assert passed_validation(code, lines), lines
    warnings = [line for line in lines if "did you mean" in line]
    assert len(warnings) == 1, lines
    assert f"warning: {name} is not a setting of the pod, so it is ignored; did you mean {setting}?" in warnings[0]
    assert "secret-value-1" not in "\n".join(lines), "a value is never shown: it may be a secret"


def test_the_many_other_names_of_a_pods_env_get_no_word(pod):
    others = {name: "1" for name in (
        "PET_NPROC_PER_NODE", "PET_NNODES", "PET_MASTER_PORT", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
        "KUBERNETES_SERVICE_HOST", "KUBERNETES_PORT_443_TCP", "NVIDIA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_RANK",
        "NODE_RANK", "S3_ENDPOINT", "OMP_NUM_THREADS", "NCCL_DEBUG", "PIP_INDEX_URL", "HF_HOME", "TMPDIR")}
    code, lines = pod(**others)
    assert passed_validation(code, lines), lines
    assert not any("did you mean" in line or "warning" in line for line in lines), lines


# -- where the event lines go -------------------------------------------------------------------------

def test_events_stay_in_the_log_file_and_out_of_kubectl_logs_unless_asked(pod, tmp_path):
    log = tmp_path / "work" / ".pod" / "pod.log"
    code, lines = pod()
    assert passed_validation(code, lines), lines
    assert not any(line.startswith("EVENT ") for line in lines), lines
    in_file = log.read_text().splitlines()
    assert [line for line in in_file if line.startswith("EVENT ")][-1].startswith('EVENT {"event": "exit"'), in_file
    assert [line for line in in_file if not line.startswith("EVENT ")] == lines, "the same prose in both"

    code, lines = pod(EVENTS="stdout")
    assert passed_validation(code, lines), lines
    assert any(line.startswith('EVENT {"event": "exit"') for line in lines), lines


# -- TRAIN_ARGS: words as a shell splits them, nothing evaluated ---------------------------------

SPLITS = [
    ("", []),
    ("--set train.max_steps=2000", ["--set", "train.max_steps=2000"]),
    ("--set a=1\n--set b=2", ["--set", "a=1", "--set", "b=2"]),  # a newline separates, drops nothing
    ("  --set\ta=1  ", ["--set", "a=1"]),
    ("--set 'run.name=my run'", ["--set", "run.name=my run"]),
    ('--set "run.name=it\'s"', ["--set", "run.name=it's"]),
    ("--set run.name=a\\ b", ["--set", "run.name=a b"]),
    ("--set x=$(touch /tmp/pwned) --set y=$HOME", ["--set", "x=$(touch", "/tmp/pwned)", "--set", "y=$HOME"]),
    ("--set x=`id` --set y=*", ["--set", "x=`id`", "--set", "y=*"]),  # no command substitution, no globbing
    ("--set x=#1", ["--set", "x=#1"]),  # not a comment
    ("--set 'a=line one\nline two'", ["--set", "a=line one\nline two"]),
]


@pytest.mark.parametrize("text,words", SPLITS)
def test_train_args_are_split_as_shell_words_with_nothing_evaluated(text, words):
    assert train_args.split(text) == words


@pytest.mark.parametrize("text,message", [
    ("--set 'a=1", "TRAIN_ARGS has an unbalanced quote"),
    ('--set "a=1', "TRAIN_ARGS has an unbalanced quote"),
    ("--set a=1 \\", "TRAIN_ARGS ends in a lone backslash"),
])
def test_train_args_that_cannot_be_split_are_refused_with_the_fix(text, message):
    with pytest.raises(ValueError, match=message) as err:
        train_args.split(text)
    assert "\n" not in str(err.value) and "fix" in str(err.value)

