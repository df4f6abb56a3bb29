"""torchrun's worker before the trainer: import torch while the pod still restores, then run it.

    preload.py GATE TRAINER.py [trainer arguments...]

script.sh starts torchrun with this in front of the trainer before it takes the lease and
restores the checkpoint, so each worker's `import torch` (1 to 2 s here, more with CUDA) overlaps
that work instead of following it. The worker waits until the file GATE says "go" (written once
the checkpoint is on disk), then runs TRAINER.py exactly as `python TRAINER.py args...` would:
as __main__, with its own sys.argv and its folder first on sys.path. The trainer decides nothing
earlier: it looks for its checkpoint only after the gate opens. Settings torch reads when imported
(TORCH_LOGS, TORCHDYNAMO_*, TORCHINDUCTOR_*) belong in the pod's env, not in the trainer's
os.environ before its own `import torch`: torch is imported by then. A pod that never trains (the run is
complete, bad input, a signal) stops torchrun instead, and the worker ends with it.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

import contract

GO = "go"
POLL_SECONDS = 0.02


def preload() -> float:
    """Import what every trainer of this toolkit imports first; return the seconds it took."""
    started = time.monotonic()
    import torch  # noqa: F401 - the point: imported once, here, while the pod restores
    import torch.distributed  # noqa: F401

    try:  # the first optimizer's __init__ imports it otherwise: 1.3 s here. Best effort: a build
        import torch._dynamo  # noqa: F401 - without it still trains
    except Exception:  # noqa: BLE001
        pass
    return time.monotonic() - started


def wait_for_gate(gate: str) -> None:
    while True:
        try:
            with open(gate) as file:
                if file.read().strip() == GO:
                    return
        except FileNotFoundError:
            pass
        time.sleep(POLL_SECONDS)


def run_trainer(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python path` sets it (was job/)
    runpy.run_path(path, run_name="__main__")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: preload.py GATE TRAINER.py [arguments...]", file=sys.stderr)
        return contract.EXIT_BAD_INPUT
    gate, trainer, *args = argv
    seconds = preload()
    if os.environ.get("RANK", "0") == "0":
        contract.event("preloaded", "runtime", seconds=round(seconds, 3))
    sys.modules.pop("contract")  # a trainer's own contract.py, if it has one, is the one it imports
    wait_for_gate(gate)
    run_trainer(trainer, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
