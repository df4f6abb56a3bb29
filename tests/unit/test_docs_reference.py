"""docs/reference.md's tables match the code, so they cannot drift: every environment variable the
pod reads or sets, every config key with its default, every exit code, every event kind, the S3
layout's names; and the README's layout table names every file of the shipped folders.

What the code reads is found in the code itself, by rules written down here:
- job/script.sh, with job/settings.sh that it sources (the settings' checks) as one text: its
  settings are script.sh's `readonly SETTINGS=(...)` array (job/contract.py's SETTINGS,
  which tests/unit/test_contract.py keeps equal), and the names a controller sets are its
  `CONTROLLER_SETTINGS`; each must be read by the pod's code, not only listed. Anywhere else in the
  script, a name read and never assigned (or assigned from itself, `X=${X:-default}`) comes from
  the environment too, as do names listed in a `for ... in A B C` loop. What it exports, or sets in
  front of a command (`X=value command`), it sets for its processes.
- Python (job/, code/, scripts/): os.environ reads and writes by literal name, the settings helpers
  (`*seconds*("NAME", ...)`), and `*_ENV = "NAME"` constants.
- job.yaml: its container's env.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
import yaml

import config
import contract
import finetune
from markdown_docs import ROOT, code_spans, tables

REFERENCE = ROOT / "docs" / "reference.md"
SCRIPT = ROOT / "job" / "script.sh"
POD_SHELL = (SCRIPT, ROOT / "job" / "settings.sh")  # script.sh sources settings.sh: one program
BASH_OWN = {"SECONDS", "RANDOM", "BASH_SOURCE", "BASH_REMATCH", "LINENO", "BASH_COMMAND", "PIPESTATUS"}
NOT_THE_PODS = {"LC_ALL": "the C locale for one sed or a byte count, never the pod's interface"}
NAME = r"[A-Z][A-Z0-9_]*"

# -- the code's side ----------------------------------------------------------------------------


def strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def bash_array(name: str) -> list[str]:
    """The words of job/script.sh's `readonly NAME=(...)`."""
    found = re.search(rf"^readonly {name}=\((.*?)\)$", SCRIPT.read_text(), flags=re.M | re.S)
    assert found, f"job/script.sh has no readonly {name}=(...) array"
    return found.group(1).split()


def shell_events(text: str) -> list[tuple[int, str, str]]:
    """(position, 'read' | 'assign' | 'self', NAME) in text order."""
    events = []
    for match in re.finditer(rf"\$\{{#?({NAME})|\$({NAME})\b|-v ({NAME})\b|\bcheck_\w+ ({NAME})\b", text):
        events.append((match.start(), "read", next(g for g in match.groups() if g)))
    for match in re.finditer(rf"for \w+ in ((?:{NAME}[ ;])+)", text):
        events += [(match.start(), "read", name) for name in re.findall(NAME, match.group(1))]
    # An assignment starts a statement (not a word inside a message: "set PYTHON=/path").
    start = r"(?:^|[;&|()]|\bthen|\bdo|\belse)[ \t]*(?:(?:local|readonly|export|declare)[ \t]+)?"
    for match in re.finditer(rf"{start}(?:{NAME}=\S*[ \t]+)*({NAME})\+?=(\S*)", text, re.M):
        name, value = match.groups()
        kind = "self" if value.lstrip('"').startswith(("${" + name + ":", "${" + name + "}", "${" + name + "-")) else "assign"
        events.append((match.start(1), kind, name))
    for match in re.finditer(rf"(?:mapfile|read)\b[^\n<]*?\b({NAME})\b\s*(?:<|$)", text, re.M):
        events.append((match.start(1), "assign", match.group(1)))
    return sorted(events)


def shell_text(*paths: Path) -> str:
    return "\n".join(strip_comments(path.read_text()) for path in paths)


def shell_reads(*paths: Path) -> set[str]:
    """Names a shell script (and what it sources, given with it) takes from its environment,
    anywhere in it: read and never assigned (or assigned from themselves), or listed in a `for`
    loop that looks them up by name."""
    text = shell_text(*paths)
    events = shell_events(text)
    assigned = {n for _, kind, n in events if kind == "assign"}
    looked_up = {n for m in re.finditer(rf"for \w+ in ((?:{NAME}[ ;])+)", text) for n in re.findall(NAME, m.group(1))}
    return ({n for _, kind, n in events if kind in ("read", "self") and n not in assigned} | looked_up) - BASH_OWN


def script_settings() -> set[str]:
    return set(bash_array("SETTINGS"))


def controller_settings() -> set[str]:
    return set(bash_array("CONTROLLER_SETTINGS"))


def script_reads_outside_its_arrays() -> set[str]:
    """Names job/script.sh reads (or assigns from themselves) anywhere but in its name arrays."""
    text = re.sub(r"^readonly (?:CONTROLLER_)?SETTINGS=\(.*?\)$", "", shell_text(*POD_SHELL),
                  flags=re.M | re.S)
    return {name for _, kind, name in shell_events(text) if kind in ("read", "self")}


def script_defaults() -> dict[str, str]:
    text = shell_text(*POD_SHELL)
    return {name: value for name, value in re.findall(rf"\b({NAME})=\$\{{\1:-([^$}}]+)\}}", text)}


def shell_sets(*paths: Path) -> set[str]:
    """Names a script (and what it sources, given with it) exports, or sets in front of a command
    for it alone."""
    text = shell_text(*paths)
    found = set()
    for match in re.finditer(r"^\s*export ([^\n]+)$", text, re.M):
        found |= set(re.findall(rf"(?:^|\s)({NAME})(?==|\s|$)", match.group(1)))
    for match in re.finditer(rf"^\s*((?:{NAME}=(?![^\s]*\$\()\S+ +)+)(?:\\\n\s*)?[\"$\w/.]", text, re.M):
        found |= set(re.findall(rf"({NAME})=", match.group(1)))
    return found - set(NOT_THE_PODS)


PY_READS = [
    rf"environ\.get\(\s*\"({NAME})\"",
    rf"environ\)\.get\(\s*\"({NAME})\"",
    rf"environ\[\s*\"({NAME})\"\s*\](?!\s*=[^=])",
    rf"getenv\(\s*\"({NAME})\"",
    rf"\w*seconds\w*\(\s*(?:environ,\s*)?\"({NAME})\"",
    rf"^\w*_ENV\w* = \"({NAME})\"",
]
PY_SETS = [rf"environ\[\s*\"({NAME})\"\s*\]\s*=[^=]", rf"environ\.setdefault\(\s*\"({NAME})\""]


def python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).glob("*.py")) if not p.is_symlink()]


def python_reads(*folders: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in python_files(*folders):
        text = path.read_text()
        for pattern in PY_READS:
            for name in re.findall(pattern, text, re.M):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def python_sets(*folders: str) -> set[str]:
    found = set()
    for path in python_files(*folders):
        text = path.read_text()
        for pattern in PY_SETS:
            found |= set(re.findall(pattern, text))
        # for NAME in ("A", "B") / a tuple constant: os.environ[NAME] = ...
        for var, source in re.findall(r"for (\w+) in (\([^)]*\)|\w+):\s*\n\s*os\.environ\[\1\]\s*=", text):
            if not source.startswith("("):
                source = re.search(rf"^{source} = (\([^)]*\))", text, re.M).group(1)
            found |= set(re.findall(rf"\"({NAME})\"", source))
    return found


def python_defaults(*folders: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in python_files(*folders):
        text = path.read_text()
        for name, value in re.findall(rf"\"({NAME})\",\s*\"([^\"]+)\"", text):
            if not re.fullmatch(NAME, value):  # a tuple of names (contract.SETTINGS), not a default
                found.setdefault(name, set()).add(value)
        for name, value in re.findall(rf"get\(\s*\"({NAME})\"(?:,\s*\"\")?\)\s*or\s*\"?([\w.]+)\"?", text):
            found.setdefault(name, set()).add(value)
    return found


def job_yaml_env() -> dict[str, str]:
    job = yaml.safe_load((ROOT / "job.yaml").read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: str(item.get("value", "")) for item in container.get("env", [])}


def pod_reads() -> dict[str, set[str]]:
    reads = python_reads("job", "code")
    for name in (script_settings() | controller_settings() | shell_reads(*POD_SHELL)
                 | shell_reads(ROOT / "job" / "python_env.sh")):
        reads.setdefault(name, set()).add("job/script.sh")
    return reads


def laptop_reads() -> dict[str, set[str]]:
    reads = python_reads("scripts", "scripts/lib")
    for path in sorted((ROOT / "scripts").rglob("*.sh")):
        for name in shell_reads(path):
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return reads


# Where each package reads its environment (torch's launcher is all a pod's torchrun is).
PACKAGE_FOLDERS = {"botocore": "botocore", "torch": "torch/distributed", "tensorboard": "tensorboard"}


@functools.lru_cache(maxsize=None)
def installed_source(package: str) -> str:
    site = Path(__import__(package).__file__).parent.parent
    return "\n".join(p.read_text(errors="ignore") for p in (site / PACKAGE_FOLDERS[package]).rglob("*.py"))


def installed_source_has(package: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", installed_source(package)) is not None


# -- the doc's side -----------------------------------------------------------------------------

DOC_TABLES = tables(REFERENCE)


def table(heading: str) -> list[dict[str, str]]:
    assert heading in DOC_TABLES, f"docs/reference.md has no table under the heading {heading!r}"
    header, *rows = DOC_TABLES[heading]
    return [dict(zip(header, row)) for row in rows]


def names(heading: str) -> dict[str, dict[str, str]]:
    """The first column's name (in backticks) -> its row."""
    found = {}
    for row in table(heading):
        first = next(iter(row.values()))
        spans = code_spans(first)
        assert spans, f"docs/reference.md, table {heading!r}: the row {first!r} names nothing in backticks"
        found[spans[0]] = row
    return found


SETTINGS = "The pod's settings"
PLATFORM = "Read from the platform"
SET_BY_POD = "Set by the pod for its processes"
SET_IN_JOB_YAML = "Set in job.yaml"
SET_BY_TRAINERS = "Set by the trainers"
TOOLS = "Read by the tools the pod runs"
LAPTOP = "Read by the laptop tools"
HOOKS = "Test hooks"
POD_READ_TABLES = (SETTINGS, PLATFORM, SET_BY_POD, HOOKS)
PACKAGES = tuple(PACKAGE_FOLDERS)


def where(name: str, tables_: tuple[str, ...]) -> str | None:
    return next((t for t in tables_ if name in names(t)), None)


# -- the tests ----------------------------------------------------------------------------------

def test_the_scanners_find_what_is_known_to_be_there():
    """The rules above must see the code at all: an empty scan would let every table pass."""
    assert {"S3_CODE_URI", "LEASE_TTL_SECONDS", "RDZV_ENDPOINT", "CHECKPOINT_HMAC_KEY", "TRAIN_ARGS", "EVENTS",
            "GROUP_SECRET"} <= script_settings()
    assert {"STATE_DIR", "CODE_DIR", "NODE_RANK", "TRAIN_ARGV", "EXIT_BAD_INPUT"}.isdisjoint(script_settings())
    assert {"JOB_COMPLETION_INDEX", "PET_NODE_RANK", "MASTER_PORT"} <= controller_settings()
    assert {"S3_OUTPUT_URI", "EVENTS", "GROUP_SECRET", "TRAIN_ARGS"} <= script_reads_outside_its_arrays()
    assert {"HOSTNAME", "PYTHONPATH"} <= shell_reads(*POD_SHELL)
    assert {"TMPDIR", "TORCHELASTIC_ERROR_FILE", "S3_ENDPOINT_URL"} <= shell_sets(*POD_SHELL)
    assert {"RANK", "HEALTH_FILE", "UPLOAD_RETRY_SECONDS", "CHECKPOINT_HMAC_KEY"} <= set(python_reads("job", "code"))
    assert {"HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"} <= python_sets("job", "code")
    assert {"TEST_WORKERS", "S3_ENDPOINT"} <= set(laptop_reads())
    assert script_defaults()["LEASE_TTL_SECONDS"] == "30"
    assert python_defaults("job")["LEASE_WAIT_SECONDS"] == {"3000"}, "a tuple of names is no default"


def test_every_name_the_pod_reads_is_in_a_table():
    missing = [f"{name} (read in {', '.join(sorted(files))})" for name, files in sorted(pod_reads().items())
               if where(name, POD_READ_TABLES) is None]
    assert not missing, ("the pod reads these, but no table of docs/reference.md lists them "
                         f"({', '.join(POD_READ_TABLES)}): {'; '.join(missing)}")


@pytest.mark.parametrize("heading", [SETTINGS, PLATFORM, HOOKS])
def test_every_name_a_read_table_lists_is_read_by_the_pod(heading):
    reads = pod_reads()
    extra = sorted(set(names(heading)) - set(reads))
    assert not extra, f"docs/reference.md, table {heading!r} lists {', '.join(extra)}, which the pod's code never reads"


def test_the_settings_table_is_script_sh_settings():
    """A setting is a name of script.sh's SETTINGS (contract.SETTINGS): each has a row, and each row is
    one; the platform's names go in their own table."""
    missing = sorted(script_settings() - set(names(SETTINGS)))
    assert not missing, f"job/script.sh's SETTINGS has {', '.join(missing)}; docs/reference.md, table {SETTINGS!r} lacks them"
    extra = sorted(set(names(SETTINGS)) - script_settings())
    assert not extra, (f"docs/reference.md, table {SETTINGS!r} lists {', '.join(extra)}, which is not in "
                       "job/script.sh's SETTINGS (job/contract.py's)")


def test_every_setting_is_read_by_the_pods_code():
    """Listed is not enough: a name in SETTINGS that nothing reads would be a setting that does nothing."""
    read = script_reads_outside_its_arrays() | set(python_reads("job", "code"))
    unread = sorted((script_settings() | controller_settings()) - read)
    assert not unread, f"job/script.sh lists {', '.join(unread)} as settings, but neither it nor job/ or code/ reads them"


def test_the_names_a_controller_sets_are_in_the_platform_table():
    missing = sorted(controller_settings() - set(names(PLATFORM)))
    assert not missing, (f"job/script.sh's CONTROLLER_SETTINGS has {', '.join(missing)}; docs/reference.md, "
                         f"table {PLATFORM!r} lacks them")


@pytest.mark.parametrize("name,value", sorted(script_defaults().items()))
def test_a_settings_literal_default_is_the_documented_one(name, value):
    rows = names(SETTINGS)
    if name not in script_settings():
        pytest.skip(f"{name} is not a setting (its default is internal)")
    documented = code_spans(rows[name]["default"])
    assert documented and documented[0] == value, (
        f"docs/reference.md, table {SETTINGS!r}: {name}'s default is {rows[name]['default']!r}, "
        f"job/script.sh's is {value!r}")


@pytest.mark.parametrize("name,values", sorted((n, v) for n, v in python_defaults("job").items()
                                                if n in script_defaults()))
def test_the_python_helpers_default_to_what_script_sh_does(name, values):
    assert values == {script_defaults()[name]}, (
        f"{name}: job/script.sh defaults to {script_defaults()[name]!r}, the Python helpers to {sorted(values)}")


def test_set_by_the_pod_is_what_script_sh_exports_or_sets_for_a_command():
    expected = shell_sets(*POD_SHELL) - set(names(SETTINGS)) - set(names(PLATFORM))
    documented = set(names(SET_BY_POD))
    assert not expected - documented, (f"job/script.sh sets {', '.join(sorted(expected - documented))} for its "
                                       f"processes; docs/reference.md, table {SET_BY_POD!r} lacks them")
    assert not documented - expected, (f"docs/reference.md, table {SET_BY_POD!r} lists "
                                       f"{', '.join(sorted(documented - expected))}, which job/script.sh never sets")


def test_job_yaml_env_is_settings_or_its_own_table():
    env = set(job_yaml_env())
    own = set(names(SET_IN_JOB_YAML))
    missing = sorted(env - own - set(names(SETTINGS)))
    assert not missing, f"job.yaml sets {', '.join(missing)}; docs/reference.md, table {SET_IN_JOB_YAML!r} lacks them"
    extra = sorted(own - env)
    assert not extra, f"docs/reference.md, table {SET_IN_JOB_YAML!r} lists {', '.join(extra)}, which job.yaml does not set"
    for name in own:
        documented = code_spans(names(SET_IN_JOB_YAML)[name]["value"])
        assert documented and documented[0] == job_yaml_env()[name], (
            f"docs/reference.md, table {SET_IN_JOB_YAML!r}: {name} is {documented}, job.yaml says {job_yaml_env()[name]!r}")


def test_set_by_the_trainers_is_what_they_set():
    expected, documented = python_sets("job", "code"), set(names(SET_BY_TRAINERS))
    assert expected == documented, (f"docs/reference.md, table {SET_BY_TRAINERS!r}: lacks "
                                    f"{sorted(expected - documented)}, lists what no trainer sets: "
                                    f"{sorted(documented - expected)}")


@pytest.mark.parametrize("heading", [TOOLS, LAPTOP])
def test_a_name_read_by_a_tool_is_in_that_tools_installed_source(heading):
    laptop = laptop_reads()
    for name, row in names(heading).items():
        if heading == LAPTOP and name in laptop:
            continue
        packages = [p for p in PACKAGES if p in row["read by"]]
        assert packages, (f"docs/reference.md, table {heading!r}: {name} is read by {row['read by']!r}, "
                          f"which is neither the laptop tools' code nor one of {', '.join(PACKAGES)}")
        assert all(installed_source_has(p, name) for p in packages), (
            f"docs/reference.md, table {heading!r}: {name} is said to be read by {', '.join(packages)}, "
            "whose installed source never names it")


def test_every_name_the_laptop_tools_read_is_in_their_table():
    missing = sorted(set(laptop_reads()) - set(names(LAPTOP)))
    assert not missing, f"the laptop tools read {', '.join(missing)}; docs/reference.md, table {LAPTOP!r} lacks them"


def config_keys(groups_class) -> dict[str, tuple[type, object]]:
    found = {}
    for group in dataclasses.fields(groups_class):
        group_type = typing.get_type_hints(groups_class)[group.name]
        hints = typing.get_type_hints(group_type)
        for field in dataclasses.fields(group_type):
            found[f"{group.name}.{field.name}"] = (hints[field.name], field.default)
    return found


def documented_value(kind: type, text: str):
    if kind is bool or not isinstance(kind, type):  # a union (an integer or auto) reads as YAML reads it
        return yaml.safe_load(text)
    if kind is str and text == '""':
        return ""
    return kind(text)


@pytest.mark.parametrize("heading,groups_class", [
    ("train.py (config/conf.yaml, config/smoke.yaml)", config.Config),
    ("finetune.py (config/finetune.yaml)", finetune.Settings),
], ids=["train.py", "finetune.py"])
def test_config_tables_name_every_key_with_its_default(heading, groups_class):
    keys, rows = config_keys(groups_class), names(heading)
    assert not set(keys) - set(rows), f"docs/reference.md, table {heading!r} lacks {sorted(set(keys) - set(rows))}"
    assert not set(rows) - set(keys), (f"docs/reference.md, table {heading!r} lists {sorted(set(rows) - set(keys))}, "
                                       f"which {groups_class.__module__}.py does not have")
    for key, (kind, default) in keys.items():
        spans = code_spans(rows[key]["default"])
        assert spans and documented_value(kind, spans[0]) == default, (
            f"docs/reference.md, table {heading!r}: {key}'s default is {rows[key]['default']!r}, the code's {default!r}")


def test_the_shipped_configs_set_only_documented_keys():
    rows = {**names("train.py (config/conf.yaml, config/smoke.yaml)")}
    for name in ("conf.yaml", "smoke.yaml"):
        raw = yaml.safe_load((ROOT / "config" / name).read_text())
        keys = {f"{group}.{key}" for group, values in raw.items() for key in values}
        assert keys <= set(rows), f"config/{name} sets {sorted(keys - set(rows))}, not in docs/reference.md"


def contract_exit_codes() -> dict[str, int]:
    return {name: value for name, value in vars(contract).items()
            if name.startswith("EXIT_") and isinstance(value, int)}


def test_exit_code_table_is_the_contracts():
    documented = set()
    for row in table("Exit codes"):
        documented |= {int(code) for code in code_spans(row["code"]) if code.isdigit()}
    codes = set(contract_exit_codes().values())
    assert not codes - documented, (f"job/contract.py defines exit codes {sorted(codes - documented)}; "
                                    "docs/reference.md, table 'Exit codes' lacks them")
    assert not documented - codes, (f"docs/reference.md, table 'Exit codes' lists {sorted(documented - codes)}, "
                                    "which job/contract.py does not define")


def emitted_events() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in python_files("job", "code"):
        for kind in re.findall(r"\bevent\(\s*\"(\w+)\"", path.read_text()):
            found.setdefault(kind, set()).add(str(path.relative_to(ROOT)))
    for kind in re.findall(r"^\s*event (\w+)", shell_text(*POD_SHELL), re.M):
        found.setdefault(kind, set()).add("job/script.sh")
    return found


def test_events_table_is_the_contracts():
    documented = set(names("Events"))
    assert set(contract.EVENTS) == documented, (
        f"docs/reference.md, table 'Events': lacks {sorted(set(contract.EVENTS) - documented)}, lists what "
        f"job/contract.py's EVENTS does not have: {sorted(documented - set(contract.EVENTS))}")


def test_every_event_emitted_is_one_the_contract_names():
    emitted = emitted_events()
    assert len(emitted) >= 10, "the scan must find the emitters"
    strays = {kind: files for kind, files in emitted.items() if kind not in contract.EVENTS}
    assert not strays, f"events emitted but not in job/contract.py's EVENTS (nor docs/reference.md): {strays}"


def test_the_s3_layout_names_what_the_contract_names():
    layout = REFERENCE.read_text().split("## The S3 layout of a run", 1)[1].split("\n## ", 1)[0]
    for name in ("CHECKPOINTS_DIR", "MANIFEST", "TENSORBOARD_DIR", "LOGS_PREFIX", "STATUS_KEY", "LEASE_KEY",
                 "COMPLETE_KEY"):
        assert getattr(contract, name) in layout, (
            f"docs/reference.md's S3 layout does not name contract.{name} ({getattr(contract, name)!r})")


LAYOUT_FOLDERS = ("job", "code", "config", "scripts", "lab")


def readme_layout() -> dict[str, str]:
    rows = tables(ROOT / "README.md")["Repository layout"][1:]
    return {code_spans(row[0])[0].rstrip("/"): row[1] for row in rows}


@pytest.mark.parametrize("folder", LAYOUT_FOLDERS)
def test_the_readme_layout_table_names_every_file_and_only_real_ones(folder):
    row = readme_layout().get(folder)
    assert row is not None, f"README.md's layout table has no row for {folder}/"
    files = {str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    named = {span for span in code_spans(row) if re.fullmatch(r"[\w/.-]+\.\w+", span)}
    assert not files - named, f"README.md's layout table, row {folder}/, does not name {sorted(files - named)}"
    assert not named - files, f"README.md's layout table, row {folder}/, names {sorted(named - files)}, which do not exist"
