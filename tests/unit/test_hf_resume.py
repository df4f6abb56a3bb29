"""hf_resume and finetune.py against the installed transformers (lab/hf_versions.py runs these in a
venv per supported version): a run restored at its last step trains nothing, and every Trainer
argument finetune.py passes exists in this version, and a Trainer under FSDP resumes through this
accelerate's DCP load with safe_dcp's reader. No training; the only model is one nn.Linear."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
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


# -- a Trainer under FSDP resumes through accelerate's DCP load: with safe_dcp's reader ---------------

class _Runs:
    """A pickle that would create `marker` when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def accelerate_fsdp_parts():
    """accelerate's own plugin (FSDP2, sharded state dicts, as finetune.fsdp_arguments asks) and
    Accelerator; on this CPU the model stays whole, and DCP's files are the same kind."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"), Accelerator(cpu=True)


def trained_pair():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def fsdp_checkpoint(tmp_path):
    """A checkpoint folder as accelerate saves a Trainer's under FSDP: pytorch_model_fsdp_0/ and
    optimizer_0/, each a DCP folder."""
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    plugin, accelerator = accelerate_fsdp_parts()
    model, optimizer = trained_pair()
    save_fsdp_model(plugin, accelerator, model, str(tmp_path))
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(tmp_path))
    return tmp_path, model, optimizer


def fsdp_load(folder):
    """What a Trainer under FSDP calls when it resumes: accelerate's loads of the model and the
    optimizer (which make their readers as dcp.FileSystemReader), inside hf_resume's train()."""
    import torch
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer

    plugin, accelerator = accelerate_fsdp_parts()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    trainer = FakeTrainer(folder / "out", None)
    trainer.train = lambda resume_from_checkpoint=None: (
        load_fsdp_model(plugin, accelerator, model, resume_from_checkpoint),
        load_fsdp_optimizer(plugin, accelerator, optimizer, model, resume_from_checkpoint))
    hf_resume.attach(trainer)
    trainer.train(resume_from_checkpoint=str(folder))
    return model, optimizer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_trainers_fsdp_checkpoint_resumes_through_accelerate_with_the_safe_reader(fsdp_checkpoint):
    import torch
    import torch.distributed.checkpoint as dcp

    import safe_dcp

    folder, saved_model, saved_optimizer = fsdp_checkpoint
    original = dcp.FileSystemReader
    made = []

    class Counted(safe_dcp.SafeReader):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    safe_dcp.SafeReader, kept = Counted, safe_dcp.SafeReader
    try:
        model, optimizer = fsdp_load(folder)
    finally:
        safe_dcp.SafeReader = kept
    assert len(made) == 2, "accelerate read the model and the optimizer through SafeReader"
    assert dcp.FileSystemReader is original, "put back after train()"
    assert torch.equal(model.weight, saved_model.weight) and torch.equal(model.bias, saved_model.bias)
    state, saved = optimizer.state_dict(), saved_optimizer.state_dict()
    assert state["param_groups"][0]["lr"] == 0.1  # a value that is not a tensor, read as plain data
    if state["state"]:  # accelerate 1.10 fills only the moments a fresh optimizer has: none
        assert torch.equal(state["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])


@pytest.mark.parametrize("part", ["metadata", "value"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_crafted_pickle_in_a_trainers_fsdp_checkpoint_is_refused_and_runs_nothing(fsdp_checkpoint, part):
    import torch
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    folder, _, _ = fsdp_checkpoint
    marker = folder / "ran"
    optimizer_folder = folder / "optimizer_0"
    if part == "metadata":  # DCP's index itself
        (folder / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(_Runs(marker)))
        refused = "posix.system is not part of DCP's metadata"
    else:  # a value that is not a tensor (an optimizer setting), which DCP unpickles in full
        torch.save(_Runs(marker), optimizer_folder / "x.distcp")
        metadata = pickle.loads((optimizer_folder / ".metadata").read_bytes())
        key = next(key for key, value in metadata.state_dict_metadata.items()
                   if isinstance(value, dcp_metadata.BytesStorageMetadata))
        metadata.storage_data[dcp_metadata.MetadataIndex(key)] = _StorageInfo(
            "x.distcp", 0, (optimizer_folder / "x.distcp").stat().st_size)
        (optimizer_folder / ".metadata").write_bytes(pickle.dumps(metadata))
        refused = f"'{key}' is not plain data: .*GLOBAL posix.system"
    with pytest.raises(BaseException, match=refused):  # DCP's CheckpointException is a BaseException
        fsdp_load(folder)
    assert not marker.exists()
