"""train.py's speed settings, applied (code/config.py names and checks them); each default is the
behaviour before the setting existed.

    model = speed.compiled(raw_model, cfg.system)      # system.compile, compile_mode, inductor
    multiple = speed.micro_multiple(cfg, device, local_steps, peak_of)   # train.micro_batch
    speed.check_cuda_graphs(cfg.system, device, passes, one_pass)  # CUDA graphs: one backward a step only
    speed.mark_step(cfg.system, device)                # before a forward under CUDA graphs

train.micro_batch: auto on a GPU runs a probe: forward and backward (eager, under the step's
autocast) at train.batch_size times 1, 2, 4, ... (each a divisor of the micro-steps per process,
about doubling), until one runs out of memory or its peak passes PROBE_SHARE of the GPU's memory;
the last that fitted is taken. Eager holds more than a compiled step (the whole float32 logits,
which inductor fuses away), so the choice errs small. The RNG states are put back after it, so
the run draws what it would have drawn. On a CPU, auto is train.batch_size.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from config import Config, ConfigError, SystemConfig

PROBE_SHARE = 0.85  # of the GPU's memory a probed micro-batch may peak at: room for compile's workspace


def compiled(model: torch.nn.Module, system: SystemConfig):
    """torch.compile(model) with system.compile_mode and the system.inductor flags on; the model
    itself when system.compile is off."""
    if not system.compile:
        return model
    set_inductor_flags(system.inductor_flags())
    return torch.compile(model, mode=None if system.compile_mode == "default" else system.compile_mode)


def set_inductor_flags(flags: list[str]) -> None:
    """Each name a boolean of torch._inductor.config (dotted for its sub-configs), set to True."""
    import torch._inductor.config as inductor

    for flag in flags:
        *parents, name = flag.split(".")
        owner = inductor
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is None or not isinstance(getattr(owner, name, None), bool):
            raise ConfigError(f"system.inductor: torch {torch.__version__} has no on/off flag "
                              f"torch._inductor.config.{flag}; name one it has (e.g. coordinate_descent_tuning)")
        setattr(owner, name, True)


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that replay CUDA graphs


def uses_cuda_graphs(system: SystemConfig, device: torch.device) -> bool:
    return system.compile and system.compile_mode in CUDA_GRAPH_MODES and device.type == "cuda"


def check_cuda_graphs(system: SystemConfig, device: torch.device, passes: int, one_pass: int) -> None:
    """CUDA graphs with more than one backward a step are bad input: the first backward's gradients
    become the parameters' .grad while they are still the graph's output buffers, and the next
    replay overwrites them (pytorch/pytorch#169545; train.py stopped at its first step so on an
    H200 with torch 2.11, 2026-11-28). One pass a step (`one_pass` sequences) has a single backward."""
    if uses_cuda_graphs(system, device) and passes > 1:
        raise ConfigError(f"system.compile_mode={system.compile_mode} replays CUDA graphs, which overwrite the "
                          f"gradients train.py sums over its {passes} forward passes a step (pytorch issue 169545); "
                          f"use max-autotune-no-cudagraphs, or train.micro_batch={one_pass} (one pass a step)")


def mark_step(system: SystemConfig, device: torch.device) -> None:
    """Under CUDA graphs each forward starts a new step of the graph trees: the outputs of the one
    before may be overwritten (the trainer has summed the loss by then)."""
    if uses_cuda_graphs(system, device):
        torch.compiler.cudagraph_mark_step_begin()


def check_device(cfg: Config, device: torch.device) -> None:
    """Settings this device cannot run, as bad input before the first step."""
    if device.type != "cuda" and cfg.model.attention in ("efficient", "cudnn"):
        raise ConfigError(f"model.attention={cfg.model.attention} needs a CUDA GPU; on a CPU use auto, flash "
                          f"or math")


# -- train.micro_batch ---------------------------------------------------------------------------

def multiples(local_steps: int) -> list[int]:
    """Batches per forward pass the probe tries: 1, then each the smallest divisor of the
    micro-steps per process that is at least twice the one before."""
    tried = [1]
    while True:
        bigger = next((d for d in range(2 * tried[-1], local_steps + 1) if local_steps % d == 0), None)
        if bigger is None:
            return tried
        tried.append(bigger)


def choose(candidates: list[int], peak_of: Callable[[int], int | None], cap: int) -> tuple[int, list[tuple]]:
    """The largest candidate, tried in order, whose peak (bytes; None: out of memory) stays under
    `cap`; the first never fitting still gives the first (training fails there as it would have).
    Stops at the first that does not fit: a larger one would not either. Returns (chosen, tried)
    with tried a list of (candidate, peak or None)."""
    chosen, tried = candidates[0], []
    for candidate in candidates:
        peak = peak_of(candidate)
        tried.append((candidate, peak))
        if peak is None or peak > cap:
            break
        chosen = candidate
    return chosen, tried


def micro_multiple(cfg: Config, device: torch.device, local_steps: int,
                   peak_of: Callable[[int], int | None] | None, log: Callable[[str], None]) -> int:
    """Batches of train.batch_size per forward pass: train.micro_batch's, or the probe's for auto."""
    fixed = cfg.train.micro_multiple()
    if fixed is not None:
        return fixed
    if device.type != "cuda" or peak_of is None:
        log(f"train.micro_batch auto: {cfg.train.batch_size} sequences per forward pass (train.batch_size) on "
            f"{device.type}")
        return 1
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(PROBE_SHARE * total)
    chosen, tried = choose(multiples(local_steps), peak_of, cap)
    shown = ", ".join(f"{k * cfg.train.batch_size}: " + (f"{peak / 2**30:.1f} GiB" if peak is not None else "out of memory")
                      for k, peak in tried)
    log(f"train.micro_batch auto: {chosen * cfg.train.batch_size} sequences per forward pass (probed peaks {shown}; "
        f"cap {cap / 2**30:.1f} GiB of {total / 2**30:.1f})")
    return chosen


def saved_micro_batch(state) -> int | None:
    """Sequences a forward pass the checkpoint's run took, from its train state (read from a bucket:
    untrusted): its `micro_batch`, else, for a checkpoint from before that was recorded, its
    config's fixed train.micro_batch (0: its train.batch_size); None where neither says."""
    def whole(value) -> bool:
        return type(value) is int and value > 0

    if not isinstance(state, dict):
        return None
    if whole(state.get("micro_batch")):
        return state["micro_batch"]
    config = state.get("config")
    train = config.get("train") if isinstance(config, dict) else None
    if not isinstance(train, dict) or not whole(train.get("batch_size")):
        return None
    fixed = train.get("micro_batch", 0)
    if fixed == 0 and type(fixed) is int:
        return train["batch_size"]
    return fixed if whole(fixed) else None


def kept_on_resume(saved: int | None, batch_size: int, probed: int, local_steps: int) -> int:
    """Batches per pass for auto on resume: the checkpoint's (`saved` sequences a pass) where it is a
    whole multiple that divides the micro-steps per process and is no larger than the probe's; else
    the probe's."""
    if type(saved) is not int or saved <= 0 or saved % batch_size:
        return probed
    multiple = saved // batch_size
    return multiple if multiple <= probed and local_steps % multiple == 0 else probed


def resumed_multiple(saved: int | None, batch_size: int, probed: int, local_steps: int) -> tuple[int, str | None]:
    """auto on resume: (batches a pass, a line to log or None). The checkpoint's micro-batch where it
    still fits keeps the steps bitwise those of an uninterrupted run; otherwise the line warns."""
    kept = kept_on_resume(saved, batch_size, probed, local_steps)
    if kept != probed:
        return kept, (f"train.micro_batch auto: {kept * batch_size} sequences per forward pass, as the checkpoint "
                      f"ran (the probe found room for {probed * batch_size}; train.micro_batch={probed * batch_size} "
                      f"takes it, and the steps from here are then not bitwise those of an uninterrupted run)")
    if saved == probed * batch_size:
        return kept, None
    ran = (f"ran {saved} sequences per forward pass" if saved is not None else
           "does not say how many sequences per forward pass it ran")
    return kept, (f"warning: train.micro_batch auto: the checkpoint {ran}, this start takes {probed * batch_size}: "
                  f"the steps from here will not be bitwise those of an uninterrupted run; set train.micro_batch "
                  f"to a fixed value for that")


@contextlib.contextmanager
def rng_kept(device: torch.device):
    """The CPU's and the device's RNG states as they were, whatever runs inside."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def cuda_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, autocast, device: torch.device,
              shape: tuple[int, int], vocab: int) -> Callable[[int], int | None]:
    """peak_of(multiple) for choose(): the bytes allocated at most during a forward and backward
    of multiple * batch sequences on this GPU, plus AdamW's state if it is not allocated yet; None
    when it ran out of memory."""
    missing_state = 0 if optimizer.state else 2 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)

    def peak_of(multiple: int) -> int | None:
        batch, block = shape
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            with rng_kept(device):
                x = torch.randint(vocab, (multiple * batch, block), device=device)
                with autocast:
                    _, loss = model(x, x)
                loss.backward()
                del x, loss
                torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) + missing_state
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    return peak_of


def saved_bytes_peak(model: torch.nn.Module, shape: tuple[int, int], vocab: int) -> Callable[[int], int | None]:
    """peak_of(multiple) on any device, as a model of memory rather than the allocator's reading:
    weights, gradients and AdamW's two moments, plus the bytes autograd saves for backward in one
    forward pass (lab/benchmark.py gpu's CPU mode probes with it)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    device = next(model.parameters()).device

    def peak_of(multiple: int) -> int | None:
        saved = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += tensor.numel() * tensor.element_size()
            return tensor

        batch, block = shape
        with rng_kept(device), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            x = torch.randint(vocab, (multiple * batch, block), device=device)
            _, loss = model(x, x)
            loss.backward()
        model.zero_grad(set_to_none=True)
        return 4 * params + saved

    return peak_of
