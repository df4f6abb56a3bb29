"""hf_resume and finetune.py against the installed transformers (lab/hf_versions.py runs these in a
venv per supported version): a run restored at its last step trains nothing, and every Trainer
argument finetune.py passes exists in this version. No training, no model."""

from __future__ import annotations

import dataclasses
import json
import signal
from types import SimpleNamespace

import pytest

import contract

hf_resume = pytest.importorskip("hf_resume", reason="needs transformers")
finetune = pytest.importorskip("finetune", reason="needs transformers")


@pytest.fixture(autouse=True)
def signal_handlers():
    """attach() takes SIGTERM and SIGINT over: pytest's own are put back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class FakeTrainer:
    """What attach() touches of a Trainer; train() runs the callback's on_train_begin as the
    Trainer's loop does before its first step, then 'trains' (records that it did)."""

    def __init__(self, output_dir, state):
        from transformers import TrainerControl

        self.args = SimpleNamespace(output_dir=str(output_dir), save_total_limit=None)
        self.state, self.control, self.callbacks, self.trained = state, TrainerControl(), [], False

    def add_callback(self, callback):
        self.callbacks.append(callback)

    def train(self, resume_from_checkpoint=None):
        for callback in self.callbacks:
            callback.on_train_begin(self.args, self.state, self.control)
        self.trained = True
        return "trained"


@pytest.mark.parametrize("step,max_steps,trains", [(20, 20, False), (25, 20, False), (19, 20, True), (0, 20, True)])
def test_a_run_restored_at_or_past_its_last_step_returns_before_training(tmp_path, capsys, step, max_steps, trains):
    from transformers import TrainerState

    state = TrainerState(global_step=step, max_steps=max_steps)
    trainer = FakeTrainer(tmp_path, state)
    resume = hf_resume.attach(trainer)
    result = trainer.train(resume_from_checkpoint=None)
    assert trainer.trained is trains
    events = [e for e in map(contract.parse_event, capsys.readouterr().out.splitlines()) if e]
    if trains:
        assert result == "trained" and [e["event"] for e in events] == ["resumed"]
        return
    assert (result.global_step, resume.exit_code()) == (step, 0)
    assert [(e["event"], e["step"]) for e in events] == [("resumed", step), ("done", step)]
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert (progress["step"], progress["max_steps"]) == (step, max_steps)
    assert not (tmp_path / "checkpoints").exists(), "nothing saved"


@pytest.mark.parametrize("on", [True, False])
def test_the_activation_checkpointing_setting_reaches_this_transformers_under_its_own_name(on):
    from transformers import TrainingArguments

    chosen = finetune.checkpointing_argument(TrainingArguments, on)
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, **chosen)
    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    assert getattr(args, "activation_checkpointing" if "activation_checkpointing" in names
                   else "gradient_checkpointing") is on


def test_a_tokenizer_this_transformers_cannot_load_is_bad_input(tmp_path):
    from transformers import AutoTokenizer

    # What a 5.x snapshot is to 4.57 (TokenizersBackend): a tokenizer class this version lacks.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizerFromTheFuture"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(finetune.ConfigError, match=r"^the tokenizer in .* cannot be loaded by transformers [0-9.]+ \("):
        finetune.load_tokenizer(AutoTokenizer, str(tmp_path))
