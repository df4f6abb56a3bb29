"""The bookkeeping of `benchmark.py all` and `benchmark.py gpu`: every key they write, its unit and aim, and how a measured
value, the floor measured beside it in the same run, their ratio and the aim become one JSON entry.

Pure: no S3, no subprocess. An aim is (field, op, bound): the field ("value" or "ratio") the bound
is about; None where the issue states no aim (the figure is reported, not judged).
"""

from __future__ import annotations

import math
import os
import platform
import time

LE, GE = "<=", ">="

# key: (unit, aim)
KEYS: dict[str, tuple[str, tuple[str, str, float] | None]] = {
    "restore_vs_s5cmd": ("s", ("ratio", LE, 1.0)),
    "restore_vs_disk_floor": ("s", None),
    "restore_vs_get_floor": ("s", None),
    "restore_vs_s3torchconnector": ("s", None),
    "upload_vs_s5cmd": ("s", ("ratio", LE, 1.0)),
    "upload_vs_s3torchconnector": ("s", None),
    "upload_lag_p95_s": ("s", None),
    "checkpoint_stall": ("tokens/s", ("ratio", GE, 0.98)),
    "checkpoint_stall_sync": ("tokens/s", None),
    "sigterm_to_exit_s": ("s", ("value", LE, 15.0)),
    "pod_start_to_first_step_s": ("s", None),
    "pod_start_to_first_step_minus_bare_torchrun_s": ("s", ("value", LE, 3.0)),
    "kill_to_training_s": ("s", None),
    "upload_bytes_per_interval": ("bytes", ("ratio", LE, 1.2)),
    "idle_requests_per_interval": ("requests", ("value", LE, 1.0)),
    "s3torchconnector": ("version", None),
    # train.parallelism: fsdp (lab/bench_fsdp.py)
    "fsdp_state_bytes_per_rank": ("bytes", ("ratio", LE, 0.6)),
    "fsdp_peak_rss_per_rank_mb": ("MB", None),
    "fsdp_stall_toolkit_s": ("s", None),
    "fsdp_stall_dcp_async_s": ("s", None),
    "fsdp_to_s3_s": ("s", None),
    "fsdp_restore_s": ("s", None),
    "fsdp_restore_bytes_per_node": ("bytes", ("ratio", LE, 0.6)),
}

# `benchmark.py gpu` (lab/bench_gpu.py): on one GPU, or its CPU mode on a tiny model. Aims: issue 27.
GPU_KEYS: dict[str, tuple[str, tuple[str, str, float] | None]] = {
    "gpu_trainer_tokens_per_s": ("tokens/s", ("ratio", GE, 0.98)),
    "gpu_trainer_mfu": ("fraction", ("value", GE, 0.5)),
    "gpu_bare_tokens_per_s": ("tokens/s", None),
    "gpu_micro_batch": ("sequences", None),
    "gpu_micro_batch_peak_bytes": ("bytes", None),
    "gpu_bare_best_tokens_per_s": ("tokens/s", None),
    "gpu_trainer_auto_tokens_per_s": ("tokens/s", ("ratio", GE, 0.98)),
    "gpu_trainer_auto_mfu": ("fraction", ("value", GE, 0.5)),
    "gpu_checkpoint_stall": ("tokens/s", ("ratio", GE, 0.99)),
    "gpu_checkpoint_stall_sync": ("tokens/s", None),
    "gpu_last_save_wait_s": ("s", None),
    "gpu_sigterm_to_exit_s": ("s", ("value", LE, 5.0)),
    "gpu_finetune_lora_resume": ("step", ("ratio", GE, 1.0)),
    "gpu_finetune_full_resume": ("step", ("ratio", GE, 1.0)),
    "gpu_finetune_fsdp_resume": ("step", ("ratio", GE, 1.0)),
    "gpu_fsdp_train_resume": ("step", ("ratio", GE, 1.0)),
    "gpu_candidate_loss_chunk": ("tokens/s", None),
    "gpu_candidate_auto_loss_chunk": ("tokens/s", None),
    "gpu_candidate_attention_flash": ("tokens/s", None),
    "gpu_candidate_attention_cudnn": ("tokens/s", None),
    "gpu_candidate_attention_efficient": ("tokens/s", None),
    "gpu_candidate_coordinate_descent": ("tokens/s", None),
    "gpu_candidate_max_autotune": ("tokens/s", None),
    "gpu_candidate_fsdp": ("tokens/s", None),
    "gpu_candidate_fsdp_micro_batch_48": ("tokens/s", None),
}
ALL_KEYS = {**KEYS, **GPU_KEYS}


def ratio(value, floor) -> float | None:
    if value is None or floor is None or not floor:
        return None
    return round(value / floor, 3)


def meets(aim: tuple[str, str, float] | None, entry: dict) -> bool | None:
    """Whether the entry meets its aim; None with no aim or nothing measured to judge."""
    if aim is None:
        return None
    field, op, bound = aim
    measured = entry.get(field)
    if not isinstance(measured, (int, float)) or isinstance(measured, bool):
        return None
    return measured <= bound if op == LE else measured >= bound


def show_aim(aim: tuple[str, str, float] | None) -> str | None:
    return None if aim is None else f"{aim[0]} {aim[1]} {aim[2]:g}"


def figure(key: str, value, how: str, floor=None, **detail) -> dict:
    """One key's entry: the value, its floor, their ratio and whether the aim is met."""
    unit, aim = ALL_KEYS[key]
    entry = {"value": _rounded(value), "unit": unit, "floor": _rounded(floor), "ratio": ratio(value, floor),
             "aim": show_aim(aim), "how": how}
    entry["meets_aim"] = meets(aim, entry)
    if detail:
        entry["detail"] = {k: [_rounded(x) for x in v] if isinstance(v, list) else _rounded(v) for k, v in detail.items()}
    return entry


def unmeasured(key: str, why: str) -> dict:
    """A key with nothing measured: value null, and `how` says exactly why."""
    return figure(key, None, why)


def machine(load_at_start: tuple[float, float, float]) -> dict:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch = torch_version = None
    found = {"cores": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in load_at_start],
             "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "torch": torch_version,
             "python": platform.python_version(), "platform": platform.platform()}
    if torch is not None and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        found.update(gpu=properties.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=properties.total_memory,
                     cuda=torch.version.cuda)
    return found


def report(figures: dict[str, dict], load_at_start: tuple[float, float, float], started_at: float,
           seconds: float, mode: str, keys: dict = KEYS) -> dict:
    """The JSON object: every key in `keys` (a missing one says it was not run), the machine, the start."""
    out = {key: figures.get(key) or unmeasured(key, "not run in this invocation (--only)") for key in keys}
    out["machine"] = machine(load_at_start)
    out["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at))
    out["seconds"] = round(seconds, 1)
    out["mode"] = mode  # full, quick or tiny (all); gpu or cpu (gpu)
    return out


def _rounded(value):
    """Three decimals, and at least four significant digits: a floor of 0.0474 s rounded to 0.047
    would put value/floor 1% off the ratio, which is computed from the figures as measured."""
    if not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return value
    return round(value, max(3, 3 - math.floor(math.log10(abs(value)))))


def table_rows(result: dict, command: str, keys: dict = KEYS) -> list[str]:
    """Markdown rows: figure | value | floor | ratio | aim | meets | command."""
    rows = []
    for key in keys:
        entry = result[key]
        rows.append(f"| `{key}` | {_show(entry['value'])} {entry['unit']} | {_show(entry['floor'])} | "
                    f"{_show(entry['ratio'])} | {entry['aim'] or '-'} | {_show(entry['meets_aim'])} | "
                    f"{entry['how']} | `{command}` |")
    return rows


def _show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)
