"""torchrun, exactly as `python -m torch.distributed.run ARGS` runs it (the module as __main__),
less its exit's last garbage collection.

    python torchrun.py [torchrun's arguments...]

torch.distributed.run imports torch; the interpreter's final collection walks every object that
made, 0.5 to 0.65 s here between the workers' end and torchrun's exit, on the way out of every pod
(a preemption's included). Frozen at exit, those objects are freed with the process instead:
torchrun's own, never the trainer's (its workers are other processes).
"""

import atexit
import gc
import runpy

if __name__ == "__main__":
    atexit.register(gc.freeze)
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
