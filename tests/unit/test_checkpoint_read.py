"""A resuming trainer reads model.pt and state.pt through memory maps (train.read_tensors,
train.load_optimizer_state) and keeps none of the maps once it has used what they held: its optimizer state lives in its own memory, so a rotated checkpoint's blocks are
freed and the steps after the resume are the ones an uninterrupted run takes."""

import copy
from pathlib import Path

import torch

import config
from model import GPT
from train import load_optimizer_state, read_tensors

TINY = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 32, "dropout": 0.0}}
CPU = torch.device("cpu")


def tiny_model():
    return GPT(config.from_dict(TINY).model)


def trained_one_step(tokens):
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = model.make_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    model(tokens, tokens)[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def mapped_files() -> set[str]:
    return {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(maxsplit=5)) == 6}


def resume(folder: Path) -> tuple[GPT, torch.optim.Optimizer]:
    model = GPT.empty(config.from_dict(TINY).model, CPU)
    model.load_state_dict(read_tensors(folder / "model.pt", CPU))
    optimizer = model.make_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    rest = load_optimizer_state(optimizer, folder / "state.pt")
    torch.set_rng_state(rest["rng"])  # as restore_rng does, and then the trainer lets go of `rest`
    assert rest["step"] == 1
    return model, optimizer


def copied(model: GPT, optimizer: torch.optim.Optimizer) -> tuple[GPT, torch.optim.Optimizer]:
    """The source as an uninterrupted run goes on with it."""
    model = copy.deepcopy(model)
    fresh = model.make_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return model, fresh


def step(model, optimizer, tokens) -> list[torch.Tensor]:
    model(tokens, tokens)[1].backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_resumed_trainer_holds_no_map_of_its_checkpoint_and_steps_as_the_source_does(tmp_path):
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    source, source_optimizer = trained_one_step(tokens)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    torch.save({"optimizer": source_optimizer.state_dict(), "rng": torch.get_rng_state(), "step": 1},
               tmp_path / "state.pt")
    uninterrupted = step(*copied(source, source_optimizer), tokens)

    model, optimizer = resume(tmp_path)

    still_mapped = {str(tmp_path / "model.pt"), str(tmp_path / "state.pt")} & mapped_files()
    assert not still_mapped
    assert all(torch.equal(a, b) for a, b in zip(step(model, optimizer, tokens), uninterrupted, strict=True))
