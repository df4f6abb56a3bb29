"""lab/bench_gpu.py's bookkeeping without running a trainer: the JSON is handed over after each
part (a run cut short keeps what it measured), a part that fails leaves its own keys null
with the reason while the next part still runs, and a run the budget ended says so."""

from __future__ import annotations

import os
import sys

import pytest

import bench_gpu
from bench_report import GPU_KEYS


def test_each_part_hands_over_its_figures_and_a_failure_stays_with_its_part(tmp_path):
    handed = []
    # stall and candidates are measured over the trainer part's run: without it both fail at once
    figures = bench_gpu.measure(bench_gpu.CPU, tmp_path, 60, ["stall", "candidates"],
                                lambda so_far: handed.append(dict(so_far)))
    assert set(handed[0]) == set(bench_gpu.PART_KEYS["stall"]), "written after the first part, before the second"
    assert set(handed[-1]) == set(bench_gpu.PART_KEYS["stall"]) | set(bench_gpu.PART_KEYS["candidates"])
    for part in ("stall", "candidates"):
        for key in bench_gpu.PART_KEYS[part]:
            assert figures[key]["value"] is None
            assert figures[key]["how"].startswith(f"{part} failed: RuntimeError: needs the trainer part's run"), key


def test_every_part_key_is_a_gpu_key_and_every_gpu_key_has_a_part():
    keys = [key for part in bench_gpu.PARTS for key in bench_gpu.PART_KEYS[part]]
    assert sorted(keys) == sorted(GPU_KEYS) and len(keys) == len(set(keys))
    assert set(bench_gpu.PARTS) == set(bench_gpu.PART_KEYS) == set(bench_gpu.PART_MIN_S)


def test_candidate_names_pick_the_candidates_and_their_order(tmp_path):
    assert [key for key, _, _ in bench_gpu.chosen_candidates(["attention_cudnn", "loss_chunk"])] == [
        "gpu_candidate_attention_cudnn", "gpu_candidate_loss_chunk"]
    assert bench_gpu.chosen_candidates(None) == bench_gpu.CANDIDATES
    assert len(bench_gpu.chosen_candidates(["loss_chunk", "loss_chunk"])) == 1
    assert set(bench_gpu.candidate_names()) == {key.removeprefix("gpu_candidate_") for key in bench_gpu.PART_KEYS["candidates"]}


def test_an_unknown_candidate_is_bad_input_before_anything_runs(tmp_path, capsys):
    import benchmark

    assert benchmark.main(["gpu", "--cpu", "--json", str(tmp_path / "gpu.json"), "--candidate", "warp_speed"]) == 64
    line = capsys.readouterr().err.strip()
    assert line.startswith("benchmark.py gpu: unknown candidate warp_speed; the candidates are loss_chunk, ")
    assert not (tmp_path / "gpu.json").exists()


def test_the_gpu_trainer_part_runs_the_shipped_config_at_one_batch_a_pass(tmp_path):
    import yaml

    from podlab import ROOT

    shipped = yaml.safe_load((ROOT / "config" / "conf.yaml").read_text())
    bench = yaml.safe_load(bench_gpu.gpu_config())
    assert bench["train"].pop("micro_batch") == 0 and shipped["train"].pop("micro_batch") == "auto"
    assert bench == shipped


def test_a_candidate_named_without_the_candidates_part_is_bad_input(tmp_path, capsys):
    import benchmark

    assert benchmark.main(["gpu", "--cpu", "--only", "trainer", "--candidate", "loss_chunk"]) == 64
    assert capsys.readouterr().err.strip() == ("benchmark.py gpu: --candidate picks within the candidates part; "
                                               "add --only candidates (and --only trainer, its floor)")


def test_a_run_killed_at_the_budget_says_so_and_a_crash_says_its_exit_code():
    slow = bench_gpu.stream([sys.executable, "-c", "print('autotuning', flush=True); import time; time.sleep(30)"],
                            dict(os.environ), timeout=1.0)
    assert slow.out_of_time and slow.code == -9
    with pytest.raises(RuntimeError, match=r"^slow was ended by the budget after [0-9]+ s; give it a call of its own"):
        bench_gpu.finished(slow, "slow")
    crash = bench_gpu.stream([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), timeout=30.0)
    assert not crash.out_of_time
    with pytest.raises(RuntimeError, match=r"^crash exited 3: "):
        bench_gpu.finished(crash, "crash")
