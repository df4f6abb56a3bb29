"""GPT.empty, the model a resumed trainer builds for its checkpoint to fill: the same parameters in
the same order with the embedding still tied to the output, so the checkpoint's weights and the
optimizer's state (indexed by that order) load into it exactly as into a freshly drawn model."""

import copy

import torch

import config
from model import GPT

TINY = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 32, "dropout": 0.0}}


def tiny_model_config():
    return config.from_dict(TINY).model


def test_empty_has_the_drawn_models_parameters_in_order_and_stays_tied():
    drawn, empty = GPT(tiny_model_config()), GPT.empty(tiny_model_config(), torch.device("cpu"))
    assert [(n, p.shape) for n, p in empty.named_parameters()] == \
        [(n, p.shape) for n, p in drawn.named_parameters()]
    assert empty.transformer.wte.weight is empty.lm_head.weight
    assert all(p.device.type == "cpu" for p in empty.parameters())


def test_a_checkpoint_loaded_into_empty_trains_bitwise_like_one_loaded_into_a_drawn_model():
    torch.manual_seed(0)
    source = GPT(tiny_model_config())
    source_optimizer = source.make_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    tokens = torch.randint(0, 32, (2, 8))
    source(tokens, tokens)[1].backward()
    source_optimizer.step()
    weights, optimizer_state = source.state_dict(), source_optimizer.state_dict()

    def resumed(model: GPT) -> list[torch.Tensor]:
        model.load_state_dict(copy.deepcopy(weights))
        optimizer = model.make_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
        optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # a step updates it in place
        model(tokens, tokens)[1].backward()
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(1)  # another draw than the source's: it must not matter
    after_drawn = resumed(GPT(tiny_model_config()))
    after_empty = resumed(GPT.empty(tiny_model_config(), torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(after_drawn, after_empty, strict=True))
