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


def make_snapshot(folder: Path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                  positions: int = 64) -> Path:
    """A random Llama (2 layers of 32 unless told) with a byte-level BPE tokenizer trained on the
    test corpus (lab/bench_gpu.py makes a larger one)."""
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
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=positions,
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
