"""Fine-tuning settings (every error names the key and the fix; the shipped finetune.yaml loads) and
hf_resume's file moves: a Trainer save becomes a committed step folder by rename (no copy), a step
saved twice keeps its first commit, torn Trainer folders are never resumed from. Pure: no training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import checkpoint
import config
import finetune
from podlab import ROOT

SETTINGS_ERRORS = [
    ("unknown key", "train:\n  max_step: 5\n", "unknown setting train.max_step; did you mean train.max_steps?"),
    ("unknown group", "loraa:\n  r: 4\n", "unknown setting loraa; did you mean lora?"),
    ("wrong type int", "lora:\n  r: many\n", "lora.r must be an integer, got 'many'"),
    ("wrong type float", "train:\n  learning_rate: fast\n", "train.learning_rate must be a number"),
    ("wrong type bool", "model:\n  gradient_checkpointing: maybe\n", "model.gradient_checkpointing must be true or false"),
    ("wrong type str", "lora:\n  target_modules: 3\n", "lora.target_modules must be a string"),
    ("group not a mapping", "data: 3\n", "data: expected a mapping"),
    ("method", "model:\n  method: qlora\n", "model.method must be lora or full"),
    ("dtype", "model:\n  dtype: fp8\n", "model.dtype must be bfloat16 or float32"),
    ("scheduler", "train:\n  lr_scheduler: step\n", "train.lr_scheduler must be one of cosine, linear"),
    ("parallelism", "train:\n  parallelism: deepspeed\n", "train.parallelism must be one of ddp, fsdp, got 'deepspeed'"),
    ("lora dropout", "lora:\n  dropout: 1.0\n", "lora.dropout must be in [0, 1)"),
    ("no target modules", "lora:\n  target_modules: ' , '\n", "lora.target_modules must name modules"),
    ("block size", "data:\n  block_size: 1\n", "data.block_size must be at least 2"),
    ("keep zero", "checkpoint:\n  keep: 0\n", "checkpoint.keep must be at least 1"),
    ("negative eval", "eval:\n  interval: -1\n", "eval.interval must be 0 (off) or more"),
    ("yaml syntax", "train:\n  max_steps: [1\n", "YAML syntax error at line"),
]


@pytest.mark.parametrize("case,text,message", SETTINGS_ERRORS, ids=[c[0] for c in SETTINGS_ERRORS])
def test_settings_error_names_the_key_and_the_fix(tmp_path, case, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as err:
        finetune.load_settings(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_shipped_finetune_config_loads_and_overrides_apply():
    settings = finetune.load_settings(ROOT / "config" / "finetune.yaml", ["model.method=full", "train.max_steps=7"])
    assert settings.model.method == "full" and settings.train.max_steps == 7
    assert settings.lora.modules() == "all-linear"
    settings.check_world_size(4)
    with pytest.raises(config.ConfigError, match="must be divisible by the number of processes"):
        settings.check_world_size(3)


def test_lora_target_modules_split_on_commas():
    assert finetune.LoraSettings(target_modules="q_proj, v_proj").modules() == ["q_proj", "v_proj"]


# -- hf_resume's moves --------------------------------------------------------------------------------

hf_resume = pytest.importorskip("hf_resume", reason="needs transformers")


def trainer_save(output_dir: Path, step: int, files: dict[str, bytes]) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_a_trainer_save_is_committed_by_rename_not_copy(tmp_path):
    source = trainer_save(tmp_path, 10, {"model.safetensors": b"w" * 1000, "optimizer.pt": b"o" * 500,
                                         "trainer_state.json": b"{}"})
    inodes = {p.name: p.stat().st_ino for p in source.iterdir()}
    final = hf_resume.commit_trainer_save(source, tmp_path / "checkpoints", 10, {"step": 10, "keep": 3})
    assert final == tmp_path / "checkpoints" / "step-00000010"
    assert checkpoint.verify(final) is None
    assert {p.name: p.stat().st_ino for p in final.iterdir() if p.name != "manifest.json"} == inodes
    assert not source.exists()
    assert checkpoint.read_manifest(final)["meta"] == {"step": 10, "keep": 3}


@pytest.mark.parametrize("durable", [True, False])
def test_the_save_after_sigterm_is_committed_without_fsync_and_its_manifest_still_comes_last(tmp_path, fsynced,
                                                                                             durable):
    source = trainer_save(tmp_path, 10, {"model.safetensors": b"w" * 1000, "optimizer.pt": b"o" * 500})
    final = hf_resume.commit_trainer_save(source, tmp_path / "checkpoints", 10, {}, durable=durable)
    files = sorted(name for name in fsynced if name in ("model.safetensors", "optimizer.pt"))
    assert files == (["model.safetensors", "optimizer.pt"] if durable else [])
    assert fsynced.index("manifest.json") > max(map(fsynced.index, files), default=-1), "the manifest after"
    assert checkpoint.verify(final) is None


def test_the_same_step_saved_twice_keeps_its_first_commit(tmp_path):
    import torch

    first = hf_resume.commit_trainer_save(trainer_save(tmp_path, 5, {"optimizer.pt": b"first"}),
                                          tmp_path / "checkpoints", 5, {})
    # The Trainer saves step 5 again where it saved it before; torch.save truncates an existing file
    # in place, which would rewrite a committed file sharing its inode (a hard link).
    again = tmp_path / "checkpoint-5"
    again.mkdir(exist_ok=True)
    torch.save({"second": True}, again / "optimizer.pt")
    assert hf_resume.commit_trainer_save(again, tmp_path / "checkpoints", 5, {}) == first
    assert (first / "optimizer.pt").read_bytes() == b"first"
    assert checkpoint.verify(first) is None
    assert not again.exists()


def test_an_fsdp_save_commits_its_folders_files_flat_and_resumes_as_the_trainer_saved_it(tmp_path):
    shards = {"__0_0.distcp": b"rank 0", "__1_0.distcp": b"rank 1", ".metadata": b"index"}
    source = trainer_save(tmp_path, 3, {"rng_state_0.pth": b"r0", "rng_state_1.pth": b"r1", "trainer_state.json": b"{}"})
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        (source / folder).mkdir()
        for name, data in shards.items():
            (source / folder / name).write_bytes(folder.encode() + data)
    final = hf_resume.commit_trainer_save(source, tmp_path / "checkpoints", 3, {"step": 3})
    manifest = checkpoint.read_manifest(final)
    assert "pytorch_model_fsdp_0~__1_0.distcp" in manifest["files"] and checkpoint.verify(final) is None
    assert manifest["meta"]["nested"]["optimizer_0~.metadata"] == "optimizer_0/.metadata"
    view = hf_resume.trainer_view(final)
    assert view.name.startswith(".staging-resume-step-00000003-")
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        for name, data in shards.items():
            assert (view / folder / name).read_bytes() == folder.encode() + data
            assert (view / folder / name).stat().st_ino == (final / f"{folder}~{name}").stat().st_ino, "a link"
    assert (view / "rng_state_1.pth").read_bytes() == b"r1"
    checkpoint.remove_staging_leftovers(tmp_path / "checkpoints")
    assert not view.exists() and checkpoint.verify(final) is None, "the next start drops the view, not the step"


def test_a_save_with_folders_in_folders_is_refused_and_leaves_nothing_committed(tmp_path):
    source = trainer_save(tmp_path, 3, {"a.bin": b"a"})
    (source / "pytorch_model_fsdp_0" / "deeper").mkdir(parents=True)
    with pytest.raises(hf_resume.CheckpointLayoutError, match="holds a folder"):
        hf_resume.commit_trainer_save(source, tmp_path / "checkpoints", 3, {})
    assert checkpoint.committed_steps(tmp_path / "checkpoints") == []


def test_a_view_is_built_only_from_folder_slash_name_maps(tmp_path):
    source = trainer_save(tmp_path, 3, {"a.bin": b"a"})
    (source / "model").mkdir()
    (source / "model" / "x").write_bytes(b"x")
    final = hf_resume.commit_trainer_save(source, tmp_path / "checkpoints", 3, {})
    manifest = checkpoint.read_manifest(final)
    manifest["meta"]["nested"]["model~x"] = "../../escaped"
    (final / "manifest.json").write_text(__import__("json").dumps(manifest))
    with pytest.raises(hf_resume.CheckpointLayoutError, match="not FOLDER/NAME"):
        hf_resume.trainer_view(final)
    assert not (tmp_path / "escaped").exists()


def rotate_trainer_checkpoints(output_dir: Path) -> None:
    """What the Trainer does with save_total_limit=1 after a save, in this transformers."""
    try:
        from transformers.trainer_utils import rotate_checkpoints  # 5.17 and later
    except ImportError:  # a Trainer method before
        import functools
        from types import SimpleNamespace

        from transformers import Trainer

        trainer = SimpleNamespace(args=SimpleNamespace(save_total_limit=1, output_dir=str(output_dir)),
                                  state=SimpleNamespace(best_model_checkpoint=None))
        trainer._sorted_checkpoints = functools.partial(Trainer._sorted_checkpoints, trainer)
        Trainer._rotate_checkpoints(trainer, use_mtime=True, output_dir=str(output_dir))
        return
    rotate_checkpoints(output_dir=str(output_dir), save_total_limit=1, best_model_checkpoint=None, use_mtime=True)


def test_the_trainers_rotation_finds_nothing_of_ours_to_delete(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        hf_resume.commit_trainer_save(trainer_save(tmp_path, step, {"m": bytes([step])}), root, step, {})
    rotate_trainer_checkpoints(tmp_path)
    assert [s for s, _ in checkpoint.committed_steps(root)] == [15, 10, 5]


def test_resume_skips_torn_trainer_folders_staging_and_uncommitted_steps(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    hf_resume.commit_trainer_save(trainer_save(tmp_path, 5, {"m": b"5"}), root, 5, {})
    torn = trainer_save(tmp_path, 10, {"model.safetensors": b"half"})  # killed mid-save
    uncommitted = root / "step-00000015"
    uncommitted.mkdir()
    (uncommitted / "m").write_bytes(b"15")
    staging = root / ".staging-step-00000020-abcd1234"
    staging.mkdir()
    assert hf_resume.newest_committed(tmp_path) == root / "step-00000005"
    assert not torn.exists() and not staging.exists()
    assert "checkpoint-10 is a Trainer save that never committed" in capsys.readouterr().out


def test_exit_code_follows_the_signal_all_processes_stopped_for():
    callback = hf_resume.CommitCallback(Path(os.devnull).parent / "unused")
    resume = hf_resume.Resume(trainer=None, callback=callback)
    assert resume.exit_code() == 0
    callback.stopped_by = 15
    assert resume.exit_code() == 143
    callback.stopped_by = 2
    assert resume.exit_code() == 130


def test_only_the_trainers_own_numbered_folders_count_as_torn(tmp_path):
    (tmp_path / "checkpoint-notes").mkdir()
    trainer_save(tmp_path, 7, {"m": b"7"})
    assert hf_resume.newest_committed(tmp_path) is None
    assert (tmp_path / "checkpoint-notes").is_dir() and not (tmp_path / "checkpoint-7").exists()


@pytest.mark.parametrize("step,saves", [(19, False), (20, True)])
def test_the_last_step_is_always_saved_whatever_the_save_strategy(step, saves):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    callback = hf_resume.CommitCallback(Path(os.devnull).parent / "unused")
    state = TrainerState(global_step=step, max_steps=20)
    args = TrainingArguments(output_dir="unused", save_strategy="no", report_to=[])
    control = callback.on_step_end(args, state, TrainerControl())
    assert control.should_save is saves


def test_resume_checks_the_folder_the_pods_restore_hashed_by_size_only(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for step in (5, 10):
        hf_resume.commit_trainer_save(trainer_save(tmp_path, step, {"m": bytes([step])}), root, step, {})
    newest = root / "step-00000010"
    (newest / "m").write_bytes(b"X")  # same size, other bytes
    record = tmp_path / "restore-verified.json"
    checkpoint.note_verified(record, newest)
    monkeypatch.setenv("RESTORE_VERIFIED_FILE", str(record))
    assert hf_resume.newest_committed(tmp_path) == newest
    monkeypatch.delenv("RESTORE_VERIFIED_FILE")
    assert hf_resume.newest_committed(tmp_path) == root / "step-00000005", "hashed in full: the damage seen"


@pytest.mark.parametrize("parallelism,cuda,problem", [
    ("ddp", False, None), ("fsdp", True, None),
    ("fsdp", False, "train.parallelism: fsdp needs GPUs (accelerate shards a Trainer's model only across GPUs; on "
                    "CPU it would train with DDP instead); set train.parallelism: ddp"),
])
def test_a_trainer_is_sharded_only_on_gpus_and_says_so_on_a_cpu(parallelism, cuda, problem):
    assert finetune.parallelism_problem(parallelism, cuda) == problem
    arguments = finetune.fsdp_arguments(parallelism)
    assert (arguments["fsdp_config"]["state_dict_type"] == "SHARDED_STATE_DICT") if parallelism == "fsdp" \
        else arguments == {}

