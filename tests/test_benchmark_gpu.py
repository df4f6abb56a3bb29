"""`lab/benchmark.py gpu --cpu --json F`, the command a GPU session runs (through lab/gpu_check.sh),
works here on a tiny model: every GPU key is written, the parts a CPU can run measure (real train.py,
torchrun, finetune.py with transformers and peft, no network), the rest say why not, and a part that
fails leaves its keys null with the reason while the parts after it still run. No speed is judged:
on a CPU the figures mean nothing, and the machine is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench_gpu import PART_KEYS
from bench_report import GPU_KEYS
from podlab import ROOT

pytestmark = pytest.mark.slow

BENCHMARK = [sys.executable, str(ROOT / "lab" / "benchmark.py"), "gpu", "--cpu"]
TOKENS_KEYS = ("gpu_trainer_tokens_per_s", "gpu_bare_tokens_per_s", "gpu_bare_best_tokens_per_s",
               "gpu_trainer_auto_tokens_per_s", "gpu_checkpoint_stall", "gpu_checkpoint_stall_sync",
               "gpu_candidate_loss_chunk")
GPU_ONLY = ("gpu_finetune_full_resume", "gpu_finetune_fsdp_resume", "gpu_trainer_mfu", "gpu_trainer_auto_mfu", "gpu_micro_batch_peak_bytes",
            "gpu_candidate_attention_flash", "gpu_candidate_attention_cudnn",
            "gpu_candidate_max_autotune", "gpu_candidate_fsdp",
            "gpu_candidate_fsdp_micro_batch_48")


def check_every_key(figures: dict) -> dict:
    assert set(GPU_KEYS) <= set(figures) and figures["mode"] == "cpu"
    return figures


def test_gpu_check_dry_path_runs_every_part_and_measures_what_a_cpu_can(tmp_path):
    # lab/gpu_check.sh, as the device tool runs it ($OUT set), in its CPU mode.
    out = tmp_path / "out"
    result = subprocess.run([str(ROOT / "lab" / "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OUT": str(out)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = check_every_key(json.loads((out / "gpu.json").read_text()))
    for key in TOKENS_KEYS:
        assert (figures[key]["value"] or 0) > 0, (key, figures[key]["how"])
    for key in GPU_ONLY:
        assert figures[key]["value"] is None and ("CPU mode" in figures[key]["how"] or "GPU only" in
                                                  figures[key]["how"]), (key, figures[key]["how"])
    sigterm = figures["gpu_sigterm_to_exit_s"]
    assert sigterm["value"] > 0 and sigterm["floor"] > 0, sigterm["how"]
    # SIGTERM comes at the 4th step's event; the step in flight by then is the one committed
    assert sigterm["detail"]["stopped_at"] == sigterm["detail"]["resumed_at"] >= 4, sigterm["detail"]
    finetune = figures["gpu_finetune_lora_resume"]
    assert finetune["value"] == finetune["floor"] and finetune["value"] is not None, finetune["how"]
    assert finetune["detail"]["final"] == 6 and finetune["detail"]["exit_codes"] == [143, 0], finetune
    fsdp = figures["gpu_fsdp_train_resume"]  # train.py's sharded checkpoint, stopped and resumed
    assert fsdp["value"] == fsdp["floor"] and fsdp["value"] is not None, fsdp["how"]
    assert all(seconds is not None for seconds in fsdp["detail"]["saves"]), "each stop saved a step"
    probe = figures["gpu_micro_batch"]
    assert probe["detail"]["tried"][-1] > probe["value"] > probe["floor"], "the probe backed off from its last try"
    stall = figures["gpu_checkpoint_stall"]["detail"]
    assert stall["bytes"] > 0 and len(stall["save_s"]) == 2, stall
    assert figures["gpu_last_save_wait_s"]["value"] >= 0
    assert "torch 2." in (out / "machine.txt").read_text()
    assert '"event": "stopped"' in (out / "runs.log").read_text(), "the trainers' output comes back"
    assert "gpu_sigterm_to_exit_s" in (out / "gpu.log").read_text()
    assert not (out / ".work").exists(), "the runs' checkpoints are not left for the tool to send back"


def test_a_failed_part_leaves_its_reason_and_the_next_part_still_runs(tmp_path):
    # the stall part is measured over the trainer part's run: alone, it fails
    out = tmp_path / "gpu.json"
    result = subprocess.run(BENCHMARK + ["--json", str(out), "--only", "stall", "--only", "bare"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = check_every_key(json.loads(out.read_text()))
    for key in PART_KEYS["stall"]:
        assert figures[key]["value"] is None and figures[key]["how"].startswith("stall failed: RuntimeError: needs "
                                                                                "the trainer part's run"), key
    assert figures["gpu_bare_tokens_per_s"]["value"] > 0
    assert "not run" in figures["gpu_sigterm_to_exit_s"]["how"]


def test_an_unknown_part_is_bad_input():
    result = subprocess.run(BENCHMARK + ["--only", "trainr"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 64
    assert "unknown part trainr" in result.stderr and "trainer" in result.stderr
