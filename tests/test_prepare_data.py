"""scripts/prepare_data.py, run as the user runs it: a subprocess on a tiny corpus made here.

Nothing is downloaded: the datasets and the tokenizer are built in tmp_path.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from podlab import ROOT

SCRIPT = ROOT / "scripts" / "prepare_data.py"
EXIT_BAD_INPUT = 64
EOT = "<|endoftext|>"
WORDS = ["the", "model", "trains", "on", "text", "café", "naïve", "日本語", "data", "loss", "step",
         "resume", "bucket", "token", "€uro", "pod", "checkpoint", "a", "of", "and"]


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Non-ASCII words, \\r\\n and tabs included, so a byte round trip has something to get wrong."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(rng.randint(2, 6))]
        ending = rng.choice(["\n", "\r\n", "\t\n"])
        documents.append(ending.join(lines) + ending)
    return documents


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def prepare_ok(*args: str) -> subprocess.CompletedProcess:
    result = run_prepare(*args)
    assert result.returncode == 0, result.stderr
    return result


def read_split(out: Path, name: str) -> np.ndarray:
    return np.memmap(out / f"{name}.bin", dtype=np.uint16, mode="r")


def read_meta(out: Path) -> dict:
    return json.loads((out / "meta.json").read_text())


def all_tokens(out: Path) -> np.ndarray:
    return np.concatenate([read_split(out, "train"), read_split(out, "val")])


def decoded_bytes(out: Path) -> str:
    return all_tokens(out).astype(np.uint8).tobytes().decode("utf-8")


def assert_byte_meta(out: Path, total_tokens: int, val_fraction: float) -> None:
    meta = read_meta(out)
    assert meta == {
        "vocab_size": 256, "tokenizer": "byte", "eot_token": None, "dtype": "uint16",
        "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"],
    }
    assert meta["train_tokens"] + meta["val_tokens"] == total_tokens
    assert meta["val_tokens"] == round(total_tokens * val_fraction)
    assert len(read_split(out, "train")) == meta["train_tokens"]
    assert len(read_split(out, "val")) == meta["val_tokens"]


def assert_only_outputs(out: Path) -> None:
    """No temporary files left behind next to the three outputs."""
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes("".join(make_documents(40)).encode("utf-8"))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE with an eos token, saved the way save_pretrained saves a real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(make_documents(200, seed=1), trainer)
    directory = tmp_path_factory.mktemp("tokenizers") / "tiny-bpe"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOT).save_pretrained(directory)
    return directory


# --- inputs that work ------------------------------------------------------------------------


def test_text_file_byte_level_round_trip(tmp_path, corpus_file):
    out = tmp_path / "out"
    result = prepare_ok("--input", str(corpus_file), "--out", str(out), "--val_fraction", "0.2")

    assert decoded_bytes(out) == corpus_file.read_bytes().decode("utf-8")
    assert_byte_meta(out, total_tokens=corpus_file.stat().st_size, val_fraction=0.2)
    assert_only_outputs(out)
    assert "documents 1," in result.stdout and "train" in result.stdout and result.stderr == ""


def test_rerun_replaces_outputs(tmp_path, corpus_file):
    out = tmp_path / "out"
    prepare_ok("--input", str(corpus_file), "--out", str(out))
    corpus_file.write_text("a shorter corpus\n" * 5, encoding="utf-8", newline="")
    prepare_ok("--input", str(corpus_file), "--out", str(out))

    assert decoded_bytes(out) == "a shorter corpus\n" * 5
    assert_only_outputs(out)


def test_directory_of_text_files_in_name_order(tmp_path):
    documents = make_documents(3)
    source = tmp_path / "texts"
    source.mkdir()
    for name, text in zip(["b.txt", "10.txt", "a.txt"], documents):
        (source / name).write_bytes(text.encode("utf-8"))
    (source / "notes.md").write_text("not a .txt file, so not read\n")
    (source / "empty.txt").write_text("")
    out = tmp_path / "out"
    result = prepare_ok("--input", str(source), "--out", str(out))

    by_name = documents[1] + documents[2] + documents[0]  # 10.txt, a.txt, b.txt
    assert decoded_bytes(out) == by_name
    assert_byte_meta(out, total_tokens=len(by_name.encode("utf-8")), val_fraction=0.1)
    assert "documents 3," in result.stdout


def test_saved_dataset_with_text_field(tmp_path):
    import datasets

    documents = make_documents(30)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": documents, "label": list(range(30))}).save_to_disk(str(saved))
    out = tmp_path / "out"
    prepare_ok("--input", str(saved), "--out", str(out), "--text_field", "body")

    assert decoded_bytes(out) == "".join(documents)
    assert_byte_meta(out, total_tokens=len("".join(documents).encode("utf-8")), val_fraction=0.1)


def test_saved_dataset_dict_split(tmp_path):
    import datasets

    train_docs, validation_docs = make_documents(20, seed=2), make_documents(10, seed=3)
    saved = tmp_path / "saved_dict"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": train_docs}),
        "validation": datasets.Dataset.from_dict({"text": validation_docs}),
    }).save_to_disk(str(saved))
    out = tmp_path / "out"
    prepare_ok("--input", str(saved), "--out", str(out), "--split", "validation")

    assert decoded_bytes(out) == "".join(validation_docs)


def test_local_tokenizer_round_trip_and_eot(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    documents = make_documents(12, seed=4)
    source = tmp_path / "texts"
    source.mkdir()
    for index, text in enumerate(documents):
        (source / f"doc{index:02d}.txt").write_bytes(text.encode("utf-8"))
    out = tmp_path / "out"
    prepare_ok("--input", str(source), "--out", str(out), "--tokenizer", str(tokenizer_dir),
               "--val_fraction", "0.25")

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    meta = read_meta(out)
    assert meta["vocab_size"] == len(tokenizer) and meta["tokenizer"] == "tiny-bpe"
    assert meta["eot_token"] == tokenizer.eos_token_id and meta["dtype"] == "uint16"
    tokens = all_tokens(out).tolist()
    assert len(tokens) == meta["train_tokens"] + meta["val_tokens"]
    assert max(tokens) < meta["vocab_size"]
    # Exactly one eot after every document, and each stretch between them decodes to its document.
    eot = meta["eot_token"]
    assert tokens[-1] == eot and tokens.count(eot) == len(documents)
    stretches = np.split(np.array(tokens[:-1]), np.flatnonzero(np.array(tokens[:-1]) == eot))
    decoded = [tokenizer.decode([t for t in stretch if t != eot]) for stretch in stretches]
    assert decoded == documents


def load_script_module():
    spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("use_tokenizer", [False, True], ids=["byte", "tokenizer"])
def test_documents_read_in_many_blocks_and_batches(tmp_path, tokenizer_dir, monkeypatch, use_tokenizer):
    """Real corpora span many blocks and batches; tiny limits make this one do so too (in-process)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")  # main() would set them for good in this process otherwise
    prepare_data = load_script_module()
    monkeypatch.setattr(prepare_data, "TEXT_BLOCK_CHARS", 7)
    monkeypatch.setattr(prepare_data, "BATCH_CHARS", 50)
    monkeypatch.setattr(prepare_data, "BATCH_PIECES", 3)
    documents = make_documents(6, seed=5)
    source = tmp_path / "texts"
    source.mkdir()
    for index, text in enumerate(documents):
        (source / f"doc{index}.txt").write_bytes(text.encode("utf-8"))
    out = tmp_path / "out"
    tokenizer_args = ["--tokenizer", str(tokenizer_dir)] if use_tokenizer else []

    assert prepare_data.main(["--input", str(source), "--out", str(out), *tokenizer_args]) == 0

    if not use_tokenizer:
        assert decoded_bytes(out) == "".join(documents)
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tokens = all_tokens(out)
    ends = np.flatnonzero(tokens == tokenizer.eos_token_id)
    assert len(ends) == len(documents)  # one eot per document, not one per block
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert [tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends)] == documents


def peak_memory_mb(tmp_path: Path, text_mb: int) -> float:
    """Peak RSS of prepare_data.py on a text file of `text_mb` MB (byte tokens: 2 bytes each)."""
    corpus = tmp_path / f"corpus-{text_mb}.txt"
    corpus.write_text(("the quick brown fox jumps over the lazy dog\n" * 23_832) * text_mb)
    out = tmp_path / f"out-{text_mb}"
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent's memory across exec.
    report = ("import re, runpy, sys; sys.argv = sys.argv[1:]\n"
              "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
              "except SystemExit as end:\n    assert not end.code, end.code\n"
              "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
    result = subprocess.run([sys.executable, "-c", report, str(SCRIPT), "--input", str(corpus), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert read_meta(out)["train_tokens"] + read_meta(out)["val_tokens"] == corpus.stat().st_size
    return int(result.stdout.splitlines()[-1]) / 1024


def test_memory_stays_flat_however_big_the_corpus(tmp_path):
    small, big = peak_memory_mb(tmp_path, 1), peak_memory_mb(tmp_path, 96)
    # Holding the tokens would take 192 MB more for 96 MB of text; they go to disk as they come.
    assert big - small < 40, f"peak RSS {small:.0f} MB for 1 MB of text, {big:.0f} MB for 96 MB"


# --- bad input -------------------------------------------------------------------------------


def missing_input(tmp_path, corpus_file):
    return ["--input", str(tmp_path / "nope.txt")]


def empty_file(tmp_path, corpus_file):
    (tmp_path / "empty.txt").write_text("")
    return ["--input", str(tmp_path / "empty.txt")]


def directory_without_text(tmp_path, corpus_file):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "readme.md").write_text("no .txt here\n")
    return ["--input", str(tmp_path / "stuff")]


def not_utf8(tmp_path, corpus_file):
    (tmp_path / "latin1.txt").write_bytes("café crème\n".encode("latin-1"))
    return ["--input", str(tmp_path / "latin1.txt")]


def unknown_column(tmp_path, corpus_file):
    import datasets

    dataset = datasets.Dataset.from_dict({"text": ["hello"] * 4, "id": [1, 2, 3, 4]})
    dataset.save_to_disk(str(tmp_path / "ds"))
    return ["--input", str(tmp_path / "ds"), "--text_field", "body"]


def non_text_column(tmp_path, corpus_file):
    import datasets

    dataset = datasets.Dataset.from_dict({"text": ["hello"] * 4, "id": [1, 2, 3, 4]})
    dataset.save_to_disk(str(tmp_path / "ds"))
    return ["--input", str(tmp_path / "ds"), "--text_field", "id"]


def unknown_split(tmp_path, corpus_file):
    import datasets

    one = datasets.Dataset.from_dict({"text": ["hello world"] * 4})
    datasets.DatasetDict({"train": one, "validation": one}).save_to_disk(str(tmp_path / "dd"))
    return ["--input", str(tmp_path / "dd"), "--split", "test"]


def missing_tokenizer(tmp_path, corpus_file):
    return ["--input", str(corpus_file), "--tokenizer", str(tmp_path / "no-such-tokenizer")]


def unloadable_tokenizer(tmp_path, corpus_file):
    (tmp_path / "not-a-tokenizer").mkdir()
    (tmp_path / "not-a-tokenizer" / "weights.txt").write_text("nothing a tokenizer needs\n")
    return ["--input", str(corpus_file), "--tokenizer", str(tmp_path / "not-a-tokenizer")]


def vocab_too_large(tmp_path, corpus_file):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    wrapped.save_pretrained(tmp_path / "huge")
    return ["--input", str(corpus_file), "--tokenizer", str(tmp_path / "huge")]


def val_fraction_zero(tmp_path, corpus_file):
    return ["--input", str(corpus_file), "--val_fraction", "0"]


def val_fraction_too_big(tmp_path, corpus_file):
    return ["--input", str(corpus_file), "--val_fraction", "0.6"]


def too_little_text(tmp_path, corpus_file):
    (tmp_path / "tiny.txt").write_text("hi")
    return ["--input", str(tmp_path / "tiny.txt")]


BAD_INPUTS = [
    (missing_input, "does not exist", "pass a text file"),
    (empty_file, "has no text", "non-empty"),
    (directory_without_text, "no .txt files and no saved dataset", "put .txt files"),
    (not_utf8, "is not UTF-8", "convert it"),
    (unknown_column, "columns are: text, id", "--text_field"),
    (non_text_column, "not text", "--text_field"),
    (unknown_split, "splits are: train, validation", "--split"),
    (missing_tokenizer, "does not exist", "save_pretrained"),
    (unloadable_tokenizer, "cannot load a tokenizer", "save_pretrained"),
    (vocab_too_large, "70001 tokens", "at most 65536"),
    (val_fraction_zero, "outside (0, 0.5]", "pass e.g. 0.1"),
    (val_fraction_too_big, "outside (0, 0.5]", "pass e.g. 0.1"),
    (too_little_text, "too little text", "add more text"),
]


@pytest.mark.parametrize("make_args, cause, fix", BAD_INPUTS,
                         ids=[make_args.__name__ for make_args, _, _ in BAD_INPUTS])
def test_bad_input_exits_64_with_one_line(tmp_path, corpus_file, make_args, cause, fix):
    out = tmp_path / "out"
    result = run_prepare(*make_args(tmp_path, corpus_file), "--out", str(out))

    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert cause in lines[0] and fix in lines[0], lines[0]
    assert result.stdout == ""
    assert not out.exists()


def test_bad_input_removes_the_folders_it_made(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    result = run_prepare("--input", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "a" / "b" / "out"))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_temporaries_of_a_killed_run_are_removed_by_the_next(tmp_path, corpus_file):
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has ended
    stale = out / f".train.bin.tmp-{gone.pid}"
    stale.write_bytes(b"\0" * 1000)
    live = out / f".val.bin.tmp-{os.getpid()}"  # a run still going: left alone
    live.write_bytes(b"\0")
    prepare_ok("--input", str(corpus_file), "--out", str(out))
    assert not stale.exists() and live.exists()


def test_bad_input_leaves_earlier_output_untouched(tmp_path, corpus_file):
    out = tmp_path / "out"
    prepare_ok("--input", str(corpus_file), "--out", str(out))
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    result = run_prepare("--input", str(tmp_path / "nope.txt"), "--out", str(out))

    assert result.returncode == EXIT_BAD_INPUT
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
