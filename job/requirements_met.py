"""Exit 0 when this Python already satisfies every requirement in the given files, else 1 and a
list of what is missing; 64 for a file that is not a requirements file.

    python3 requirements_met.py code/requirements.txt job/requirements.txt
    python3 requirements_met.py --runtime    "Python 3.x.y, torch 2.z"; exit 64 and one line for a torch before 2.6

It reads installed metadata only (no pip, no network): the check costs milliseconds, so a pod
whose image has everything installs nothing.
"""

from __future__ import annotations

import sys
from importlib import metadata

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip vendors packaging; an image with pip has it
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.version import InvalidVersion, Version

# torch.load(weights_only=True) runs code from a crafted file before 2.6 (CVE-2025-32434), and the
# pod loads checkpoints from S3. Pre-releases of 2.6.0 (2.6.0a0 builds) predate the fix: refused too.
SAFE_TORCH = Version("2.6.0")


def unmet(paths: list[str]) -> list[str]:
    missing = []
    for path in paths:
        with open(path) as file:
            for number, raw in enumerate(file, 1):
                line = raw.split("#", 1)[0].strip()
                if not line:
                    continue
                if line.startswith("-"):
                    missing.append(f"{line} (a pip option: pip decides)")
                    continue
                try:
                    requirement = Requirement(line)
                except InvalidRequirement as err:
                    raise ValueError(f"{path} line {number}: {err}; fix the requirement") from None
                problem = check(requirement)
                if problem:
                    missing.append(problem)
    return missing


def check(requirement: Requirement) -> str | None:
    if requirement.marker and not requirement.marker.evaluate():
        return None
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return f"{requirement.name} (not installed)"
    if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
        return f"{requirement} (have {version})"
    return None


def torch_refusal(version: str) -> str | None:
    """None when this torch may load checkpoints from S3; else the one line that says why not."""
    try:
        too_old = Version(version) < SAFE_TORCH
    except InvalidVersion:
        return f"torch's version {version!r} cannot be read; use an image with a released torch 2.6 or newer"
    if not too_old:
        return None
    return (f"torch {version} is older than 2.6: its torch.load can run code from a crafted checkpoint "
            "(CVE-2025-32434) and the pod loads checkpoints from S3; use an image with torch 2.6 or newer")


def runtime() -> int:
    """The line script.sh logs about its Python, or exit 64 with the reason to refuse it."""
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        print("the pod's Python has no torch; use an image with torch 2.6 or newer")
        return 64
    problem = torch_refusal(torch)
    if problem:
        print(problem)
        return 64
    print(f"Python {sys.version.split()[0]}, torch {torch}")
    return 0


def main(paths: list[str]) -> int:
    if paths == ["--runtime"]:
        return runtime()
    try:
        missing = unmet(paths)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 64
    if missing:
        print("missing: " + ", ".join(missing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
