#!/usr/bin/env python3
"""Run the Hugging Face tests against each transformers version of the supported range, each in a
venv of its own, and write the table.

    python lab/hf_versions.py [--sets 4.57,5.0,5.17,newest] [--cache DIR] [--out FILE_STEM] [-- PYTEST_ARGS...]

Each set is a venv under --cache (default ~/.cache/hf-versions, reused by the next run) that sees
this repository's .venv (the pinned CPU torch and everything else) through a .pth file, as
job/python_env.sh builds a pod's venv, and gets its own transformers, accelerate, peft and datasets
from PyPI (pure-Python wheels), within job/constraints.txt. The oldest set pins the companions an
image of its time carries (the lower end of each range); the others take the newest in range.
pytest runs TESTS there (what depends on the library's version; `-- ARGS` for others);
FILE_STEM.md and FILE_STEM.json get the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "job" / "constraints.txt"
SETS = {
    "4.57": ["transformers==4.57.6", "accelerate==1.10.1", "peft==0.17.1", "datasets==4.0.0"],
    "5.0": ["transformers==5.0.0"],
    "5.17": ["transformers==5.17.0"],
    "newest": ["transformers"],
    "pinned": ["transformers==5.23.0"],  # requirements.txt's, what CI runs: nothing installed over .venv
}
SHOWN = ("transformers", "accelerate", "peft", "datasets", "huggingface_hub", "tokenizers", "torch")
# What depends on the library's version, kept to what a loaded 2-core machine runs in minutes a set:
# the Trainer API the callback and finetune.py use (the unit tests), an exact resume of 2 processes
# after SIGKILL (every rank's RNG file), the SIGTERM save, a finished run, what a checkpoint holds,
# and a plain Trainer script with the four lines. `-- ARGS` runs others (all of tests/test_finetune.py).
TESTS = ["tests/unit/test_hf_resume.py", "tests/unit/test_finetune_config.py", "tests/unit/test_trainer_events.py",
         "tests/test_finetune.py::test_two_processes_under_torchrun_resume_bitwise_exact",
         "tests/test_finetune.py::test_sigterm_commits_the_current_step_exits_143_and_no_step_is_redone[sigterm-1]",
         "tests/test_finetune.py::test_a_restart_from_the_last_step_or_past_it_trains_nothing_and_exits_0[at-the-last-step]",
         "tests/test_finetune.py::test_committed_checkpoints_hold_every_trainer_file_and_reports_are_written",
         "tests/test_finetune.py::test_a_plain_trainer_script_with_the_four_lines_resumes_exactly"]


def log(message: str) -> None:
    print(f"hf_versions: {message}", file=sys.stderr, flush=True)


def make_venv(folder: Path, specs: list[str]) -> Path:
    """A venv over this interpreter's packages with the set's libraries installed into it."""
    python = folder / "bin" / "python"
    stamp = folder / ".ready"
    if stamp.is_file() and stamp.read_text() == json.dumps(specs):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(folder)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    import site as base_site

    Path(site, "_base_packages.pth").write_text("\n".join(base_site.getsitepackages()) + "\n")
    torch_pin = folder / "torch-pin.txt"  # the base's CPU torch: pip never swaps it for a CUDA one
    torch_pin.write_text(f"torch=={_version('torch')}\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--upgrade", "--upgrade-strategy", "only-if-needed", "-c", str(CONSTRAINTS),
                    "-c", str(torch_pin), *specs], check=True)
    # The tests start torchrun from the interpreter's folder; the base's script would run the base.
    torchrun = folder / "bin" / "torchrun"
    torchrun.write_text(f"#!{python}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n")
    torchrun.chmod(0o755)
    stamp.write_text(json.dumps(specs))
    return python


def _version(name: str) -> str:
    from importlib import metadata

    return metadata.version(name)


def versions_in(python: Path) -> dict:
    code = ("import json; from importlib import metadata as m; "
            f"print(json.dumps({{n: m.version(n) for n in {list(SHOWN)!r}}}))")
    return json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout)


def run_tests(python: Path, report: Path, pytest_args: list[str]) -> dict:
    started = time.monotonic()
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    *(pytest_args or TESTS)], cwd=ROOT, env=env)
    return {"seconds": round(time.monotonic() - started, 1), **outcomes(report)}


def outcomes(report: Path) -> dict:
    """Counts and the failed tests' names and first lines, from pytest's JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ElementTree.parse(report).iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            first = (problem.get("message") or "").strip().splitlines()
            failures.append(f"{case.get('name')}: {first[0][:200] if first else '?'}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def markdown(rows: list[dict]) -> str:
    head = ["set", *SHOWN, "passed", "failed", "skipped", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["set"], *(row["versions"].get(n, "-") for n in SHOWN),
                 *(str(row[k]) for k in ("passed", "failed", "skipped", "seconds"))]
        lines.append("| " + " | ".join(cells) + " |")
    failures = [f"- {row['set']}: {f}" for row in rows for f in row["failures"]]
    return "\n".join(lines + ([""] + failures if failures else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="4.57,5.0,5.17,newest", help=f"comma-separated, of {', '.join(SETS)}")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "hf-versions"))
    parser.add_argument("--out", default="hf-versions", help="FILE_STEM: writes FILE_STEM.md and FILE_STEM.json")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs instead of the default tests")
    args = parser.parse_args(argv)
    names = args.sets.split(",")
    unknown = [n for n in names if n not in SETS]
    if unknown:
        parser.error(f"unknown set {', '.join(unknown)}; choose from {', '.join(SETS)}")
    rows = []
    for name in names:
        folder = Path(args.cache) / name
        log(f"{name}: venv {folder}")
        python = make_venv(folder, SETS[name])
        row = {"set": name, "versions": versions_in(python)}
        log(f"{name}: {row['versions']}; running the tests")
        row.update(run_tests(python, folder / "report.xml", args.pytest_args))
        log(f"{name}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped in {row['seconds']} s")
        rows.append(row)
    measured = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0], "rows": rows}
    Path(f"{args.out}.json").write_text(json.dumps(measured, indent=2) + "\n")
    Path(f"{args.out}.md").write_text(f"Measured {measured['date']} (Python {measured['python']}):\n\n" + markdown(rows))
    print(markdown(rows))
    return 1 if any(row["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
