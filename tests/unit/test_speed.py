"""train.py's speed settings (code/speed.py, code/model.py): each is checked as bad input, the
chunked loss and joined micro-batches compute the same step as the default path up to rounding,
the micro-batch probe's choice, and the probe leaves the RNG as it found it. In-process, CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import config
import speed
from model import GPT, chunked_cross_entropy
from podlab import write_config, write_corpus
from train import Batches

SPEED_ERRORS = [
    ("micro_batch not a multiple", ["train.batch_size=8", "train.micro_batch=12"],
     "train.micro_batch must be 0 (train.batch_size), auto, or a multiple of train.batch_size (8), got 12"),
    ("micro_batch a word", ["train.micro_batch=big"], "train.micro_batch must be an integer or auto, got 'big'"),
    ("micro_batch true", ["train.micro_batch=true"], "train.micro_batch must be an integer or auto, got True"),
    ("attention", ["model.attention=fast"], "model.attention must be one of auto, flash, efficient, cudnn, math"),
    ("loss chunk", ["model.loss_chunk_tokens=-1"], "model.loss_chunk_tokens must be 0 (off) or more"),
    ("compile mode", ["system.compile_mode=fastest"], "system.compile_mode must be one of default, reduce-overhead"),
    ("inductor", ["system.inductor=max autotune"], "system.inductor must be torch._inductor.config flag names"),
]


@pytest.mark.parametrize("case,overrides,message", SPEED_ERRORS, ids=[c[0] for c in SPEED_ERRORS])
def test_each_speed_setting_is_checked_and_the_error_names_it(tmp_path, case, overrides, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(write_config(tmp_path / "c.yaml"), overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_micro_batch_must_divide_each_process_micro_steps_and_the_error_suggests_one(tmp_path):
    cfg = config.load(write_config(tmp_path / "c.yaml"), ["train.batch_size=12", "train.grad_accum_steps=40",
                                                          "train.micro_batch=48"])
    cfg.check_world_size(1)  # 40 micro-steps, 4 a pass
    with pytest.raises(config.ConfigError, match=r"train.micro_batch \(48\) must be .* \(10: .* 4 processes\); "
                                                 r"e.g. 24, or auto"):
        cfg.check_world_size(4)


def test_the_defaults_are_the_behaviour_before_the_settings():
    cfg = config.Config()
    assert (cfg.train.micro_batch, cfg.train.micro_multiple(), cfg.model.attention, cfg.model.loss_chunk_tokens,
            cfg.system.compile_mode, cfg.system.inductor_flags()) == (0, 1, "auto", 0, "default", [])
    model = torch.nn.Linear(2, 2)
    assert speed.compiled(model, cfg.system) is model  # compile off: the model itself


@pytest.mark.parametrize("rows,chunk", [(37, 10), (40, 40), (40, 64), (9, 1)])
def test_the_chunked_loss_has_the_value_and_gradients_of_cross_entropy(rows, chunk):
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (rows,))
    expected = F.cross_entropy(hidden @ weight.t(), targets)
    (3 * expected).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss = chunked_cross_entropy(hidden, weight, targets, chunk)
    (3 * loss).backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, grads[0], atol=1e-6) and torch.allclose(weight.grad, grads[1], atol=1e-6)
    with torch.no_grad():
        assert chunked_cross_entropy(hidden, weight, targets, chunk).item() == pytest.approx(expected.item(), rel=1e-6)


def tiny_model(**model) -> GPT:
    torch.manual_seed(0)
    return GPT(config.ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, **model))


def loss_and_grads(model: GPT, x, y) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("setting", [{"loss_chunk_tokens": 24}, {"attention": "math"}, {"attention": "flash"}])
def test_a_model_with_a_speed_setting_computes_the_default_model_step(setting):
    x, y = torch.randint(0, 64, (2, 3, 16))
    expected = loss_and_grads(tiny_model(), x, y)
    got = loss_and_grads(tiny_model(**setting), x, y)
    assert got[0] == pytest.approx(expected[0], rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got[1], expected[1]))


def test_attention_kernels_a_cpu_lacks_are_bad_input():
    cfg = config.Config(model=config.ModelConfig(attention="cudnn"))
    with pytest.raises(config.ConfigError, match="model.attention=cudnn needs a CUDA GPU"):
        speed.check_device(cfg, torch.device("cpu"))
    speed.check_device(config.Config(model=config.ModelConfig(attention="flash")), torch.device("cpu"))


def test_joined_micro_batches_hold_the_same_sequences_and_compute_the_same_step(tmp_path):
    data = write_corpus(tmp_path / "data")
    cfg = config.load(write_config(tmp_path / "c.yaml"), ["model.dropout=0.0", "train.batch_size=4"])
    batches = Batches(str(data), cfg, torch.device("cpu"))
    parts = [batches.train(5, micro) for micro in range(4)]
    x, y = batches.train_joined(5, range(0, 4))
    assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
    model = GPT(cfg.model)
    separate = [loss_and_grads(model, px, py)[1] for px, py in parts]
    summed = [sum(grads) / len(parts) for grads in zip(*separate)]  # the default path's step
    _, joined = loss_and_grads(model, x, y)  # one pass of the four: its mean already weighs them
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(joined, summed))


@pytest.mark.parametrize("local_steps,expected", [(1, [1]), (10, [1, 2, 5, 10]), (40, [1, 2, 4, 8, 20, 40]),
                                                  (7, [1, 7])])
def test_the_probe_tries_divisors_of_the_micro_steps_about_doubling(local_steps, expected):
    assert speed.multiples(local_steps) == expected


@pytest.mark.parametrize("peaks,cap,chosen,tried", [
    ({1: 10, 2: 20, 4: 40, 8: 80}, 50, 4, [1, 2, 4, 8]),  # over the cap at 8: back to 4
    ({1: 10, 2: 20, 4: None}, 50, 2, [1, 2, 4]),  # out of memory at 4
    ({1: 10, 2: 20, 4: 40, 8: 80}, 100, 8, [1, 2, 4, 8]),  # every one fits
    ({1: None}, 50, 1, [1]),  # nothing fits: batch_size, as without the probe
])
def test_the_probe_takes_the_last_multiple_under_the_cap_and_stops_at_the_first_over(peaks, cap, chosen, tried):
    got, record = speed.choose([1, 2, 4, 8], lambda k: peaks[k], cap)
    assert got == chosen and [k for k, _ in record] == tried


def test_auto_on_a_cpu_is_the_batch_size_and_a_fixed_micro_batch_needs_no_probe(tmp_path):
    lines = []
    cfg = config.load(write_config(tmp_path / "c.yaml"), ["train.micro_batch=auto"])
    assert speed.micro_multiple(cfg, torch.device("cpu"), 4, None, lines.append) == 1
    assert "train.micro_batch auto: 8 sequences per forward pass (train.batch_size) on cpu" in lines[0]
    fixed = config.load(write_config(tmp_path / "c.yaml"), ["train.micro_batch=16"])
    assert speed.micro_multiple(fixed, torch.device("cpu"), 4, lambda k: pytest.fail("probed"), lines.append) == 2


def test_a_probe_step_grows_with_the_batch_and_leaves_the_rng_and_gradients_as_they_were():
    model = tiny_model(dropout=0.5)
    peak_of = speed.saved_bytes_peak(model, (2, 16), 64)
    before = torch.get_rng_state()
    peaks = [peak_of(k) for k in (1, 2, 4)]
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())
    assert peaks[0] < peaks[1] < peaks[2]


def test_inductor_flags_are_set_and_an_unknown_one_is_bad_input():
    import torch._inductor.config as inductor

    with inductor.patch(coordinate_descent_tuning=False):
        speed.set_inductor_flags(["coordinate_descent_tuning"])
        assert inductor.coordinate_descent_tuning is True
    with pytest.raises(config.ConfigError, match="no on/off flag torch._inductor.config.no_such_flag"):
        speed.set_inductor_flags(["no_such_flag"])
    with pytest.raises(config.ConfigError, match="no on/off flag"):
        speed.set_inductor_flags(["max_autotune_gemm_backends"])  # a string, not a flag


@pytest.mark.parametrize("saved,probed,kept", [
    (24, 4, 2),           # the checkpoint's 2 batches a pass: it fits under the probe's 4, so it is kept
    (48, 4, 4),           # its 4 fit: kept (the same as the probe's)
    (96, 4, 4),           # 8 batches a pass: more than this GPU fits, the probe's
    (36, 4, 4),           # 3 batches a pass does not divide 8 micro-steps: the probe's
    (20, 4, 4),           # not a whole number of batches: the probe's
    (None, 4, 4), (True, 4, 4), ("24", 4, 4), (-12, 4, 4), (0, 4, 4), (2.0 * 12, 4, 4),  # as read from a bucket
])
def test_auto_on_resume_keeps_the_checkpoint_micro_batch_only_where_it_fits(saved, probed, kept):
    assert speed.kept_on_resume(saved, 12, probed, 8) == kept


def test_a_resume_that_keeps_the_checkpoint_micro_batch_says_so_and_one_that_cannot_warns():
    kept, line = speed.resumed_multiple(24, 12, 4, 8)
    assert kept == 2 and line.startswith("train.micro_batch auto: 24 sequences per forward pass, as the checkpoint ran")
    assert "train.micro_batch=48 takes it" in line and "warning" not in line
    assert speed.resumed_multiple(48, 12, 4, 8) == (4, None), "the probe's own choice: nothing to say"
    kept, line = speed.resumed_multiple(96, 12, 4, 8)
    assert kept == 4 and line.startswith("warning: train.micro_batch auto: the checkpoint ran 96 sequences")
    assert "takes 48" in line and "not be bitwise" in line and "\n" not in line
    kept, line = speed.resumed_multiple(None, 12, 4, 8)
    assert kept == 4 and line.startswith("warning: train.micro_batch auto: the checkpoint does not say how many "
                                         "sequences per forward pass it ran, this start takes 48")


@pytest.mark.parametrize("state,expected", [
    ({"micro_batch": 96, "config": {"train": {"batch_size": 12, "micro_batch": 0}}}, 96),
    ({"config": {"train": {"batch_size": 12, "micro_batch": 0}}}, 12),      # from before it was recorded
    ({"config": {"train": {"batch_size": 12}}}, 12),                        # from before micro_batch existed
    ({"config": {"train": {"batch_size": 12, "micro_batch": 48}}}, 48),
    ({"config": {"train": {"batch_size": 12, "micro_batch": "auto"}}}, None),  # what auto took is unknown
    # what a bucket writer put there: never a crash, never a value that is not a count
    ({"micro_batch": torch.ones(3), "config": {"train": {"batch_size": 12}}}, 12),
    ({"micro_batch": True}, None), ({"micro_batch": -12}, None), ({"config": "x"}, None),
    ({"config": {"train": {"batch_size": "12", "micro_batch": 0}}}, None), ({"config": {"train": []}}, None),
    (None, None), ([], None),
])
def test_the_checkpoint_micro_batch_is_read_as_an_untrusted_count(state, expected):
    assert speed.saved_micro_batch(state) == expected


@pytest.mark.parametrize("mode,device,passes,refused", [
    ("reduce-overhead", "cuda", 2, True),
    ("max-autotune", "cuda", 10, True),
    ("reduce-overhead", "cuda", 1, False),    # one backward a step: nothing is summed over replays
    ("max-autotune-no-cudagraphs", "cuda", 10, False),
    ("default", "cuda", 10, False),
    ("reduce-overhead", "cpu", 10, False),    # no CUDA graphs off a GPU
])
def test_cuda_graphs_with_several_backward_passes_a_step_are_bad_input(tmp_path, mode, device, passes, refused):
    cfg = config.load(write_config(tmp_path / "c.yaml"), [f"system.compile_mode={mode}", "system.compile=true"])
    if not refused:
        speed.check_cuda_graphs(cfg.system, torch.device(device), passes, 480)
        return
    with pytest.raises(config.ConfigError) as err:
        speed.check_cuda_graphs(cfg.system, torch.device(device), passes, 480)
    line = str(err.value)
    assert line.startswith(f"system.compile_mode={mode} replays CUDA graphs") and "\n" not in line
    assert f"over its {passes} forward passes a step" in line
    assert line.endswith("use max-autotune-no-cudagraphs, or train.micro_batch=480 (one pass a step)")
