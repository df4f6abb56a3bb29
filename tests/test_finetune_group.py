"""finetune.py (hf_resume) on a group of pods: 2 nodes x 2 processes, under the Indexed Job and the
PyTorchJob that scripts/submit.py renders, run by lab/local_job.py. Every node restores the
committed step, rank 0 commits every rank's RNG state (node 1's included) and node 0 uploads it, a
lost node restarts the group, and the adapter in S3 is bitwise equal to 1 machine x 4 processes."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("peft", reason="LoRA needs peft")

import checkpoint  # noqa: E402
from finetune_lab import make_jsonl, make_snapshot  # noqa: E402
from helpers import CODE, VENV_BIN, run_until  # noqa: E402
from podlab import BUCKET, ROOT, Run, free_ports, tool_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]
local_job = pytest.importorskip("local_job")

STEPS = 16
CONFIG = f"""
model: {{method: lora, dtype: float32}}
lora: {{r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear}}
data: {{block_size: 32}}
train: {{batch_size: 2, grad_accum_steps: 4, max_steps: {STEPS}, learning_rate: 1.0e-3, warmup_steps: 2, seed: 7}}
eval: {{interval: 0}}
checkpoint: {{interval: 4, keep: 2}}
log: {{interval: 1}}
"""
MODEL_URI = f"s3://{BUCKET}/models/tiny/"
ENV = {"TRAIN_SCRIPT": "finetune.py", "TRAIN_CONFIG": "config/ft.yaml", "S3_MODEL_URI": MODEL_URI,
       "NPROC_PER_NODE": "2"}
ADAPTER = f"checkpoints/{checkpoint.step_dir_name(STEPS)}/adapter_model.safetensors"


@pytest.fixture(scope="module")
def staged(module_s3, s3_endpoint, tmp_path_factory):
    """Code, a tiny Llama and JSONL data in S3; the adapter 1 machine x 4 processes ends with."""
    folder = tmp_path_factory.mktemp("ft-group")
    snapshot, data = make_snapshot(folder / "model"), make_jsonl(folder / "data", 300)
    subprocess.run([str(ROOT / "scripts" / "stage.sh"), f"s3://{BUCKET}/code/", "--model", str(snapshot), MODEL_URI],
                   check=True, capture_output=True, env=tool_env())
    (folder / "ft.yaml").write_text(CONFIG)
    module_s3.upload_file(str(folder / "ft.yaml"), BUCKET, "code/config/ft.yaml")
    for name in ("train.jsonl", "val.jsonl"):
        module_s3.upload_file(str(data / name), BUCKET, f"ftdata/{name}")
    out = folder / "reference"
    code, output = run_until([str(VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node=4", str(CODE / "finetune.py"),
                              "--config", str(folder / "ft.yaml"), "--model_dir", str(snapshot), "--data_dir", str(data),
                              "--output_dir", str(out)], timeout=900)
    assert code == 0, output
    return folder, (out / ADAPTER).read_bytes()


def group_run(module_s3, s3_endpoint, folder, name: str) -> Run:
    run = Run(module_s3, s3_endpoint, folder / name, name=name)
    run.data_uri = f"s3://{BUCKET}/ftdata/"
    return run


def render(run: Run, engine: str, name: str):
    stream = subprocess.run([sys.executable, str(ROOT / "scripts" / "submit.py"), name, "--image", "local",
                             "--code", run.code_uri, "--data", run.data_uri, "--output", run.output_uri,
                             "--engine", engine, "--nodes", "2", "--gpus-per-node", "2"],
                            check=True, capture_output=True, text=True, env=tool_env()).stdout
    port = str(free_ports(2))
    rendered = stream.replace(":29400", f":{port}").replace("containerPort: 23456", f"containerPort: {port}")
    assert rendered != stream
    path = run.folder / f"{name}-{engine}.yaml"
    run.folder.mkdir(parents=True, exist_ok=True)
    path.write_text(rendered)
    return path


def assert_every_rank_committed_and_equal(run: Run, reference: bytes) -> None:
    assert run.json("COMPLETE")["steps"] == STEPS
    newest = checkpoint.step_dir_name(STEPS)
    files = run.json(f"checkpoints/{newest}/manifest.json")["files"]
    assert {f"rng_state_{rank}.pth" for rank in range(4)} <= set(files), sorted(files)  # node 1's ranks too
    assert run.verify_in_s3(newest) is None
    assert run.read(ADAPTER) == reference, "bitwise equal to 1 machine x 4 processes"


def test_indexed_job_a_lost_node_restarts_the_group_and_the_fine_tune_ends_bitwise_equal(module_s3, s3_endpoint,
                                                                                        staged):
    folder, reference = staged
    run = group_run(module_s3, s3_endpoint, folder, "ftidx")
    job = local_job.IndexedJob(render(run, "indexed", "ftidx"), env=run.env(**ENV),
                               configmaps={"script-configmap": ROOT / "job"}, folder=run.folder / "pods").start()
    try:
        job.pod(0).wait_for_event("uploaded", timeout=600)
        assert job.pod(1).lose_node()
        state, reason = job.wait(timeout=900)
    finally:
        job.stop(grace=10)
    assert state == "Complete", (reason, job.history, job.output(0)[-3000:], job.output(1)[-3000:])
    assert (0, 138, "ignored") in job.history, job.history  # the survivor: the group's code, not 1
    assert job.pod(0).wait_for_event("resumed", timeout=5)["step"] > 0, "the group went on from S3"
    assert_every_rank_committed_and_equal(run, reference)


def test_pytorchjob_a_lost_worker_restarts_the_group_and_the_fine_tune_ends_bitwise_equal(module_s3, s3_endpoint,
                                                                                         staged):
    folder, reference = staged
    run = group_run(module_s3, s3_endpoint, folder, "ftpt")
    first_ip = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.10"
    job = local_job.PyTorchJobRun(render(run, "pytorchjob", "ftpt"), env=run.env(**ENV), first_ip=first_ip,
                                  configmaps={"script-configmap": ROOT / "job"}, folder=run.folder / "pods").start()
    try:
        job.pod(0).wait_for_event("uploaded", timeout=600)
        assert job.pod(1).lose_node()
        assert local_job.wait_until(lambda: job.outcome is not None, 900), job.history
    finally:
        job.stop(grace=10)
    assert job.outcome == ("Succeeded", "PyTorchJobSucceeded"), (job.history, job.output(0)[-3000:])
    # On failure, the pods' last lines say why (a 2-failure clean-clone run under extra load, 2026-11-28).
    assert (0, 138, "restart") in job.history, (job.history, job.output(0)[-3000:], job.output(1)[-3000:])
    assert_every_rank_committed_and_equal(run, reference)
