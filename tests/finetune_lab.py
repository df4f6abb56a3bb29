"""Builders for the fine-tuning tests: a tiny random causal LM with a tokenizer trained here, saved
as a local snapshot, and JSONL data. Nothing comes from a hub."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("river stone light paper cloud garden window morning quiet silver engine market bridge "
         "winter orange letter forest candle harbor signal").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + "." for _ in range(count)]


def make_snapshot(folder: Path) -> Path:
    """A 2-layer Llama with a byte-level BPE tokenizer trained on the test corpus."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(sentences(400), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>",
                                        pad_token="<pad>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.1, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_jsonl(folder: Path, count: int, field: str = "text") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as file:
        for text in sentences(count, seed=1):
            file.write(json.dumps({field: text}) + "\n")
    with open(folder / "val.jsonl", "w") as file:
        for text in sentences(40, seed=2):
            file.write(json.dumps({field: text}) + "\n")
    return folder
