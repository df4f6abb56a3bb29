"""Every example command in README.md and docs/*.md runs as written, or says why it cannot run here.

Each fenced `bash` block runs in document order, in one scratch copy of the repository (with
`.venv/bin` first on PATH and a small corpus.txt), under `bash -e`; it must exit 0. A block marked
`<!-- example: TAG -->` on the line before it is listed as skipped with the tag's reason; the
full-suite ones run in tests/test_docs_examples_s3.py against a local S3. Python blocks must compile
and YAML blocks must parse. Known bugs in the scripts are strict xfails below: once fixed, the test
says so, and the entry goes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from markdown_docs import DOCS, ROOT, Block, code_blocks

TAGS = {
    "cluster-only": "needs a Kubernetes cluster, or a run on one",
    "full-suite": "needs S3: runs in tests/test_docs_examples_s3.py",
    "root": "needs root (the local pod runner)",
    "network": "needs the internet",
    "long-running": "runs for minutes, or serves until stopped",
    "template": "has names in capitals to fill in",
}

# The block's text -> why it fails today, as a strict xfail: a fixed script turns its entry into a
# failure, so the list stays true. Empty: every example runs (issue 25 gave each script its --help
# and its run bit).
KNOWN_BUGS: dict[str, str] = {}

BLOCKS = [block for path in DOCS for block in code_blocks(path)]
BASH = [block for block in BLOCKS if block.lang == "bash"]
SECONDS_PER_BLOCK = 120


def case(block: Block):
    marks = []
    if block.text in KNOWN_BUGS:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[block.text]))
    return pytest.param(block, marks=marks, id=f"{block.where}:{block.tag or 'runs'}")


CORPUS = "\n\n".join(block.text for block in BLOCKS) * 20  # text enough for prepare_data's splits


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A scratch copy of the repository, as a clone would be, with the venv and a corpus.txt."""
    root = tmp_path_factory.mktemp("world") / "repo"
    shutil.copytree(ROOT, root, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", "demo", "out", ".device"))
    (root / ".venv").symlink_to(ROOT / ".venv")
    (root / "corpus.txt").write_text(CORPUS)
    (root / "home").mkdir()
    return root


def shell_env(world: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env.update(PATH=f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", HOME=str(world / "home"),
               AWS_ACCESS_KEY_ID="none", AWS_SECRET_ACCESS_KEY="none", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL="http://127.0.0.1:9")  # nothing listens there: a block that calls S3 fails
    return env


def run_block(block: Block, world: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=world, env=env,
                          capture_output=True, text=True, timeout=SECONDS_PER_BLOCK)


def test_every_marker_is_a_known_one():
    unknown = [f"{b.where}: {b.tag}" for b in BLOCKS if b.tag is not None and b.tag not in TAGS]
    assert not unknown, f"unknown example markers (known: {', '.join(TAGS)}): {unknown}"


def test_every_known_bug_names_a_block_in_the_docs():
    texts = {block.text for block in BASH}
    assert not set(KNOWN_BUGS) - texts, f"KNOWN_BUGS names blocks no doc has: {sorted(set(KNOWN_BUGS) - texts)}"


def test_the_readme_has_examples_that_run_here():
    assert any(block.path.name == "README.md" and block.tag is None for block in BASH)


@pytest.mark.parametrize("block", [case(b) for b in BASH])
def test_example_runs_as_written(block, world):
    if block.tag is not None:
        pytest.skip(f"{block.where} is marked {block.tag}: {TAGS.get(block.tag, '?')}")
    result = run_block(block, world, shell_env(world))
    assert result.returncode == 0, (f"{block.where}: the example exits {result.returncode}\n$ {block.text}"
                                    f"{result.stdout[-2000:]}{result.stderr[-2000:]}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_examples_compile(block):
    compile(block.text, block.where, "exec")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "yaml"], ids=lambda b: b.where)
def test_yaml_examples_parse(block):
    assert isinstance(yaml.safe_load(block.text), dict)


def test_a_block_that_fails_fails_the_test(world):
    """The harness itself: a failing command is seen (bash -e), and so is one failing in a pipe."""
    for text in ("true\nfalse\ntrue\n", "false | cat\n"):
        assert run_block(Block(ROOT / "README.md", 0, "bash", text, None), world, shell_env(world)).returncode != 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-rsx"]))
