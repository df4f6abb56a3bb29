"""The training config: every error names the key and the fix; the shipped configs load; the
learning-rate schedule. Pure: no torch process, no S3."""

from __future__ import annotations

import pytest

import config
from podlab import ROOT, write_config
from train import lr_at


CONFIG_ERRORS = [
    ("unknown key", "model:\n  n_layers: 2\n", "unknown setting model.n_layers; did you mean model.n_layer?"),
    ("unknown group", "modle:\n  n_layer: 2\n", "unknown setting modle; did you mean model?"),
    # a key of a config from the bucket, quoted on the pod's log and a laptop's terminal: never an escape
    ("a key that is a terminal escape", 'train:\n  "\\e]0;x\\a": 1\n', "unknown setting train.\\x1b]0;x\\x07; known:"),
    ("wrong type int", "model:\n  n_layer: two\n", "model.n_layer must be an integer"),
    ("float for int", "train:\n  max_steps: 10.5\n", "train.max_steps must be an integer"),
    ("wrong type float", "train:\n  learning_rate: fast\n", "train.learning_rate must be a number"),
    ("wrong type bool", "system:\n  compile: maybe\n", "system.compile must be true or false"),
    ("group not a mapping", "model: 3\n", "model: expected a mapping"),
    ("not a mapping", "- a\n- b\n", "expected a mapping of setting groups"),
    ("yaml syntax", "model:\n  n_layer: [1, 2\n", "YAML syntax error at line"),
    ("heads do not divide", "model:\n  n_embd: 100\n  n_head: 3\n", "model.n_embd (100) must be divisible by model.n_head (3)"),
    ("zero layers", "model:\n  n_layer: 0\n", "model.n_layer must be at least 1"),
    ("vocab too big", "model:\n  vocab_size: 70000\n", "model.vocab_size must be between 2 and 65536"),
    ("dropout", "model:\n  dropout: 1.5\n", "model.dropout must be in [0, 1)"),
    ("min lr above lr", "train:\n  min_lr: 1.0\n", "train.min_lr must be between 0 and train.learning_rate"),
    ("negative warmup", "train:\n  warmup_steps: -1\n", "train.warmup_steps must be 0 or more"),
    ("beta", "train:\n  beta2: 1.0\n", "train.beta2 must be in [0, 1)"),
    ("parallelism", "train:\n  parallelism: zero3\n", "train.parallelism must be one of ddp, fsdp, got 'zero3'"),
    ("eval not multiple", "eval:\n  interval: 15\ncheckpoint:\n  interval: 10\n", "eval.interval (15) must be a multiple of checkpoint.interval (10)"),
    ("keep zero", "checkpoint:\n  keep: 0\n", "checkpoint.keep must be at least 1"),
    ("dtype", "system:\n  dtype: fp8\n", "system.dtype must be bfloat16 or float32"),
]


@pytest.mark.parametrize("case,text,message", CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS])
def test_config_error_names_the_key_and_the_fix(tmp_path, case, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as err:
        config.load(path)
    assert message in str(err.value)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_config_defaults_are_gpt2_124m_and_shipped_configs_load():
    cfg = config.load(ROOT / "config" / "conf.yaml")
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (12, 12, 768, 1024)
    cfg.check_world_size(4)
    smoke = config.load(ROOT / "config" / "smoke.yaml")
    smoke.check_world_size(1), smoke.check_world_size(2)


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write_config(tmp_path / "c.yaml")
    assert config.load(path, ["train.max_steps=7"]).train.max_steps == 7
    for bad, message in [("train.max_steps", "is not group.key=value"),
                         ("train.max_step=7", "unknown setting train.max_step"),
                         ("train.max_steps=seven", "train.max_steps must be an integer")]:
        with pytest.raises(config.ConfigError, match=message.replace(".", r"\.")):
            config.load(path, [bad])


def test_grad_accum_must_divide_over_the_processes(tmp_path):
    cfg = config.load(write_config(tmp_path / "c.yaml", train__grad_accum_steps=3))
    with pytest.raises(config.ConfigError, match="train.grad_accum_steps .3. must be divisible by the number of processes .2."):
        cfg.check_world_size(2)


def test_learning_rate_warms_up_then_decays_to_min_lr():
    train = config.TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_steps=10, max_steps=100)
    assert lr_at(1, train) == pytest.approx(0.1)
    assert lr_at(10, train) == pytest.approx(1.0)
    assert lr_at(55, train) == pytest.approx(0.55)
    assert lr_at(100, train) == pytest.approx(0.1)
    assert lr_at(150, train) == pytest.approx(0.1)
