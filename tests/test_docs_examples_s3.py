"""The docs' examples that need S3 run as written, against a local S3 (moto over HTTP, the real AWS
CLI): the blocks marked `<!-- example: full-suite -->` in README.md and docs/*.md.

Each doc's blocks run in document order in a scratch copy of the repository of their own, with
.venv/bin first on PATH and what the docs name: corpus.txt, data/ (prepare_data.py's bytes),
my_dataset/ (a saved dataset), gpt2-tokenizer/ and llama-1b/ (a tiny Llama snapshot with its
tokenizer, built here), ft-data/ (JSONL), the bucket my-bucket, and a finished run at
s3://my-bucket/gpt/runs/my-run/ made the way a pod makes one (train.py, lease.py, uploader.py final).
The other blocks run in tests/unit/test_docs_examples.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune_lab import make_jsonl, make_snapshot
from markdown_docs import DOCS, ROOT, Block, code_blocks
from podlab import local_s3

BUCKET = "my-bucket"
RUN = f"s3://{BUCKET}/gpt/runs/my-run/"
BLOCKS = [b for path in DOCS for b in code_blocks(path) if b.lang == "bash" and b.tag == "full-suite"]


@pytest.fixture(scope="module")
def endpoint():
    with local_s3(buckets=(BUCKET,), set_environ=False) as url:
        yield url


def block_env(endpoint: str, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env.update(PATH=f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", HOME=str(home),
               AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=endpoint, OMP_NUM_THREADS="1")
    return env


def run(command: list[str], cwd: Path, env: dict) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)}: exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def template(tmp_path_factory, endpoint) -> Path:
    """The repository as a clone would be, with every fixture the docs name."""
    import datasets

    root = tmp_path_factory.mktemp("docs-s3") / "repo"
    shutil.copytree(ROOT, root, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", "demo", "out", ".device"))
    (root / ".venv").symlink_to(ROOT / ".venv")
    (root / "home").mkdir()
    env = block_env(endpoint, root / "home")
    (root / "corpus.txt").write_text(Path(ROOT / "README.md").read_text() * 30)
    run([sys.executable, "scripts/prepare_data.py", "--input", "corpus.txt", "--out", "data/"], root, env)
    make_snapshot(root / "llama-1b")
    shutil.copytree(root / "llama-1b", root / "gpt2-tokenizer")
    make_jsonl(root / "ft-data", 60)
    texts = [line for line in (root / "corpus.txt").read_text().splitlines() if line.strip()][:400]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "my_dataset"))
    finished_run(root, env)
    return root


def finished_run(root: Path, env: dict) -> None:
    """A run in S3 as a pod leaves it: trained, its lease taken, its final upload done (COMPLETE),
    the trainer's output (its EVENT lines too) in the pod's log."""
    state, out = root.parent / "pod-state", root.parent / "pod-out"
    state.mkdir()
    pod = {**env, "STATE_DIR": str(state), "LOG_FILE": str(state / "pod.log"), "HOSTNAME": "my-run-x"}
    trained = run([sys.executable, "code/train.py", "--config", "config/smoke.yaml", "--data_dir", "data/",
                   "--output_dir", str(out), "--set", "train.max_steps=10", "--set", "checkpoint.interval=5",
                   "--set", "eval.interval=5", "--set", "eval.steps=2", "--set", "log.interval=5",
                   "--set", "checkpoint.async_save=false"], root, pod)
    (state / "pod.log").write_text("2026-01-01T00:00:00Z script: pod my-run-x starting\n" + trained)
    run([sys.executable, "job/lease.py", "acquire", RUN, str(state / "lease.json")], root, pod)
    run([sys.executable, "job/uploader.py", "final", RUN, str(out), "0"], root, pod)


@pytest.fixture(scope="module")
def worlds(template):
    """One scratch copy per doc, made when its first block runs."""
    made: dict[Path, Path] = {}

    def world_for(doc: Path) -> Path:
        if doc not in made:
            made[doc] = template.parent / f"world-{len(made)}"
            shutil.copytree(template, made[doc], symlinks=True)
        return made[doc]
    return world_for


def test_the_docs_have_s3_examples():
    assert {b.path.name for b in BLOCKS} >= {"README.md", "watching.md", "cluster.md"}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_s3_example_runs_as_written(block: Block, worlds, endpoint):
    world = worlds(block.path)
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=world,
                            env=block_env(endpoint, world / "home"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (f"{block.where}: the example exits {result.returncode}\n$ {block.text}"
                                    f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
