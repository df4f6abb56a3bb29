"""The trainers' events (job/contract.py): what a tool reads instead of the trainer's prose. Each
event line parses with contract.parse_event and carries the fields the contract names; the pieces
that print them run alone here (train.py's Meter, hf_resume's callback), with no training."""

from __future__ import annotations

import math
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import checkpoint
import config
import contract
import train

ROOT = Path(__file__).resolve().parents[2]


def events_in(text: str) -> list[dict]:
    return [e for e in map(contract.parse_event, text.splitlines()) if e is not None]


TRAINER_EVENTS = {"resumed": "step, name, seconds", "step": "step, max_steps, loss, ms_per_step, tokens_per_s",
                  "checkpoint": "step, name, state", "stopped": "signal", "done": "step"}


@pytest.mark.parametrize("kind,fields", TRAINER_EVENTS.items())
def test_the_trainer_events_are_in_the_contract_and_its_table(kind, fields):
    assert kind in contract.EVENTS
    rows = [line[len("#   "):] for line in open(contract.__file__) if line.startswith(f"#   {kind} ")]
    assert len(rows) == 1 and rows[0][len(kind):].strip().startswith(fields), rows


@pytest.mark.parametrize("name", ["checkpoint.py", "contract.py", "trainer_kit.py", "safe_dcp.py", "hf_resume.py"])
def test_code_links_the_runtime_modules_it_imports(name):
    # code/ runs alone (torchrun on code/train.py; a user's code synced from S3 without job/):
    # the link is what `aws s3 sync` and stage.sh follow, so the file itself travels with code/.
    link = ROOT / "code" / name
    assert link.is_symlink() and link.resolve() == (ROOT / "job" / name).resolve()


class Writer:
    """TensorBoard's SummaryWriter as far as Meter uses it."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step))


def meter_for(rank: int = 0, peak_tflops: float = 0.0, log_interval: int = 2, max_steps: int = 5):
    cfg = config.Config()
    cfg.train.max_steps = max_steps
    cfg.log.interval = log_interval
    cfg.system.peak_tflops = peak_tflops
    trainer = SimpleNamespace(cfg=cfg, rt=train.Runtime(rank, rank, 1, torch.device("cpu")), step=0,
                              raw_model=SimpleNamespace(flops_per_token=lambda: 1e6),
                              optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]),
                              writer=Writer(), speed={}, train_loss=None)
    return train.Meter(trainer, 0), trainer


def run_steps(meter, trainer, losses) -> None:
    for loss in losses:
        trainer.step += 1
        meter.after_step(torch.tensor(loss))


def test_a_step_event_at_each_log_line_and_the_last_step(capsys):
    meter, trainer = meter_for(log_interval=2, max_steps=5)
    run_steps(meter, trainer, [3.0, 2.5, 2.0, 1.5, 1.25])
    steps = [e for e in events_in(capsys.readouterr().out) if e["event"] == "step"]
    assert [e["step"] for e in steps] == [2, 4, 5]
    last = steps[-1]
    assert last["source"] == "train" and last["max_steps"] == 5 and last["loss"] == 1.25
    assert last["ms_per_step"] > 0 and last["tokens_per_s"] > 0 and "mfu" not in last
    assert last["tokens_per_s"] == pytest.approx(trainer.cfg.tokens_per_step * 1000 / last["ms_per_step"], rel=1e-3)


def test_a_step_event_carries_mfu_when_the_peak_is_known(capsys):
    meter, trainer = meter_for(peak_tflops=1.0, log_interval=1, max_steps=1)
    run_steps(meter, trainer, [2.0])
    (step,) = [e for e in events_in(capsys.readouterr().out) if e["event"] == "step"]
    assert 0 < step["mfu"] == pytest.approx(1e6 * step["tokens_per_s"] / 1e12)


def test_a_loss_that_is_not_finite_is_null_not_invalid_json(capsys):
    meter, trainer = meter_for(log_interval=1, max_steps=1)
    run_steps(meter, trainer, [math.nan])
    out = capsys.readouterr().out
    (step,) = [e for e in events_in(out) if e["event"] == "step"]
    assert step["loss"] is None and "NaN" not in out


def test_only_global_rank_0_prints_step_events(capsys):
    meter, trainer = meter_for(rank=1, log_interval=1, max_steps=2)
    run_steps(meter, trainer, [3.0, 2.0])
    assert events_in(capsys.readouterr().out) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_the_meter_returns_what_it_measured_and_writes_nothing_into_the_trainer(rank):
    meter, trainer = meter_for(rank=rank, log_interval=2, max_steps=5)
    measured = []
    for loss in (3.0, 2.5):
        trainer.step += 1
        measured.append(meter.after_step(torch.tensor(loss)))
    assert measured[0] is None, "not a logging step"
    loss, speed = measured[1]
    assert loss == 2.5
    assert (speed is None) if rank else (speed["ms_per_step"] > 0 and speed["eta_seconds"] > 0)
    assert trainer.train_loss is None and trainer.speed == {}


def test_a_committed_save_becomes_one_checkpoint_event(capsys):
    # What the trainer reports for a commit, sync or async: the request, the commit, the block.
    train.report_checkpoint(Path("/x/step-00000010"), nbytes=1234, seconds=2.5, blocked_seconds=0.25)
    (record,) = events_in(capsys.readouterr().out)
    assert contract.matches(record, "checkpoint", source="train", step=10, name="step-00000010",
                            state="committed", seconds=2.5, blocked_seconds=0.25, bytes=1234)


# -- hf_resume's callback ------------------------------------------------------------------------

hf_resume = pytest.importorskip("hf_resume", reason="needs transformers")


def trainer_save(output_dir: Path, step: int) -> None:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 1000)


def hf_run(tmp_path: Path, stop_at: int | None, start: int = 0, max_steps: int = 4):
    """A Trainer's callback calls, as transformers makes them, for steps start+1..max_steps."""
    from transformers import TrainerControl, TrainerState

    callback = hf_resume.CommitCallback(tmp_path, keep=3, tokens_per_step=64)
    resume = hf_resume.Resume(SimpleNamespace(), callback)
    resume.checkpoint()
    args = SimpleNamespace(output_dir=str(tmp_path))
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = start, max_steps
    callback.on_train_begin(args, state, control)
    while state.global_step < max_steps:
        state.global_step += 1
        if state.global_step == stop_at:
            callback.stop.signum = signal.SIGTERM
        control = callback.on_step_end(args, state, control)
        callback.on_log(args, state, control, logs={"loss": 1.5, "learning_rate": 1e-4})
        if control.should_save:
            trainer_save(tmp_path, state.global_step)
            callback.on_save(args, state, control)
            control.should_save = False
        if control.should_training_stop:
            break
    callback.on_train_end(args, state, control)
    return resume


def test_hf_resume_prints_resumed_step_checkpoint_and_done(tmp_path, capsys):
    hf_run(tmp_path, stop_at=None, max_steps=3)
    events = events_in(capsys.readouterr().out)
    kinds = [e["event"] for e in events]
    assert kinds == ["resumed", "step", "step", "step", "checkpoint", "done"], kinds
    assert contract.matches(events[0], "resumed", source="train", step=0, name=None)
    assert [e["step"] for e in events[1:4]] == [1, 2, 3] and events[3]["max_steps"] == 3
    assert events[3]["loss"] == 1.5 and events[3]["tokens_per_s"] > 0 and events[3]["ms_per_step"] >= 0
    folder = tmp_path / "checkpoints" / "step-00000003"
    assert contract.matches(events[4], "checkpoint", step=3, name=folder.name, state="committed",
                            bytes=sum(p.stat().st_size for p in folder.iterdir()))  # the manifest too
    assert events[4]["blocked_seconds"] == events[4]["seconds"] >= 0
    assert contract.matches(events[5], "done", step=3)


def test_hf_resume_prints_stopped_after_the_committed_step_and_resumed_from_it(tmp_path, capsys):
    hf_run(tmp_path, stop_at=2, max_steps=4)
    events = events_in(capsys.readouterr().out)
    assert [e["event"] for e in events][-2:] == ["checkpoint", "stopped"]
    assert contract.matches(events[-1], "stopped", signal="SIGTERM", step=2)
    assert checkpoint.is_committed(tmp_path / "checkpoints" / "step-00000002")
    hf_run(tmp_path, stop_at=None, start=2, max_steps=4)
    (resumed,) = [e for e in events_in(capsys.readouterr().out) if e["event"] == "resumed"]
    assert contract.matches(resumed, "resumed", step=2, name="step-00000002") and resumed["seconds"] >= 0
