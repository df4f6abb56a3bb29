"""Exit 0 when this Python already satisfies every requirement in the given files, else 1 and a
list of what is missing; 64 for a file that is not a requirements file.

    python3 requirements_met.py code/requirements.txt job/requirements.txt

It reads installed metadata only (no pip, no network): the check costs milliseconds, so a pod
whose image has everything installs nothing.
"""

from __future__ import annotations

import sys
from importlib import metadata

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # pip vendors packaging; an image with pip has it
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement


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


def main(paths: list[str]) -> int:
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
