"""Training settings: a YAML file in groups, loaded into validated dataclasses.

    cfg = config.load("config/smoke.yaml", overrides=["train.max_steps=50"])

An unknown key, a wrong type or an impossible value raises ConfigError with one line that names
the key and the fix; train.py turns it into exit code 64 (a retry will never fix it).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import typing
from pathlib import Path

import yaml

# The pod's exit codes are the runtime's contract (code/contract.py links to job/contract.py).
from contract import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_UNAVAILABLE, printable  # noqa: F401 - train.py, finetune.py use them
# A group's failures and torchrun's error file are every trainer's: trainer_kit owns them.
from trainer_kit import group_failure_code, peer_lost, record_exit, report_failure  # noqa: F401


class ConfigError(Exception):
    """Bad input that no retry can fix."""


PARALLELISMS = ("ddp", "fsdp")
# Speed settings (code/speed.py applies them); each default is the behaviour before they existed.
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTO = "auto"
IntOrAuto = typing.Union[int, str]  # an integer, or the word auto


@dataclasses.dataclass
class ModelConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64: faster matmuls
    dropout: float = 0.0
    bias: bool = False
    # How it is computed, not what it is (a checkpoint resumes under any of these):
    attention: str = "auto"  # SDPA's kernel: auto lets torch choose; flash, efficient, cudnn, math force one
    loss_chunk_tokens: int = 0  # 0: the whole logits at once; N: output layer and loss N tokens at a time

    def check(self) -> None:
        _require(self.n_layer >= 1, "model.n_layer", "must be at least 1")
        _require(self.n_head >= 1, "model.n_head", "must be at least 1")
        _require(self.n_embd % self.n_head == 0, "model.n_embd",
                 f"({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        _require(self.block_size >= 2, "model.block_size", "must be at least 2")
        _require(2 <= self.vocab_size <= 65536, "model.vocab_size",
                 "must be between 2 and 65536 (token ids are stored as uint16)")
        _require(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        _require(self.attention in ATTENTION_BACKENDS, "model.attention",
                 f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {_show(self.attention)}")
        _require(self.loss_chunk_tokens >= 0, "model.loss_chunk_tokens", "must be 0 (off) or more")


@dataclasses.dataclass
class TrainConfig:
    batch_size: int = 12  # sequences per micro-step per process
    grad_accum_steps: int = 40  # micro-steps per optimizer step, summed over all processes
    max_steps: int = 600000
    learning_rate: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 2000
    lr_decay_steps: int = 0  # 0: decay over max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1337
    # ddp: every process holds the whole model. fsdp: weights, gradients and AdamW state sharded
    # across the processes (FSDP2), checkpoints sharded too (one file per process, DCP).
    parallelism: str = "ddp"
    # Sequences per forward pass: 0 is batch_size. A multiple of batch_size runs that many of the
    # same batches in one pass (the same data and, up to rounding, the same step); auto: on a GPU
    # the largest such multiple a memory probe finds room for (code/speed.py), on a CPU batch_size.
    micro_batch: IntOrAuto = 0

    def check(self) -> None:
        for key in ("batch_size", "grad_accum_steps", "max_steps"):
            _require(getattr(self, key) >= 1, f"train.{key}", "must be at least 1")
        _require(self.learning_rate > 0, "train.learning_rate", "must be positive")
        _require(0 <= self.min_lr <= self.learning_rate, "train.min_lr",
                 "must be between 0 and train.learning_rate")
        _require(self.warmup_steps >= 0, "train.warmup_steps", "must be 0 or more")
        _require(self.lr_decay_steps >= 0, "train.lr_decay_steps", "must be 0 or more")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be 0 or more")
        _require(0 <= self.beta1 < 1, "train.beta1", "must be in [0, 1)")
        _require(0 <= self.beta2 < 1, "train.beta2", "must be in [0, 1)")
        _require(self.grad_clip >= 0, "train.grad_clip", "must be 0 (off) or more")
        _require(self.parallelism in PARALLELISMS, "train.parallelism",
                 f"must be one of {', '.join(PARALLELISMS)}, got {_show(self.parallelism)}")
        _require(self.micro_batch == AUTO or (self.micro_batch >= 0 and self.micro_batch % self.batch_size == 0),
                 "train.micro_batch", f"must be 0 (train.batch_size), auto, or a multiple of train.batch_size "
                 f"({self.batch_size}), got {_show(self.micro_batch)}")

    def micro_multiple(self) -> int | None:
        """Batches per forward pass when train.micro_batch fixes it; None for auto."""
        if self.micro_batch == AUTO:
            return None
        return max(1, self.micro_batch // self.batch_size)


@dataclasses.dataclass
class EvalConfig:
    interval: int = 1000  # steps; a multiple of checkpoint.interval so best/ is a real checkpoint
    steps: int = 200  # batches per split per process

    def check(self) -> None:
        _require(self.interval >= 1, "eval.interval", "must be at least 1")
        _require(self.steps >= 1, "eval.steps", "must be at least 1")


@dataclasses.dataclass
class CheckpointConfig:
    interval: int = 1000  # steps between checkpoints; the last step is always saved
    keep: int = 3  # newest committed checkpoints kept, locally and in S3, besides best/
    # Training waits only for a copy of its state; a background process writes and commits it.
    # ("async" itself is a Python keyword, so no dataclass field can carry that name.)
    async_save: bool = True

    def check(self) -> None:
        _require(self.interval >= 1, "checkpoint.interval", "must be at least 1")
        _require(self.keep >= 1, "checkpoint.keep", "must be at least 1 (the newest is never deleted)")


@dataclasses.dataclass
class LogConfig:
    interval: int = 10

    def check(self) -> None:
        _require(self.interval >= 1, "log.interval", "must be at least 1")


@dataclasses.dataclass
class SystemConfig:
    dtype: str = "bfloat16"  # autocast dtype on CUDA; CPU always runs float32
    compile: bool = False
    peak_tflops: float = 0.0  # for MFU on GPUs this file does not know; 0: look it up by name
    compile_mode: str = "default"  # torch.compile's mode (reduce-overhead, max-autotune: CUDA graphs)
    inductor: str = ""  # torch._inductor.config flags to turn on, comma-separated (coordinate_descent_tuning)

    def check(self) -> None:
        _require(self.dtype in ("bfloat16", "float32"), "system.dtype", "must be bfloat16 or float32")
        _require(self.peak_tflops >= 0, "system.peak_tflops", "must be 0 (look up) or more")
        _require(self.compile_mode in COMPILE_MODES, "system.compile_mode",
                 f"must be one of {', '.join(COMPILE_MODES)}, got {_show(self.compile_mode)}")
        _require(all(re.fullmatch(r"[a-z_][a-z0-9_.]*", flag) for flag in self.inductor_flags()),
                 "system.inductor", f"must be torch._inductor.config flag names separated by commas, got "
                 f"{_show(self.inductor)}")

    def inductor_flags(self) -> list[str]:
        return [flag.strip() for flag in self.inductor.split(",") if flag.strip()]


class Groups:
    """A dataclass of setting groups (model, train, ...): each group checks itself, and
    train.grad_accum_steps is split between the processes."""

    def check(self) -> None:
        for group in dataclasses.fields(self):
            getattr(self, group.name).check()

    def check_world_size(self, world_size: int) -> None:
        _require(self.train.grad_accum_steps % world_size == 0, "train.grad_accum_steps",
                 f"({self.train.grad_accum_steps}) must be divisible by the number of processes "
                 f"({world_size}); change it or NPROC_PER_NODE")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Config(Groups):
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    system: SystemConfig = dataclasses.field(default_factory=SystemConfig)

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step, all processes together (grad_accum_steps is the total)."""
        return self.train.grad_accum_steps * self.train.batch_size * self.model.block_size

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        multiple = self.train.micro_multiple()
        local = self.train.grad_accum_steps // world_size
        _require(multiple is None or local % multiple == 0, "train.micro_batch",
                 f"({self.train.micro_batch}) must be train.batch_size times a divisor of the micro-steps per "
                 f"process ({local}: train.grad_accum_steps / {world_size} processes); e.g. "
                 f"{self.train.batch_size * _largest_divisor(local, multiple or 1)}, or auto")

    def check(self) -> None:
        super().check()
        _require(self.eval.interval % self.checkpoint.interval == 0, "eval.interval",
                 f"({self.eval.interval}) must be a multiple of checkpoint.interval "
                 f"({self.checkpoint.interval}), so the best model is a committed checkpoint")


def _largest_divisor(number: int, at_most: int) -> int:
    return max(d for d in range(1, max(1, min(number, at_most)) + 1) if number % d == 0)


def load(path: str | Path, overrides: list[str] | tuple = ()) -> Config:
    """Read a YAML file, apply `group.key=value` overrides, validate."""
    raw = _read_yaml(Path(path))
    for override in overrides:
        _apply_override(raw, override)
    return from_dict(raw, source=str(path))


def from_dict(raw: dict, source: str = "config") -> Config:
    try:
        groups = {}
        group_types = typing.get_type_hints(Config)
        for group in dataclasses.fields(Config):
            values = raw.get(group.name, {})
            if values is None:
                values = {}
            if not isinstance(values, dict):
                raise ConfigError(f"{group.name}: expected a mapping of settings, got {_show(values)}")
            groups[group.name] = _build(group_types[group.name], values, group.name)
        _reject_unknown(raw, [f.name for f in dataclasses.fields(Config)], "")
        cfg = Config(**groups)
        cfg.check()
        return cfg
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


DATA_DTYPE = "<u2"  # token ids as scripts/prepare_data.py writes them and train.py's batches read them
SCAN_TOKENS = 32 << 20  # token ids per numpy pass of the id scan: 64 MB of a memory map at a time


def check_data(data_dir: str | Path, cfg: Config) -> None:
    """train.bin and val.bin are there, whole uint16 files long enough for one block, agree with
    meta.json, and hold no token id the model has no embedding for: what would fail at a step (an
    IndexError, a device-side assert) fails here, before the first one, as bad input."""
    data_dir = Path(data_dir)
    meta = _data_meta(data_dir / "meta.json", cfg)
    for split in ("train", "val"):
        path = data_dir / f"{split}.bin"
        if not path.is_file():
            raise ConfigError(f"{path} not found; run scripts/prepare_data.py and upload its output to S3_DATA_URI")
        size = path.stat().st_size
        if size % 2:
            raise ConfigError(f"{path} is {size} bytes, not a whole number of 2-byte (uint16) token ids: it was cut "
                              f"short or not made by scripts/prepare_data.py; make it again and upload it")
        tokens = size // 2
        expected = meta.get(f"{split}_tokens")
        if _is_int(expected) and expected != tokens:
            raise ConfigError(f"{path} holds {tokens} tokens but meta.json says {expected}: the data in S3 is cut "
                              f"short or mixes two preparations; upload train.bin, val.bin and meta.json of one "
                              f"scripts/prepare_data.py run")
        if tokens <= cfg.model.block_size + 1:
            raise ConfigError(f"{path} holds {tokens} tokens, fewer than model.block_size+2 "
                              f"({cfg.model.block_size + 2}); give more data or a smaller block_size")
        check_token_ids(path, cfg.model.vocab_size)


def _data_meta(path: Path, cfg: Config) -> dict:
    """meta.json (optional): its dtype must be the trainer's, its vocabulary must fit the model."""
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: "[[[[..." nesting
        meta = None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} is not a JSON object; make the data with scripts/prepare_data.py (or delete "
                          f"meta.json: it is optional)")
    dtype = meta.get("dtype", "uint16")
    if dtype != "uint16":
        raise ConfigError(f"{path} says the token ids are {dtype!r}, but the trainer reads uint16; make the data "
                          f"with scripts/prepare_data.py (a vocabulary of at most 65536)")
    vocab = meta.get("vocab_size", 0)
    if not _is_int(vocab) or vocab < 0:
        raise ConfigError(f"{path}: vocab_size is {vocab!r}, not a count of tokens; make the data with "
                          f"scripts/prepare_data.py")
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the data's "
                          f"vocabulary ({vocab}, {path}); set model.vocab_size to at least {vocab}")
    return meta


def check_token_ids(path: Path, vocab_size: int) -> None:
    """Every token id below vocab_size: numpy's max over a memory map, SCAN_TOKENS ids at a time."""
    import numpy as np

    data = np.memmap(path, dtype=DATA_DTYPE, mode="r")
    for start in range(0, len(data), SCAN_TOKENS):
        chunk = data[start:start + SCAN_TOKENS]
        if int(chunk.max()) >= vocab_size:
            at = start + int(np.flatnonzero(chunk >= vocab_size)[0])
            largest = max(int(data[i:i + SCAN_TOKENS].max()) for i in range(start, len(data), SCAN_TOKENS))
            raise ConfigError(f"{path} holds token id {int(data[at])} (token {at:,}), but model.vocab_size is "
                              f"{vocab_size}; set model.vocab_size to at least {largest + 1}, or make the data "
                              f"with the model's tokenizer")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_same_model(saved: dict, cfg: Config, where: str) -> None:
    """A checkpoint can only resume the model shape it was trained with."""
    current = dataclasses.asdict(cfg.model)
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias"):
        if key in saved and saved[key] != current[key]:
            raise ConfigError(f"{where} was trained with model.{key}={saved[key]} but the config says "
                              f"{current[key]}; use the config it was trained with, or a new S3_OUTPUT_URI")


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}; check TRAIN_CONFIG / --config") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}; fix the file") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of setting groups (model:, train:, ...), got {_show(raw)}")
    return raw


def _apply_override(raw: dict, override: str) -> None:
    key, sep, value = override.partition("=")
    group, dot, name = key.strip().partition(".")
    if not sep or not dot or not group or not name:
        raise ConfigError(f"override {override!r} is not group.key=value (e.g. train.max_steps=100)")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value
    section = raw.setdefault(group, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{group}: expected a mapping of settings, got {_show(section)}")
    section[name] = parsed


def _build(cls: type, values: dict, group: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    _reject_unknown(values, names, f"{group}.")
    kwargs = {key: _coerce(hints[key], value, f"{group}.{key}") for key, value in values.items()}
    return cls(**kwargs)


def _reject_unknown(values: dict, known: list[str], prefix: str) -> None:
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(prefix + k for k in known)}"
            raise ConfigError(f"unknown setting {prefix}{printable(str(key))}; {hint}")  # a key may hold anything


def _coerce(kind: type, value, key: str):
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {_show(value)}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {_show(value)}")
    if kind is float:
        return _to_float(value, key)
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {_show(value)}")
    if kind == IntOrAuto:
        if value == AUTO or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise ConfigError(f"{key} must be an integer or auto, got {_show(value)}")
    raise TypeError(f"no coercion for {kind}")


def _to_float(value, key: str) -> float:
    # YAML 1.1 reads 6e-4 (no dot) as a string; accept it, since people write it that way.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{key} must be a number, got {_show(value)}")


def _require(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {problem}")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
