"""lab/kill_sweep.py's comparison of two checkpoints: what makes it call a resume exact or not."""

from __future__ import annotations

import pytest
import torch

import checkpoint
from kill_sweep import checkpoint_differences, state_differences


def state(**changes) -> dict:
    torch.manual_seed(0)
    value = {"optimizer": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4, 3)}},
                           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0]}]},
             "rng": [{"cpu": torch.get_rng_state(), "cuda": None}], "step": 5, "best_val_loss": float("nan")}
    value.update(changes)
    return value


def test_equal_states_have_no_differences_even_with_nan_values():
    assert state_differences(state(), state()) == []


@pytest.mark.parametrize("change,where", [
    (lambda s: s["optimizer"]["state"][0]["exp_avg"].view(-1)[3].add_(1e-7), "/optimizer/state/0/exp_avg: 1 of 12"),
    (lambda s: s["rng"][0].update(cpu=torch.zeros(1, dtype=torch.uint8)), "/rng/0/cpu: torch.uint8"),
    (lambda s: s.update(step=6), "/step: 6 vs 5"),
    (lambda s: s["optimizer"]["param_groups"][0].update(betas=(0.9, 0.999)), "/betas/1: 0.999 vs 0.99"),
    (lambda s: s.pop("rng"), ": keys ['rng'] in one only"),
    (lambda s: s["optimizer"]["state"][0].update(exp_avg=s["optimizer"]["state"][0]["exp_avg"].double()),
     "float64[4, 3] vs torch.float32[4, 3]"),
])
def test_any_changed_value_is_named_with_where_it_is(change, where):
    changed = state()
    change(changed)
    found = state_differences(changed, state())
    assert len(found) == 1 and where in found[0], found


def test_negative_zero_is_not_zero_bit_for_bit():
    assert state_differences({"w": torch.tensor([-0.0])}, {"w": torch.tensor([0.0])}) != []


def test_two_committed_checkpoints_are_compared_file_by_file(tmp_path):
    for name, weight in (("a", 1.0), ("b", 1.0), ("c", 2.0)):
        with checkpoint.stage(tmp_path / name / "step-00000001") as staged:
            with staged.open("model.pt") as file:
                torch.save({"w": torch.full((2,), weight)}, file)
            with staged.open("state.pt") as file:
                torch.save(state(), file)
            staged.commit(meta={"step": 1})
    folder = lambda name: tmp_path / name / "step-00000001"  # noqa: E731
    assert checkpoint_differences(folder("a"), folder("b")) == []
    assert checkpoint_differences(folder("a"), folder("c")) == ["step-00000001/model.pt/w: 2 of 2 values differ, the largest by 1"]
