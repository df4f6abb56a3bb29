"""Exit 0 when this Python already satisfies every requirement in the given files, else 1 and a
list of what is missing; 64 for a file that is not a requirements file.

    python3 requirements_met.py [--constraints job/constraints.txt] code/requirements.txt job/requirements.txt
    python3 requirements_met.py --outside job/constraints.txt   "RANGE VERSION" for each one the Python breaks
    python3 requirements_met.py --runtime    "Python 3.x.y, torch 2.z"; exit 64 and one line for a torch before 2.6

A constraint (pip's -c) asks for nothing: it is unmet only when its package is installed outside its
range. A requirement that pins a version outside a constraint's range is bad input (exit 64).

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


def unmet(paths: list[str], constraints: list[Requirement] = ()) -> list[str]:
    missing = []
    for path in paths:
        for line, requirement in read(path):
            if requirement is None:
                missing.append(f"{line} (a pip option: pip decides)")
                continue
            conflict = pinned_outside(requirement, constraints, path)
            if conflict:
                raise ValueError(conflict)
            problem = check(requirement)
            if problem:
                missing.append(problem)
    return missing + [f"{c.name} {have} (outside {c}, {SUPPORTED})" for c, have in outside(constraints)]


SUPPORTED = "the range the Hugging Face trainers are tested with"


def read(path: str) -> list[tuple[str, Requirement | None]]:
    """Each requirement line and its parse (None for a pip option such as -r or --index-url)."""
    lines = []
    with open(path) as file:
        for number, raw in enumerate(file, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("-"):
                lines.append((line, None))
                continue
            try:
                lines.append((line, Requirement(line)))
            except InvalidRequirement as err:
                raise ValueError(f"{path} line {number}: {err}; fix the requirement") from None
    return lines


def read_constraints(path: str) -> list[Requirement]:
    constraints = [requirement for _, requirement in read(path)]
    if None in constraints:
        raise ValueError(f"{path} holds a pip option; a constraints file names packages and ranges only")
    return constraints


def outside(constraints: list[Requirement]) -> list[tuple[Requirement, str]]:
    """The constraints whose package is installed at a version outside the range, with that version."""
    found = []
    for constraint in constraints:
        try:
            version = metadata.version(constraint.name)
        except metadata.PackageNotFoundError:
            continue
        if not constraint.specifier.contains(version, prereleases=True):
            found.append((constraint, version))
    return found


def pinned_outside(requirement: Requirement, constraints: list[Requirement], path: str) -> str | None:
    """The one line for a requirement that pins (==) a version outside a constraint's range."""
    pins = [s.version for s in requirement.specifier if s.operator in ("==", "===") and "*" not in s.version]
    for constraint in constraints:
        if _canonical(constraint.name) != _canonical(requirement.name):
            continue
        for pin in pins:
            if not constraint.specifier.contains(pin, prereleases=True):
                return (f"{path} asks for {requirement}, outside {constraint} ({SUPPORTED}); "
                        f"ask for a version in that range")
    return None


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


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
        if len(paths) == 2 and paths[0] == "--outside":
            print("".join(f"{c} {have}\n" for c, have in outside(read_constraints(paths[1]))), end="")
            return 0
        constraints = []
        if paths[:1] == ["--constraints"] and len(paths) >= 2:
            constraints, paths = read_constraints(paths[1]), paths[2:]
        missing = unmet(paths, constraints)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 64
    if missing:
        print("missing: " + ", ".join(missing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
