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

After that signal torchrun gives its workers 30 s to save before it SIGKILLs them. torch 2.13 reads
TORCH_ELASTIC_SHUTDOWN_TIMEOUT for that; torch 2.11 and older do not, so there a save longer than
30 s was lost. Here the variable counts on every torch: it becomes the default
of the call that waits for the workers (PContext.close's timeout), which a newer torch overrides
with the same value.

torchrun exits 1 whatever its workers' codes; the pod reads the real one from the error file. A
worker that left none (a script without torch's @record) has its exit code written there, so a
usage error (2) or bad input (64) of the user's own script is not taken for a crash.

In a group of pods the rendezvous store lives in node 0's torchrun. When node 0's pod dies, another
node's torchrun finds the store gone at its next check (about once a second) and fails with its
own RendezvousConnectionError, which the pod reports as "the group never met" (75, counted by the
Job), often before its workers see the lost peer in their next collective and exit 138 (not
counted). Here that check answers "no node waiting" for STORE_LOST_GRACE_S after the store is
first found gone, so the workers' own exit decides; a group whose workers do not end by then
fails as before.
"""

import atexit
import gc
import inspect
import json
import os
import runpy
import signal
import sys
import time

EXIT_UNCAUGHT = 1  # what Python exits with on an uncaught exception, as torchrun did
EXIT_BAD_INPUT = 64  # contract.EXIT_BAD_INPUT (this file runs before anything of the job is imported)
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
STORE_LOST_GRACE_S = 60.0  # a step and a save of a large model, well within a pod's restart


def shutdown_timeout(environ) -> int | None:
    """The seconds SHUTDOWN_TIMEOUT_ENV asks for (None: unset); ValueError names the fix."""
    text = environ.get(SHUTDOWN_TIMEOUT_ENV, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV} must be whole seconds (e.g. 120), not {text!r}: fix the pod's env")
    return int(text)


def wait_for_workers(seconds: int) -> bool:
    """Make SECONDS the default time torchrun waits for its workers after a stop; False where this
    torch's PContext.close has no timeout to default (a torch this file does not know)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.close
    parameter = inspect.signature(original).parameters.get("timeout")
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return False

    def close(self, death_sig=None, timeout=seconds):
        return original(self, death_sig, timeout)

    PContext.close = close
    return True


def tolerate_a_lost_store(handler_class=None, grace_s: float = STORE_LOST_GRACE_S) -> bool:
    """Make handler_class.num_nodes_waiting (torchrun's check for new nodes while its workers run)
    answer 0 for grace_s after the rendezvous store is first found gone, then raise as before.
    False where this torch has no such handler (its torchrun keeps its own behaviour)."""
    try:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    except ImportError:
        return False
    handler_class = handler_class or DynamicRendezvousHandler
    original = handler_class.num_nodes_waiting
    lost_since = []

    def num_nodes_waiting(self):
        try:
            return original(self)
        except RendezvousConnectionError:
            lost_since[:] = lost_since or [time.monotonic()]
            if time.monotonic() - lost_since[0] < grace_s:
                return 0  # the workers meet the lost peer in their next collective and say so
            raise

    handler_class.num_nodes_waiting = num_nodes_waiting
    return True


def record_the_exit_code(failure, path: str | None) -> bool:
    """Write torchrun's error file with the first failed worker's exit code where the worker left
    none (a script without torch's @record: most). torchrun exits 1 whatever its workers' codes, and
    the file is how the pod tells a usage error (2) or bad input (64) from a crash. failure is
    torchrun's ChildFailedError; a worker ended by a signal (a negative code) is left as it was."""
    rank, first = failure.get_first_failure()
    if not path or os.path.exists(path) or not 0 < first.exitcode < 256:
        return False
    record = {"message": {"message": f"the worker of local rank {rank} exited {first.exitcode}: see its output above",
                          "errorCode": first.exitcode, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with open(path, "w") as file:
        json.dump(record, file)
    return True


def stopped_line(sigval) -> str:
    try:
        name = signal.Signals(sigval).name
    except ValueError:
        name = f"signal {sigval}"
    return f"torchrun: stopped by {name}; its workers were told to stop"


if __name__ == "__main__":
    try:
        seconds = shutdown_timeout(os.environ)
    except ValueError as err:
        print(f"torchrun: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    if seconds is not None and not wait_for_workers(seconds):
        print(f"torchrun: this torch's torchrun cannot be given {SHUTDOWN_TIMEOUT_ENV}; it keeps its own", file=sys.stderr, flush=True)
    atexit.register(gc.freeze)
    tolerate_a_lost_store()
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torchrun imports it anyway
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SignalException as stop:
        print(stopped_line(stop.sigval), file=sys.stderr, flush=True)
        sys.exit(EXIT_UNCAUGHT)
    except ChildFailedError as failed:
        record_the_exit_code(failed, os.environ.get("TORCHELASTIC_ERROR_FILE"))
        raise
