"""lab/chaos.py's moments: each phase starts at an event of the pod's contract (job/contract.py),
the runtime's or the trainer's, never at a prose line; training moments fall where the pod resumed."""

from __future__ import annotations

import random

import pytest

import chaos
import contract


@pytest.mark.parametrize("phase", chaos.PHASES)
def test_every_phase_starts_at_a_contract_event(phase):
    (kind, fields), delay = chaos.PHASES[phase]
    assert kind in contract.EVENTS and isinstance(fields, dict) and delay >= 0


class Restored:
    """A pod as far as trigger() asks it: its restore event."""

    def __init__(self, step):
        self.step = step

    def wait_for_event(self, kind, timeout=0, **fields):
        assert kind == "restore"
        return {"event": "restore", "step": self.step}


@pytest.mark.parametrize("resumed", [None, 0, 15, 95])
def test_training_moments_are_trainer_step_events_after_the_resumed_step(resumed):
    rng = random.Random(3)
    for _ in range(20):
        kind, fields = chaos.trigger(Restored(resumed), chaos.Moment("training", "KILL", 0), rng, 100)
        assert kind == "step" and (resumed or 0) < fields["step"] <= 99
        kind, fields = chaos.trigger(Restored(resumed), chaos.Moment("checkpoint write", "KILL", 0), rng, 100)
        assert kind == "step" and (fields["step"] % 5 == 0 or fields["step"] == 99) and fields["step"] > (resumed or 0)


def test_upload_moment_is_a_committed_checkpoint_event():
    kind, fields = chaos.trigger(Restored(0), chaos.Moment("upload", "KILL", 0), random.Random(1), 100)
    assert (kind, fields) == ("checkpoint", {"state": "committed"})
