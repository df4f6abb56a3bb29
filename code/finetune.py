"""Fine-tune a causal LM from a local Hugging Face snapshot, full or LoRA, resuming by itself.

One process:
    python finetune.py --config ../config/finetune.yaml --model_dir MODEL --data_dir DATA --output_dir OUT
Every GPU of one machine (what the pod runs):
    torchrun --standalone --nproc_per_node=4 finetune.py --config config/finetune.yaml --model_dir MODEL ...
Override single settings with --set group.key=value (e.g. --set model.method=full).
--check checks the config, the arguments and the libraries alone (no model, no data, no torch): the
pod runs it first.

MODEL is a folder made by `save_pretrained` or `hf download --local-dir` (config.json, weights,
tokenizer); nothing is fetched from a hub. DATA is a JSONL file (or a folder with data.train_file,
and optionally data.val_file), one record per line with a `text` field, or a `datasets` dataset saved
with `save_to_disk`. Texts are tokenized, joined with EOS and cut into data.block_size sequences.

Resume: the same command on every start; the newest committed checkpoint under OUTPUT_DIR/checkpoints
decides (hf_resume.py). SIGTERM/SIGINT: the current step finishes, is committed, exit 143/130.
Exit 64: bad input (the config, the model snapshot, the data); a retry will not fix it.
"""

from __future__ import annotations

import os

# Before transformers and huggingface_hub are imported: they read these once, at import.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_name] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import errno  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import typing  # noqa: E402
from pathlib import Path  # noqa: E402

import config  # noqa: E402
import trainer_kit  # noqa: E402
from config import ConfigError, _require  # noqa: E402

EXIT_BAD_INPUT = config.EXIT_BAD_INPUT
SCHEDULERS = ("cosine", "linear", "constant_with_warmup")


log = trainer_kit.logger("finetune")


# -- settings -------------------------------------------------------------------------------------

@dataclasses.dataclass
class ModelSettings:
    method: str = "lora"
    dtype: str = "bfloat16"  # on CUDA; full fine-tunes keep float32 weights and train in bf16 autocast
    gradient_checkpointing: bool = False

    def check(self) -> None:
        _require(self.method in ("lora", "full"), "model.method", "must be lora or full")
        _require(self.dtype in ("bfloat16", "float32"), "model.dtype", "must be bfloat16 or float32")


@dataclasses.dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: str = "all-linear"

    def check(self) -> None:
        _require(self.r >= 1, "lora.r", "must be at least 1")
        _require(self.alpha >= 1, "lora.alpha", "must be at least 1")
        _require(0.0 <= self.dropout < 1.0, "lora.dropout", "must be in [0, 1)")
        _require(bool(self.modules()), "lora.target_modules", "must name modules (e.g. q_proj,v_proj) or be all-linear")

    def modules(self) -> str | list[str]:
        if self.target_modules.strip() == "all-linear":
            return "all-linear"
        return [m.strip() for m in self.target_modules.split(",") if m.strip()]


@dataclasses.dataclass
class DataSettings:
    text_field: str = "text"
    block_size: int = 1024
    train_file: str = "train.jsonl"
    val_file: str = "val.jsonl"

    def check(self) -> None:
        _require(self.block_size >= 2, "data.block_size", "must be at least 2")
        _require(bool(self.text_field), "data.text_field", "must name a field")


@dataclasses.dataclass
class TrainSettings:
    batch_size: int = 4
    grad_accum_steps: int = 8  # per optimizer step, summed over all processes (as in train.py)
    max_steps: int = 1000
    learning_rate: float = 2e-4
    lr_scheduler: str = "cosine"
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1337
    parallelism: str = "ddp"  # fsdp: weights, gradients and optimizer state sharded (FSDP2), as in train.py

    def check(self) -> None:
        _require(self.parallelism in config.PARALLELISMS, "train.parallelism",
                 f"must be one of {', '.join(config.PARALLELISMS)}, got {config._show(self.parallelism)}")
        for key in ("batch_size", "grad_accum_steps", "max_steps"):
            _require(getattr(self, key) >= 1, f"train.{key}", "must be at least 1")
        _require(self.learning_rate > 0, "train.learning_rate", "must be positive")
        _require(self.lr_scheduler in SCHEDULERS, "train.lr_scheduler", f"must be one of {', '.join(SCHEDULERS)}")
        _require(self.warmup_steps >= 0, "train.warmup_steps", "must be 0 or more")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be 0 or more")
        _require(self.grad_clip >= 0, "train.grad_clip", "must be 0 (off) or more")


@dataclasses.dataclass
class EvalSettings:
    interval: int = 200  # 0: no evaluation
    max_batches: int = 50

    def check(self) -> None:
        _require(self.interval >= 0, "eval.interval", "must be 0 (off) or more")
        _require(self.max_batches >= 1, "eval.max_batches", "must be at least 1")


@dataclasses.dataclass
class CheckpointSettings:
    interval: int = 100
    keep: int = 3

    def check(self) -> None:
        _require(self.interval >= 1, "checkpoint.interval", "must be at least 1")
        _require(self.keep >= 1, "checkpoint.keep", "must be at least 1 (the newest is never deleted)")


@dataclasses.dataclass
class Settings(config.Groups):
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    train: TrainSettings = dataclasses.field(default_factory=TrainSettings)
    eval: EvalSettings = dataclasses.field(default_factory=EvalSettings)
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    log: config.LogConfig = dataclasses.field(default_factory=config.LogConfig)  # the trainer's own


def load_settings(path: str | Path, overrides: list[str] | tuple = ()) -> Settings:
    """config.py's reading, overrides and coercion, for the fine-tuning groups."""
    raw = config._read_yaml(Path(path))
    for override in overrides:
        config._apply_override(raw, override)
    try:
        groups = {}
        hints = typing.get_type_hints(Settings)
        for group in dataclasses.fields(Settings):
            values = raw.get(group.name) or {}
            if not isinstance(values, dict):
                raise ConfigError(f"{group.name}: expected a mapping of settings, got {config._show(values)}")
            groups[group.name] = config._build(hints[group.name], values, group.name)
        config._reject_unknown(raw, [f.name for f in dataclasses.fields(Settings)], "")
        settings = Settings(**groups)
        settings.check()
        return settings
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


# -- inputs ---------------------------------------------------------------------------------------

def check_model_dir(model_dir: Path) -> None:
    if not (model_dir / "config.json").is_file():
        what = "does not exist" if not model_dir.exists() else "holds no config.json"
        raise ConfigError(f"model snapshot {model_dir} {what}; save one with save_pretrained (or hf download "
                          f"--local-dir) and upload it to S3_MODEL_URI, or fix --model_dir")


def load_texts(data_dir: Path, data: DataSettings) -> tuple[list[str], list[str] | None]:
    """Train and (optional) validation texts from a JSONL file, a folder of them, or a saved dataset."""
    if not data_dir.exists():
        raise ConfigError(f"data {data_dir} does not exist; upload the data to S3_DATA_URI or fix --data_dir")
    if data_dir.is_dir() and ((data_dir / "dataset_dict.json").is_file() or (data_dir / "state.json").is_file()):
        return _texts_of_saved_dataset(data_dir, data.text_field)
    train_path = data_dir if data_dir.is_file() else data_dir / data.train_file
    if not train_path.is_file():
        raise ConfigError(f"{data_dir} holds no {data.train_file} and no dataset saved with save_to_disk; "
                          f"upload one, or set data.train_file")
    val_path = None if data_dir.is_file() else data_dir / data.val_file
    val = _texts_of_jsonl(val_path, data.text_field) if val_path and val_path.is_file() else None
    return _texts_of_jsonl(train_path, data.text_field), val


def _texts_of_jsonl(path: Path, field: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ConfigError(f"{path} line {number} is not JSON; make each line one JSON object") from None
            texts.append(_text_of(record, field, f"{path} line {number}"))
    if not texts:
        raise ConfigError(f"{path} holds no records; give it one JSON object per line")
    return texts


def _text_of(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        fields = ", ".join(sorted(map(str, record))) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where} has no {field!r} field (it has: {fields}); add it, or set data.text_field "
                          f"to the field that holds the text")
    if not isinstance(record[field], str):
        raise ConfigError(f"{where}: {field!r} is {type(record[field]).__name__}, not text; fix the data")
    return record[field]


def _texts_of_saved_dataset(path: Path, field: str) -> tuple[list[str], list[str] | None]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"dataset {path} has no 'train' split (it has: {', '.join(loaded)}); save one")
        val_split = next((loaded[s] for s in ("validation", "val", "test") if s in loaded), None)
        train_split = loaded["train"]
    else:
        train_split, val_split = loaded, None

    def column(split, name):
        if field not in split.column_names:
            raise ConfigError(f"dataset {path} ({name}) has no {field!r} field (it has: "
                              f"{', '.join(split.column_names)}); add it, or set data.text_field to the field "
                              f"that holds the text")
        return list(split[field])

    return column(train_split, "train"), column(val_split, "validation") if val_split is not None else None


def pack(texts: list[str], tokenizer, block_size: int, what: str) -> list[list[int]]:
    """Tokens of every text, each followed by EOS, cut into whole block_size sequences."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for start in range(0, len(texts), 1000):
        for ids in tokenizer(texts[start:start + 1000], add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            stream.extend(eos)
    blocks = len(stream) // block_size
    if blocks == 0:
        raise ConfigError(f"the {what} data holds {len(stream)} tokens, fewer than data.block_size ({block_size}); "
                          f"give more text or lower data.block_size")
    return [stream[i * block_size:(i + 1) * block_size] for i in range(blocks)]


# -- the run --------------------------------------------------------------------------------------

def build(settings: Settings, args: argparse.Namespace, world_size: int, texts: tuple):
    """The model (full or with a LoRA adapter), tokenizer, datasets and Trainer."""
    import datasets
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, PrinterCallback, Trainer,
                              TrainingArguments, default_data_collator, set_seed)

    cuda = torch.cuda.is_available()
    problem = parallelism_problem(settings.train.parallelism, cuda)
    if problem:
        raise ConfigError(problem)
    bf16 = cuda and settings.model.dtype == "bfloat16"
    tokenizer = load_tokenizer(AutoTokenizer, args.model_dir)
    train_texts, val_texts = texts
    block = settings.data.block_size
    train_blocks = pack(train_texts, tokenizer, block, "training")
    use_eval = settings.eval.interval > 0 and val_texts is not None
    val_blocks = pack(val_texts, tokenizer, block, "validation") if use_eval else None

    set_seed(settings.train.seed)  # LoRA's initial A matrices come from the RNG
    # A frozen base can sit in bf16; a fully trained one keeps float32 master weights under bf16 autocast.
    load_dtype = torch.bfloat16 if bf16 and settings.model.method == "lora" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True, dtype=load_dtype)
    if model.config.vocab_size < len(tokenizer):
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{model.config.vocab_size}; use the snapshot's own tokenizer")
    if settings.model.method == "lora":
        model = _with_lora(model, settings.lora)

    local_accum = settings.train.grad_accum_steps // world_size
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=settings.train.max_steps,
        per_device_train_batch_size=settings.train.batch_size,
        per_device_eval_batch_size=settings.train.batch_size,
        gradient_accumulation_steps=local_accum,
        learning_rate=settings.train.learning_rate,
        lr_scheduler_type=settings.train.lr_scheduler,
        warmup_steps=settings.train.warmup_steps,
        weight_decay=settings.train.weight_decay,
        max_grad_norm=settings.train.grad_clip,
        seed=settings.train.seed,
        data_seed=settings.train.seed,
        save_strategy="steps",
        save_steps=settings.checkpoint.interval,
        eval_strategy="steps" if use_eval else "no",
        eval_steps=settings.eval.interval if use_eval else None,
        logging_steps=settings.log.interval,
        report_to="none",  # hf_resume writes TensorBoard events where the pod uploads them
        disable_tqdm=True,
        log_level="warning",
        bf16=bf16,
        use_cpu=not cuda,
        ddp_backend="gloo" if world_size > 1 and not cuda else None,
        dataloader_num_workers=0,
        **checkpointing_argument(TrainingArguments, settings.model.gradient_checkpointing),
        **fsdp_arguments(settings.train.parallelism),
    )
    train_data = datasets.Dataset.from_dict({"input_ids": train_blocks, "labels": train_blocks})
    eval_data = None
    if use_eval:
        rows = settings.eval.max_batches * settings.train.batch_size * world_size
        val_blocks = val_blocks[:rows]
        eval_data = datasets.Dataset.from_dict({"input_ids": val_blocks, "labels": val_blocks})
    trainer = Trainer(model=model, args=training_args, train_dataset=train_data, eval_dataset=eval_data,
                      data_collator=default_data_collator, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # hf_resume logs one line per logging step
    return trainer


def load_tokenizer(auto_tokenizer, model_dir: str):
    """The snapshot's tokenizer; one whose class this transformers does not know (a 5.x snapshot
    names TokenizersBackend, which 4.57 lacks: ValueError; 5.0 fails on an unknown class with
    AttributeError) is bad input, not a crash."""
    import transformers

    try:
        return auto_tokenizer.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, AttributeError) as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(f"the tokenizer in {model_dir} cannot be loaded by transformers {transformers.__version__} "
                          f"({first}); save the snapshot with the transformers the run uses, or use an image with "
                          f"the one that saved it") from None


def checkpointing_argument(arguments_class, on: bool) -> dict:
    """transformers 5.23 renamed gradient_checkpointing to activation_checkpointing (the old name
    warns there; before 5.23 the new one is an unexpected keyword)."""
    names = {field.name for field in dataclasses.fields(arguments_class)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def parallelism_problem(parallelism: str, cuda: bool) -> str | None:
    """accelerate shards a Trainer's model only across GPUs: on CPU it trains with DDP and says nothing."""
    if parallelism == "fsdp" and not cuda:
        return ("train.parallelism: fsdp needs GPUs (accelerate shards a Trainer's model only across GPUs; on "
                "CPU it would train with DDP instead); set train.parallelism: ddp")
    return None


def fsdp_arguments(parallelism: str) -> dict:
    """TrainingArguments for FSDP2 through accelerate: every decoder layer sharded, then the root;
    sharded checkpoints (each rank its DCP shards of the model and the optimizer)."""
    if parallelism != "fsdp":
        return {}
    return {"fsdp": "full_shard", "fsdp_config": {"version": 2, "reshard_after_forward": True,
                                                   "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                   "state_dict_type": "SHARDED_STATE_DICT",
                                                   "cpu_ram_efficient_loading": False}}


def _with_lora(model, lora: LoraSettings):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("model.method is lora but peft is not installed; add peft to requirements.txt "
                          "or set model.method=full") from None
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=lora.modules(), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, peft_config)
    except ValueError as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(f"lora.target_modules={lora.target_modules!r} does not fit this model ({first}); "
                          f"name its linear layers or use all-linear") from None


def check_resumable(folder: str | None, settings: Settings) -> None:
    """A checkpoint resumes only the method it was trained with (an adapter is not full weights)."""
    if folder is None:
        return
    import checkpoint

    meta = (checkpoint.read_manifest(Path(folder)) or {}).get("meta", {})
    method = meta.get("method")
    if method and method != settings.model.method:
        raise ConfigError(f"checkpoint {Path(folder).name} was trained with model.method={method} but the config "
                          f"says {settings.model.method}; use the config it was trained with, or a new S3_OUTPUT_URI")


def run(settings: Settings, args: argparse.Namespace, world_size: int, texts: tuple) -> int:
    import hf_resume
    import transformers

    transformers.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()  # one line per log step is ours
    trainer = build(settings, args, world_size, texts)
    train = settings.train
    resume = hf_resume.attach(trainer, keep=settings.checkpoint.keep, meta={"method": settings.model.method},
                              tokens_per_step=train.batch_size * train.grad_accum_steps * settings.data.block_size)
    folder = resume.checkpoint()
    check_resumable(folder, settings)
    if int(os.environ.get("RANK", 0)) == 0:
        model = trainer.model
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log(f"{settings.model.method} fine-tune of {args.model_dir}: {trainable:,} of {total:,} "
            f"parameters trained, {world_size} process(es), steps to {settings.train.max_steps}")
    try:
        trainer.train(resume_from_checkpoint=folder)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # the next pod would fail the same way
            raise ConfigError(f"no space left in {args.output_dir} for a checkpoint; give the workspace volume "
                              f"more room (emptyDir sizeLimit) or lower checkpoint.keep "
                              f"({settings.checkpoint.keep})") from None
        raise
    code = resume.exit_code()
    if code == 0 and int(os.environ.get("RANK", 0)) == 0:
        log(f"done: step {trainer.state.global_step}")
    return code


def report_bad_input(err: Exception) -> int:
    """One line, and torchelastic's error file, so torchrun's exit carries code 64."""
    return config.report_failure(str(err), int(os.environ.get("RANK", 0)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML settings, e.g. config/finetune.yaml")
    parser.add_argument("--model_dir", required=True, help="a local model snapshot (config.json, weights, tokenizer)")
    parser.add_argument("--data_dir", required=True, help="a JSONL file, a folder with data.train_file, or a saved dataset")
    parser.add_argument("--output_dir", required=True, help="checkpoints/, tensorboard/, progress.json go here")
    parser.add_argument("--set", action="append", default=[], metavar="GROUP.KEY=VALUE",
                        help="override one setting (repeatable)")
    parser.add_argument("--check", action="store_true",
                        help="only check the config, these arguments and the libraries: exit 0 or 64")
    return parser.parse_args(argv)


def check_libraries(settings: Settings) -> None:
    import importlib.util

    needed = ["transformers", "accelerate", "datasets"] + (["peft"] if settings.model.method == "lora" else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not installed; add them to the code's requirements.txt "
                          f"(the pod installs versions in job/constraints.txt's range) or to the image")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        settings = load_settings(args.config, args.set)
        check_libraries(settings)
        settings.check_world_size(world_size)
        if args.check:
            return 0
        check_model_dir(Path(args.model_dir))
        texts = load_texts(Path(args.data_dir), settings.data)  # bad data fails before any process group
    except ConfigError as err:
        return report_bad_input(err)
    import hf_resume

    try:
        return run(settings, args, world_size, texts)
    except (ConfigError, hf_resume.CheckpointLayoutError) as err:
        return report_bad_input(err)


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as train.py: gloo's threads can abort in interpreter finalization
