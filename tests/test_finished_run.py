"""A run lost between its last checkpoint and COMPLETE: the next pod (or group of pods) restores the
last step, trains and commits nothing, writes COMPLETE and exits 0. For train.py, finetune.py and a
plain Trainer script with hf_resume's four lines, each in an Indexed Job of 2 pods, and train.py in
one pod. Each trainer finishes one short run once (module fixtures); every case then deletes
COMPLETE and starts again on what S3 holds, as a pod lost after its final checkpoint upload leaves it."""

from __future__ import annotations

import os
import subprocess

import pytest

from podlab import BUCKET, ROOT, Run, free_ports, tool_env, write_config, write_corpus

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]
local_job = pytest.importorskip("local_job")

STEPS = 10
MODEL_URI = f"s3://{BUCKET}/models/tiny-llama/"
FT_CONFIG = f"""
model: {{method: lora, dtype: float32}}
lora: {{r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear}}
data: {{block_size: 32}}
train: {{batch_size: 4, grad_accum_steps: 2, max_steps: {STEPS}, learning_rate: 1.0e-3, warmup_steps: 2, seed: 7}}
eval: {{interval: 5, max_batches: 2}}
checkpoint: {{interval: 5, keep: 2}}
log: {{interval: 1}}
"""
# A Trainer script as a user writes one, called as the pod calls any trainer; the last four lines
# are hf_resume's (README).
PLAIN_TRAINER = """
import argparse
import datasets, torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

parser = argparse.ArgumentParser()
for flag in ("--config", "--data_dir", "--output_dir", "--model_dir"):
    parser.add_argument(flag)
args, _ = parser.parse_known_args()
model = AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True)
g = torch.Generator().manual_seed(0)
blocks = torch.randint(0, model.config.vocab_size, (64, 16), generator=g).tolist()
data = datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})
targs = TrainingArguments(output_dir=args.output_dir, max_steps=%d, per_device_train_batch_size=4, save_steps=5,
                          save_total_limit=2, logging_steps=1, use_cpu=True, report_to="none", seed=3)
trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=default_data_collator)

import hf_resume
resume = hf_resume.attach(trainer)
trainer.train(resume_from_checkpoint=resume.checkpoint())
hf_resume.main_exit(resume.exit_code())
""" % STEPS

NAMES = {"train.py": "gpt", "finetune.py": "finetune", "plain trainer": "plain"}  # the run's and the Job's
TRAINERS = {
    "train.py": {},
    "finetune.py": {"TRAIN_SCRIPT": "finetune.py", "TRAIN_CONFIG": "config/ft.yaml", "S3_MODEL_URI": MODEL_URI},
    "plain trainer": {"TRAIN_SCRIPT": "plain_trainer.py", "TRAIN_CONFIG": "config/ft.yaml", "S3_MODEL_URI": MODEL_URI},
}


@pytest.fixture(scope="module")
def finished(module_s3, s3_endpoint, tmp_path_factory):
    """Code, data and a tiny Llama staged once; each trainer's run finished once (on first use)."""
    folder = tmp_path_factory.mktemp("finished")
    run = Run(module_s3, s3_endpoint, folder / "stage", train__max_steps=STEPS)
    stage = [str(ROOT / "scripts" / "stage.sh"), run.code_uri, "--data", str(write_corpus(folder / "data")),
             run.data_uri]
    if _has_transformers():
        from finetune_lab import make_jsonl, make_snapshot

        stage += ["--model", str(make_snapshot(folder / "snapshot")), MODEL_URI]
    subprocess.run(stage, check=True, capture_output=True, env=tool_env())
    module_s3.upload_file(str(write_config(folder / "tiny.yaml", **run.config)), BUCKET, "code/config/tiny.yaml")
    if _has_transformers():
        data = make_jsonl(folder / "jsonl", 300)
        for name in ("train.jsonl", "val.jsonl"):
            module_s3.upload_file(str(data / name), BUCKET, f"data/{name}")
        module_s3.put_object(Bucket=BUCKET, Key="code/config/ft.yaml", Body=FT_CONFIG.encode())
        module_s3.put_object(Bucket=BUCKET, Key="code/plain_trainer.py", Body=PLAIN_TRAINER.encode())
        # The Trainer scripts import the runtime's hf_resume (the ConfigMap's, on PYTHONPATH), as a
        # folder staged with --code does: code/'s copy is taken out.
        module_s3.delete_object(Bucket=BUCKET, Key="code/hf_resume.py")
    runs: dict[str, Run] = {}

    def get(trainer: str) -> Run:
        if trainer != "train.py" and not _has_transformers():
            pytest.skip("needs transformers, accelerate, peft")
        if trainer not in runs:
            done = Run(module_s3, s3_endpoint, folder / NAMES[trainer], name=NAMES[trainer], train__max_steps=STEPS)
            code, pod = done.run(**TRAINERS[trainer])
            assert code == 0, pod.output
            assert done.committed_steps()[0] == STEPS and done.json("COMPLETE")["steps"] == STEPS
            runs[trainer] = done
        return runs[trainer]

    return get


def _has_transformers() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) for name in ("transformers", "accelerate", "peft"))


def lose_complete(run: Run) -> dict[str, str]:
    """What a pod lost after its final checkpoint upload but before COMPLETE leaves: COMPLETE gone.
    Returns the checkpoints' keys and ETags, which no later pod may change."""
    run.s3.delete_object(Bucket=BUCKET, Key=run.prefix + "COMPLETE")
    return {k: v for k, v in run.keys().items() if k.startswith("checkpoints/")}


def assert_done_without_training(run: Run, outputs: list[str], before: dict[str, str]) -> None:
    assert run.json("COMPLETE")["steps"] == STEPS
    assert {k: v for k, v in run.keys().items() if k.startswith("checkpoints/")} == before, "nothing committed"
    trained = [line for out in outputs for line in out.splitlines() if '"event": "step"' in line]
    assert not trained, trained


def test_a_pod_that_restores_the_last_step_completes_without_training(finished):
    # One pod of train.py: the pod's own path (node 0 alone restores, the uploader writes COMPLETE
    # from the trainer's progress.json). finetune.py and a plain Trainer script take the same path
    # in the group cases below, whose node 0 is such a pod; their trainers' "nothing to train" with
    # one process is test_finetune.py's test_a_restart_from_the_last_step_or_past_it_trains_nothing.
    run = finished("train.py")
    before = lose_complete(run)
    code, pod = run.run()
    assert code == 0, pod.output
    assert [e["step"] for e in pod.events if e["event"] == "restore"] == [STEPS]
    assert [e["step"] for e in pod.events if e["event"] == "done"] == [STEPS], pod.output
    assert_done_without_training(run, [pod.output], before)


def render_indexed(run: Run, name: str) -> str:
    manifest = run.render_indexed(2, name)
    manifest.write_text(manifest.read_text().replace(":29400", f":{free_ports(2)}"))
    return manifest


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_a_group_that_restores_the_last_step_completes_without_training(finished, trainer):
    run = finished(trainer)
    before = lose_complete(run)
    job = run.start_indexed(render_indexed(run, NAMES[trainer]), **TRAINERS[trainer])
    try:
        state, reason = job.wait(timeout=300)
    finally:
        job.stop(grace=10)
    outputs = [job.output(0), job.output(1)]
    assert (state, reason) == ("Complete", "CompletionsReached"), (job.history, outputs[0][-3000:], outputs[1][-3000:])
    assert_done_without_training(run, outputs, before)
