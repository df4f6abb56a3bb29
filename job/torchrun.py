"""torchrun, exactly as `python -m torch.distributed.run ARGS` runs it (the module as __main__),
less its exit's last garbage collection and the traceback of a graceful stop.

    python torchrun.py [torchrun's arguments...]

torch.distributed.run imports torch; the interpreter's final collection walks every object that
made, 0.5 to 0.65 s here between the workers' end and torchrun's exit, on the way out of every pod
(a preemption's included). Frozen at exit, those objects are freed with the process instead:
torchrun's own, never the trainer's (its workers are other processes).

A SIGTERM or SIGINT to torchrun (a pod's graceful stop) ends it with a SignalException, which it
records in TORCHELASTIC_ERROR_FILE and then lets through as a 30-line traceback: here it is one
line, and the exit code stays torchrun's own (1).
"""

import atexit
import gc
import runpy
import signal
import sys

EXIT_UNCAUGHT = 1  # what Python exits with on an uncaught exception, as torchrun did


def stopped_line(sigval) -> str:
    try:
        name = signal.Signals(sigval).name
    except ValueError:
        name = f"signal {sigval}"
    return f"torchrun: stopped by {name}; its workers were told to stop"


if __name__ == "__main__":
    atexit.register(gc.freeze)
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torchrun imports it anyway

    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SignalException as stop:
        print(stopped_line(stop.sigval), file=sys.stderr, flush=True)
        sys.exit(EXIT_UNCAUGHT)
