"""train.py's data check before the first step (config.check_data): every way train.bin, val.bin
and meta.json can be unusable gets one line naming the file and the fix (exit 64 in train.py);
good data, as scripts/prepare_data.py writes it, passes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import config


def make_data(folder: Path, train=None, val=None, meta: dict | None = None, block_size: int = 8) -> config.Config:
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.arange(200, dtype="<u2") % 256
    for name, tokens in (("train.bin", train), ("val.bin", val)):
        (folder / name).write_bytes(tokens if isinstance(tokens, bytes) else
                                    (ids if tokens is None else np.asarray(tokens, dtype="<u2")).tobytes())
    if meta is not None:
        (folder / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    cfg = config.Config()
    cfg.model.vocab_size, cfg.model.block_size = 256, block_size
    return cfg


def test_data_as_prepare_data_writes_it_passes(tmp_path):
    cfg = make_data(tmp_path, meta={"vocab_size": 256, "dtype": "uint16", "train_tokens": 200, "val_tokens": 200})
    config.check_data(tmp_path, cfg)


BAD = [
    ("a token id past vocab_size", {"train": [1, 2, 300, 4] * 50},
     "train.bin holds token id 300 (token 2), but model.vocab_size is 256; set model.vocab_size to at least 301"),
    ("an odd number of bytes", {"val": bytes(401)},
     "val.bin is 401 bytes, not a whole number of 2-byte (uint16) token ids"),
    ("too few tokens for one block", {"train": [1] * 9},
     "train.bin holds 9 tokens, fewer than model.block_size+2 (10)"),
    ("another dtype in meta.json", {"meta": {"vocab_size": 256, "dtype": "uint32"}},
     "meta.json says the token ids are 'uint32', but the trainer reads uint16"),
    ("meta.json that is not JSON", {"meta": "{vocab"}, "meta.json is not a JSON object"),
    ("meta.json nested deeper than the parser goes", {"meta": "[" * 100_000}, "meta.json is not a JSON object"),
    ("a vocab_size that is not a number", {"meta": {"vocab_size": "big"}}, "meta.json: vocab_size is 'big'"),
    ("a larger vocabulary than the model's", {"meta": {"vocab_size": 50257}},
     "model.vocab_size (256) is smaller than the data's vocabulary (50257"),
    ("a token count meta.json does not vouch for", {"meta": {"vocab_size": 256, "train_tokens": 400}},
     "train.bin holds 200 tokens but meta.json says 400"),
]


@pytest.mark.parametrize("case,data,message", BAD, ids=[b[0] for b in BAD])
def test_unusable_data_is_bad_input_naming_the_file_and_the_fix(tmp_path, case, data, message):
    cfg = make_data(tmp_path, **data)
    with pytest.raises(config.ConfigError) as raised:
        config.check_data(tmp_path, cfg)
    assert message in str(raised.value) and str(tmp_path) in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_id_scan_finds_an_id_in_a_later_chunk_and_names_the_largest(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "SCAN_TOKENS", 16)  # 200 ids: 13 chunks
    train = [5] * 200
    train[150], train[190] = 260, 999
    cfg = make_data(tmp_path, train=train)
    with pytest.raises(config.ConfigError, match=r"token id 260 \(token 150\).* at least 1000"):
        config.check_data(tmp_path, cfg)
