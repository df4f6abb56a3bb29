"""torchrun's worker before the trainer: import torch while the pod still restores, then run it.

    preload.py GATE TRAINER.py [trainer arguments...]

script.sh starts torchrun with this in front of the trainer before it syncs the data, takes the
lease and restores the checkpoint, so each worker's `import torch` (1 to 2 s here, more with
CUDA), and for the shipped finetune.py transformers' (3.4 s more), overlaps that work instead of
following it.
The worker waits until the file GATE says "go" (written once the checkpoint is on disk), then runs
TRAINER.py exactly as `python TRAINER.py args...` would:
as __main__, with its own sys.argv and its folder first on sys.path. The trainer decides nothing
earlier: it looks for its checkpoint only after the gate opens. Settings torch reads when imported
(TORCH_LOGS, TORCHDYNAMO_*, TORCHINDUCTOR_*) belong in the pod's env, not in the trainer's
os.environ before its own `import torch`: torch is imported by then. A pod that never trains (the run is
complete, bad input, a signal) stops torchrun instead, and the worker ends with it. An exception
the trainer does not catch is recorded in torchrun's error file before Python prints it.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

import contract

GO = "go"
POLL_SECONDS = 0.02
# The shipped Hugging Face trainer (TRAIN_SCRIPT=finetune.py): its imports and the settings it makes
# before them are known. Another trainer's transformers is left to it: it may set its own first.
HF_TRAINER = "finetune.py"
HF_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")  # as finetune.py sets them


def preload(trainer: str) -> float:
    """Import what the trainer imports first; return the seconds it took."""
    started = time.monotonic()
    import torch  # noqa: F401 - the point: imported once, here, while the pod restores
    import torch.distributed  # noqa: F401

    try:  # the first optimizer's __init__ imports it otherwise: 1.3 s here. Best effort: a build
        import torch._dynamo  # noqa: F401 - without it still trains
    except Exception:  # noqa: BLE001
        pass
    if os.path.basename(trainer) == HF_TRAINER:
        preload_transformers()
    return time.monotonic() - started


def preload_transformers() -> None:
    """finetune.py's imports of transformers (3.4 s here, after torch), offline first as finetune.py
    makes it: huggingface_hub reads these once, at import, and the hub is never to be reached."""
    for name in HF_OFFLINE:
        os.environ[name] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer  # noqa: F401
    except Exception:  # noqa: BLE001 - best effort: finetune.py's own import says what is wrong
        pass


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
    try:
        runpy.run_path(path, run_name="__main__")
    except Exception as err:
        record(err)
        raise


def record(err: Exception) -> None:
    """The trainer's uncaught exception in torchrun's error file, as torch's @record would write it:
    torchrun then reports it as the root cause (not "error_file: <N/A>"), and the pod says and keeps
    its line (trainer_error.py). The traceback still goes to stderr, as Python prints it."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(err)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: preload.py GATE TRAINER.py [arguments...]", file=sys.stderr)
        return contract.EXIT_BAD_INPUT
    gate, trainer, *args = argv
    seconds = preload(trainer)
    if os.environ.get("RANK", "0") == "0":
        contract.event("preloaded", "runtime", seconds=round(seconds, 3))
    sys.modules.pop("contract")  # a trainer's own contract.py, if it has one, is the one it imports
    wait_for_gate(gate)
    run_trainer(trainer, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
