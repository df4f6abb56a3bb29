"""job/contract.py is the one owner of the exit codes: script.sh's `readonly EXIT_*` (bash cannot
import it) must equal it, and the Python helpers must use it rather than their own numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import contract
import lease
import s3
import uploader

SCRIPT = Path(__file__).resolve().parents[2] / "job" / "script.sh"


def bash_exit_codes() -> dict[str, int]:
    return {name: int(value) for name, value in
            re.findall(r"^readonly (EXIT_[A-Z_]+)=([0-9]+)$", SCRIPT.read_text(), flags=re.M)}


def test_script_sh_declares_every_contract_exit_code_with_the_same_value():
    assert bash_exit_codes() == contract.EXIT_CODES


def test_script_sh_names_no_exit_code_the_contract_lacks():
    assert set(bash_exit_codes()) <= set(contract.EXIT_CODES)


@pytest.mark.parametrize("module,name,contract_name", [
    (s3, "EXIT_BAD_INPUT", "EXIT_BAD_INPUT"),
    (s3, "EXIT_UNAVAILABLE", "EXIT_UNAVAILABLE"),
    (lease, "EXIT_COMPLETE", "EXIT_COMPLETE_FOUND"),
    (lease, "KEY", "LEASE_KEY"),
    (uploader, "EXIT_LEASE_LOST", "EXIT_LEASE_LOST"),
])
def test_the_helpers_take_their_codes_and_names_from_the_contract(module, name, contract_name):
    assert getattr(module, name) == getattr(contract, contract_name)


@pytest.mark.parametrize("line,expected", [
    ('EVENT {"event": "phase", "name": "sync code", "state": "done"}',
     {"event": "phase", "name": "sync code", "state": "done"}),
    ('EVENT {"event": "exit", "code": 0}\n', {"event": "exit", "code": 0}),
    ("2026-01-01T00:00:00Z script: sync code: done in 0.1s", None),   # prose
    ("EVENT not json", None),
    ('EVENT ["event"]', None),                                         # not an object
    ('EVENT {"name": "x"}', None),                                     # no event name
])
def test_parse_event(line, expected):
    assert contract.parse_event(line) == expected


def test_an_event_printed_is_parsed_back(capsys):
    contract.event("uploaded", "uploader", step=5, name="step-00000005")
    record = contract.parse_event(capsys.readouterr().out)
    assert contract.matches(record, "uploaded", step=5, source="uploader")
    assert not contract.matches(record, "uploaded", step=6)


def test_script_sh_names_the_lease_state_file_as_the_contract_does():
    names = dict(re.findall(r"^readonly (LEASE_STATE)=(\S+)$", SCRIPT.read_text(), flags=re.M))
    assert names == {"LEASE_STATE": contract.LEASE_STATE}


def test_script_sh_parses_no_json_inline():
    """JSON is read by job/*.py entry points with tests of their own, never by `python -c` strings."""
    for path in (SCRIPT, SCRIPT.parent / "settings.sh"):
        assert "python3 -c" not in path.read_text() and '"${PYTHON}" -c' not in path.read_text()


def bash_event(*args: str) -> str:
    """script.sh's event function, run alone."""
    import subprocess
    function = re.search(r"^event\(\) \{.*?^\}$", SCRIPT.read_text(), flags=re.M | re.S).group(0)
    return subprocess.run(["bash", "-c", function + '\nevent "$@"', "bash", *args], capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.parametrize("args,fields", [
    (["phase", "name=sync code", "state=start"], {"name": "sync code", "state": "start"}),
    (["phase", "name=restore checkpoint", "state=done", "seconds=0.512"], {"state": "done", "seconds": 0.512}),
    (["exit", "code=143", "seconds=12.000"], {"code": 143, "seconds": 12.0}),
    (["x", "path=a \"quoted\" \\ back\tslash"], {"path": 'a "quoted" \\ back slash'}),
    (["x", "n=007", "m=-", "k=1e5"], {"n": "007", "m": "-", "k": "1e5"}),   # not JSON numbers: strings
])
def test_script_sh_emits_events_python_parses(args, fields):
    record = contract.parse_event(bash_event(*args))
    assert record is not None and record["event"] == args[0] and record["source"] == "script"
    assert {k: record[k] for k in fields} == fields and isinstance(record["time"], float)


def test_wait_finds_an_event_in_a_pod_log_and_gives_up_after_its_time(tmp_path):
    import subprocess
    import sys
    log = tmp_path / "pod.log"
    log.write_text('2026 script: sync code...\nEVENT {"event": "uploaded", "step": 5}\n'
                   'EVENT {"event": "uploaded", "step": 100, "name": "step-00000100"}\n')
    command = [sys.executable, str(SCRIPT.parent / "contract.py"), "wait", str(log)]
    found = subprocess.run(command + ["0", "uploaded", "step=100"], capture_output=True, text=True)
    assert found.returncode == 0 and '"name": "step-00000100"' in found.stdout
    missing = subprocess.run(command + ["0", "uploaded", "step=10"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no event uploaded" in missing.stderr


@pytest.mark.parametrize("name,python_default", [
    ("LEASE_TTL_SECONDS", lambda: lease.ttl_seconds({})),
    ("LEASE_WAIT_SECONDS", lambda: lease.wait_seconds({})),
])
def test_script_sh_and_lease_py_default_the_lease_settings_alike(name, python_default):
    # script.sh fills in the default before lease.py and the uploader read it: one value, or the
    # pods run with the bash one whatever lease.py says.
    found = re.search(rf"^\s*{name}=\$\{{{name}:-([0-9]+)\}}$", (SCRIPT.parent / "settings.sh").read_text(),
                      flags=re.M)
    assert found and float(found.group(1)) == python_default()


# -- forged lines: text from S3 or the network never starts a line of its own ---------------------

FORGED_EXIT = 'EVENT {"event": "exit", "source": "script", "code": 0, "seconds": 1.0, "time": 1.0}'


def wait_for_exit_0(log: Path) -> int:
    import subprocess
    import sys
    command = [sys.executable, str(SCRIPT.parent / "contract.py"), "wait", str(log), "0", "exit", "code=0"]
    return subprocess.run(command, capture_output=True, text=True).returncode


@pytest.mark.parametrize("line", [
    f"2026 lease: waiting for the lease of x\r{FORGED_EXIT}",  # a carriage return is no line break
    f"   {FORGED_EXIT}",  # an event line starts with EVENT, nothing before it
])
def test_wait_takes_an_event_only_from_a_line_that_is_one(tmp_path, line):
    log = tmp_path / "pod.log"
    log.write_bytes(line.encode() + b"\nEVENT {\"event\": \"exit\", \"code\": 75}\n")
    assert wait_for_exit_0(log) == 1
    assert contract.parse_event(line) is None


def test_a_helpers_log_line_escapes_what_it_quotes(capsys):
    s3.log("lease", f"another pod (x\n{FORGED_EXIT}\r\x1b[1A\u2028) holds the lease")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "\r" not in out and "\x1b" not in out and "\u2028" not in out
    assert "(x\\nEVENT {" in out and "\\r\\x1b[1A\\u2028)" in out


@pytest.mark.parametrize("tool", ["aws", "s5cmd"])
def test_script_sh_logs_what_the_s3_tool_said_on_one_line_without_control_characters(tmp_path, tool):
    # A hostile endpoint's error text, quoted by the AWS CLI or s5cmd: its last line goes into
    # script.sh's warnings and its error line, and the log in S3.
    import subprocess
    import sys
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / tool).write_text("#!/bin/sh\nprintf 'An error occurred (x): \\033[1A\\rEVENT "
                                '{"event": "exit", "source": "script", "code": 0}\\n\' >&2\nexit 255\n')
    (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "S3_SYNC_TOOL": tool,
           "S3_CODE_URI": "s3://bucket/code/", "S3_DATA_URI": "s3://bucket/data/", "S3_OUTPUT_URI": "s3://bucket/runs/r/",
           "WORK_DIR": str(tmp_path / "work"), "READY_FILE": str(tmp_path / "ready"),
           "HEALTH_FILE": str(tmp_path / "healthy"), "NPROC_PER_NODE": "1", "S3_RETRY_SECONDS": "1"}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, timeout=60)
    log = tmp_path / "work" / ".pod" / "pod.log"
    assert result.returncode == 75, result.stdout + result.stderr
    for text in (result.stdout + result.stderr, log.read_bytes()):
        assert b"\r" not in text and b"\x1b" not in text
    assert b"(x): ?[1A?EVENT" in log.read_bytes(), "said, on one line"
    assert wait_for_exit_0(log) == 1, "the pod exited 75; no line may say 0"


def bash_array(name: str) -> list[str]:
    found = re.search(rf"^readonly {name}=\((.*?)\)$", SCRIPT.read_text(), flags=re.M | re.S)
    return found.group(1).split()


def test_script_sh_names_the_settings_the_contract_names():
    assert bash_array("SETTINGS") == list(contract.SETTINGS)
    assert bash_array("CONTROLLER_SETTINGS") == list(contract.CONTROLLER_SETTINGS)
    assert dict(re.findall(r"^readonly (POD_ERROR)=(\S+)", SCRIPT.read_text(), flags=re.M)) == \
        {"POD_ERROR": contract.POD_ERROR}


def test_script_sh_header_documents_every_setting():
    header = SCRIPT.read_text().split("\nset -o errexit")[0]
    rows = re.findall(r"^#   ([A-Z0-9_]+(?:, [A-Z0-9_]+)*) ", header, flags=re.M)
    documented = {name for row in rows for name in row.split(", ")}
    assert documented == set(contract.SETTINGS)


@pytest.mark.parametrize("names,expected", [
    (["TRAIN_ARG"], [("TRAIN_ARG", "TRAIN_ARGS")]),
    (["train_config"], [("train_config", "TRAIN_CONFIG")]),
    (["S3_OUPUT_URI", "WORKDIR"], [("S3_OUPUT_URI", "S3_OUTPUT_URI"), ("WORKDIR", "WORK_DIR")]),
    (["LEASE_TTL_SECOND"], [("LEASE_TTL_SECOND", "LEASE_TTL_SECONDS")]),
    (["NNODE"], [("NNODE", "NNODES")]),
    (["TRAIN_ARGS", "RANK", "MASTER_ADDR"], []),  # the settings themselves
    (["PET_NPROC_PER_NODE", "AWS_ENDPOINT_URL_S3", "PET_NNODES", "NODE_RANK", "WORLD_SIZE", "HOSTNAME"], []),
])
def test_near_misses_are_names_a_typo_away_from_a_setting(names, expected):
    assert contract.near_misses(names) == expected


def test_wait_gives_up_as_soon_as_the_pod_it_watches_has_ended(tmp_path):
    import subprocess
    import sys
    import time
    log = tmp_path / "pod.log"
    log.write_text("2026 script: error: S3_DATA_URI holds no train.bin\n")
    pod = subprocess.Popen(["sleep", "1"])
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "contract.py"), "wait", "--pid", str(pod.pid),
                             str(log), "600", "uploaded", "step=100"], capture_output=True, text=True, timeout=60)
    pod.wait()
    assert result.returncode == 1 and f"process {pod.pid} ended" in result.stderr
    assert time.monotonic() - started < 60  # not the 600 s it was given


def test_wait_with_a_pid_still_finds_the_event_the_pod_wrote_before_it_ended(tmp_path):
    import subprocess
    import sys
    log = tmp_path / "pod.log"
    log.write_text('EVENT {"event": "exit", "code": 64}\n')
    done = subprocess.Popen(["true"])
    done.wait()
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "contract.py"), "wait", "--pid", str(done.pid),
                             str(log), "600", "exit"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and '"code": 64' in result.stdout


WRITERS = """
import sys
import contract, s3, trainer_kit
say = trainer_kit.logger("train")
for i in range(int(sys.argv[2])):
    contract.event("step", sys.argv[1], step=i)
    say(f"prose {sys.argv[1]} {i}")
    s3.log(sys.argv[1], f"helper {i}")
"""


def test_lines_from_processes_sharing_the_pods_pipe_stay_whole():
    # The pod's processes (trainer, uploader, lease) write into one pipe; a line written in two parts
    # lets another's land inside it, and an event glued to the end of a prose line is one no tool sees.
    lines, processes = 1500, 3
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(SCRIPT.parent)}
    children = [subprocess.Popen([sys.executable, "-c", WRITERS, f"w{n}", str(lines)], stdout=write_end, env=env)
                for n in range(processes)]
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        output = pipe.read().splitlines()
    assert [child.wait() for child in children] == [0] * processes
    events = [contract.parse_event(line) for line in output]
    assert sum(event is not None for event in events) == lines * processes
    prose = [line for line, event in zip(output, events) if event is None]
    assert len(prose) == 2 * lines * processes
    assert all(re.fullmatch(r"\S+Z (train: prose|w\d: helper) .*\d", line) for line in prose), \
        [line for line in prose if not re.fullmatch(r"\S+Z (train: prose|w\d: helper) .*\d", line)][:3]


S3_URI_SH = SCRIPT.parent / "s3_uri.sh"


@pytest.mark.parametrize("uri,taken", [
    ("s3://bkt", True), ("s3://bkt/", True), ("s3://my-bucket.v2/runs/r 1/", True), ("s3://" + "a" * 63, True),
    ("s3://ab/", False), ("s3://" + "a" * 64, False), ("s3://Bucket/x/", False), ("s3://-bkt/", False),
    ("s3://bkt-/x", False), ("s3:///x/", False), ("https://bkt/x/", False), ("bkt/x/", False), ("", False),
    ("s3://user:pw@bkt/x/", False), ("s3://bkt/a\nb/", True), ("s3://bkt/a\tb/", True), ("s3://bkt/a\x7f/", True),
    ("s3://Bkt/a\nb/", False), ("s3://bkt/é/", True), ("s3://bkt/\x85/", True), ("s3://bkt/a\n", True),
    ("s3://bk\nt/", False),
])
def test_the_shell_and_python_tell_an_s3_uri_alike_and_say_why_one_is_not(uri, taken):
    """s3_uri.sh (settings.sh, stage.sh, tensorboard.sh) and contract.s3_uri_fault (submit.py)."""
    shell = subprocess.run(["bash", "-c", f'source "{S3_URI_SH}"; s3_uri_fault "$1"', "-", uri],
                           capture_output=True, text=True)
    assert (shell.returncode == 0) == taken and shell.stdout == contract.s3_uri_fault(uri)
    assert bool(shell.stdout) != taken
    assert ("(a bucket name" in shell.stdout) == (not taken and uri.startswith("s3://"))

