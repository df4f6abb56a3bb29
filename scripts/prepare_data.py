#!/usr/bin/env python3
"""Turn text into the trainer's data format: train.bin, val.bin (uint16 token ids) and meta.json.

Usage:
    # One UTF-8 text file, byte-level tokens (vocab 256, no end-of-text token):
    python scripts/prepare_data.py --input corpus.txt --out data/corpus

    # A directory of *.txt files (sorted by name, one document each) and a local tokenizer;
    # the tokenizer's eos token is appended after every document:
    python scripts/prepare_data.py --input texts/ --out data/texts --tokenizer tokenizers/gpt2

    # A Hugging Face dataset written by save_to_disk (a Dataset or a DatasetDict):
    python scripts/prepare_data.py --input wiki_saved/ --out data/wiki \\
        --split train --text_field text --val_fraction 0.05

Output (in --out): train.bin and val.bin, token ids as little-endian uint16 (the trainer memmaps
them; the first 1 - val_fraction of the token stream is train), and meta.json ({"vocab_size",
"tokenizer" ("byte" or the tokenizer dir's name), "eot_token" (int or null), "dtype": "uint16",
"train_tokens", "val_tokens"}).

Nothing is downloaded: the tokenizer must be a directory written by save_pretrained().
Bad input (a missing file, an unknown column, ...) prints one line on stderr and exits 64,
leaving --out as it was.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1] / "job"))  # after the libraries: job/ names no shadow
from contract import EXIT_BAD_INPUT, BadFlagParser  # noqa: E402 - the exit codes' one definition

UINT16_VOCAB_LIMIT = 1 << 16
# Text files are read in blocks of about this many characters (extended to a line end), so one
# huge file is never held as a whole string, and a batch holds many blocks to encode in parallel.
TEXT_BLOCK_CHARS = 1 << 16
# Pieces are handed to the tokenizer in batches of about this much text: big enough that a fast
# tokenizer works in parallel, small enough that the batch's temporary lists stay small.
BATCH_CHARS = 1 << 20
BATCH_PIECES = 1024


class InputError(Exception):
    """Bad input the user can fix; the message names the cause and the fix."""


@dataclass
class Piece:
    """Some text of one document; documents can span several pieces (big text files)."""

    text: str
    ends_document: bool


@dataclass
class Encoded:
    stream: BinaryIO  # uint16 ids, written in stream order: memory stays flat however big the corpus
    documents: int = 0
    tokens: int = 0


# --- tokenizers ------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as token ids: nothing to load, and decoding the ids gives the text back exactly."""

    name = "byte"
    vocab_size = 256
    eot_token = None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class LocalTokenizer:
    """A transformers tokenizer from a local directory; its eos token separates documents."""

    def __init__(self, directory: str):
        self._tokenizer = load_local_tokenizer(directory)
        # The Rust backend's encode_batch_fast skips offsets and Python-side wrapping: several
        # times faster than calling the transformers tokenizer, with the same ids.
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        self._encode_fast = getattr(backend, "encode_batch_fast", None)
        self.name = Path(directory).resolve().name
        self.vocab_size = len(self._tokenizer)
        self.eot_token = self._tokenizer.eos_token_id
        if self.vocab_size > UINT16_VOCAB_LIMIT:
            raise InputError(
                f"tokenizer {directory} has {self.vocab_size} tokens but uint16 holds at most "
                f"{UINT16_VOCAB_LIMIT}; use a tokenizer with a vocab of at most {UINT16_VOCAB_LIMIT}"
            )

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # BOS/EOS are not added per call: a document may span several calls, and the eot token
        # is placed by the caller after the document's last piece.
        if self._encode_fast is not None:
            encodings = self._encode_fast(texts, add_special_tokens=False)
            return [np.asarray(one.ids, dtype=np.int64) for one in encodings]
        ids = self._tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [np.asarray(one, dtype=np.int64) for one in ids]


def load_local_tokenizer(directory: str):
    path = Path(directory)
    if not path.is_dir():
        raise InputError(
            f"tokenizer directory {directory} does not exist; pass a directory written by "
            "tokenizer.save_pretrained(), or leave out --tokenizer for byte-level tokens"
        )
    import transformers

    # Library warnings on stderr would break the promise of one line per error.
    transformers.logging.set_verbosity_error()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # transformers raises many types (OSError, ValueError, KeyError...)
        raise InputError(
            f"cannot load a tokenizer from {directory} ({short_reason(error)}); pass a directory "
            "written by tokenizer.save_pretrained() with its tokenizer.json or vocab files"
        ) from error


def make_tokenizer(directory: str | None):
    return LocalTokenizer(directory) if directory else ByteTokenizer()


# --- reading input ---------------------------------------------------------------------------


def read_pieces(input_path: str, text_field: str, split: str) -> Iterator[Piece]:
    path = Path(input_path)
    if not path.exists():
        raise InputError(f"input {input_path} does not exist; pass a text file, a directory of .txt "
                         "files or a dataset directory written by save_to_disk")
    if path.is_file():
        return read_text_file(path)
    if is_saved_dataset(path):
        return read_dataset_rows(load_saved_dataset(path, split), text_field)
    text_files = sorted(p for p in path.glob("*.txt") if p.is_file())
    if not text_files:
        raise InputError(f"directory {input_path} has no .txt files and no saved dataset "
                         "(dataset_dict.json or state.json); put .txt files in it or pass a "
                         "directory written by datasets' save_to_disk")
    return read_text_files(text_files)


def read_text_files(paths: list[Path]) -> Iterator[Piece]:
    for path in paths:
        yield from read_text_file(path)


def read_text_file(path: Path) -> Iterator[Piece]:
    # newline="" keeps \r\n as written, so byte-level tokens decode back to the exact file.
    with open(path, encoding="utf-8", newline="") as file:
        while True:
            block = read_block(file, path)
            if not block:
                break
            yield Piece(block, ends_document=False)
    yield Piece("", ends_document=True)


def read_block(file, path: Path) -> str:
    try:
        block = file.read(TEXT_BLOCK_CHARS)
        # Ending blocks at a line end keeps words whole for subword tokenizers.
        if block and not block.endswith("\n"):
            block += file.readline()
        return block
    except UnicodeDecodeError as error:
        raise InputError(f"{path} is not UTF-8 text ({error.reason}); convert it first, "
                         f"e.g. iconv -f LATIN1 -t UTF-8 {path.name}") from error


def is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def load_saved_dataset(path: Path, split: str):
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # arrow and datasets raise many types for a damaged directory
        raise InputError(f"cannot load the saved dataset in {path} ({short_reason(error)}); "
                         "write it again with save_to_disk") from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise InputError(f"split {split!r} is not in the dataset {path}; its splits are: "
                             f"{', '.join(loaded.keys())}; pass one with --split")
        return loaded[split]
    return loaded


def read_dataset_rows(dataset, text_field: str) -> Iterator[Piece]:
    check_text_column(dataset, text_field)
    return iterate_rows(dataset.select_columns([text_field]), text_field)


def check_text_column(dataset, text_field: str) -> None:
    if text_field not in dataset.column_names:
        raise InputError(f"column {text_field!r} is not in the dataset; its columns are: "
                         f"{', '.join(dataset.column_names)}; pass one with --text_field")
    dtype = getattr(dataset.features[text_field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise InputError(f"column {text_field!r} holds {dataset.features[text_field]}, not text; "
                         f"pass a text column with --text_field")


def iterate_rows(dataset, text_field: str) -> Iterator[Piece]:
    for batch in dataset.iter(batch_size=BATCH_PIECES):
        for text in batch[text_field]:
            yield Piece(text or "", ends_document=True)


# --- encoding --------------------------------------------------------------------------------


def batched(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_PIECES:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_pieces(pieces: Iterable[Piece], tokenizer, stream: BinaryIO) -> Encoded:
    encoded = Encoded(stream)
    document_has_text = False
    eot = None if tokenizer.eot_token is None else np.array([tokenizer.eot_token], dtype=np.int64)
    for batch in batched(pieces):
        parts = []
        for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch])):
            parts.append(ids)
            document_has_text = document_has_text or bool(piece.text)
            if piece.ends_document and document_has_text:
                encoded.documents += 1
                document_has_text = False
                if eot is not None:
                    parts.append(eot)
        add_chunk(encoded, parts, tokenizer.vocab_size)
    return encoded


def add_chunk(encoded: Encoded, parts: list[np.ndarray], vocab_size: int) -> None:
    # One array per batch, not per document: millions of tiny arrays would cost more than the ids.
    chunk = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    if chunk.size == 0:
        return
    if int(chunk.max()) >= vocab_size:
        raise InputError(f"the tokenizer produced id {int(chunk.max())} but its vocab_size is "
                         f"{vocab_size}; fix the tokenizer so its ids are below its length")
    # astype("<u2") keeps the files little-endian, and so portable, on any machine.
    chunk.astype("<u2").tofile(encoded.stream)
    encoded.tokens += chunk.size


# --- splitting and writing -------------------------------------------------------------------


def split_sizes(total_tokens: int, val_fraction: float) -> tuple[int, int]:
    val_tokens = round(total_tokens * val_fraction)
    train_tokens = total_tokens - val_tokens
    if train_tokens == 0 or val_tokens == 0:
        raise InputError(f"too little text for both splits: {total_tokens} tokens give "
                         f"{train_tokens} train and {val_tokens} val tokens at --val_fraction "
                         f"{val_fraction}; add more text")
    return train_tokens, val_tokens


@contextlib.contextmanager
def staged_outputs(out: Path) -> Iterator[dict[str, Path]]:
    """Temporary paths next to train.bin, val.bin and meta.json; on success they replace those.
    On failure nothing in --out changes, and the folders made here are removed again."""
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # innermost first
    out.mkdir(parents=True, exist_ok=True)
    names = ("train.bin", "val.bin", "meta.json")
    remove_stale_temporaries(out, names)
    temporary = {name: out / f".{name}.tmp-{os.getpid()}" for name in names}
    try:
        yield temporary
        made = []  # --out holds results from here on
        # meta.json goes first and comes back last: a run killed between the renames leaves no
        # meta.json, rather than one that vouches for a mix of old and new .bin files.
        (out / "meta.json").unlink(missing_ok=True)
        for name in names:
            os.replace(temporary[name], out / name)
    finally:
        for path in temporary.values():
            path.unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):  # the error that got us here is the one to report
                folder.rmdir()


def remove_stale_temporaries(out: Path, names: tuple[str, ...]) -> None:
    """A run killed outright (SIGKILL, out of memory) leaves its temporary files, as big as the
    corpus; the next run removes those whose process is gone."""
    for name in names:
        for path in out.glob(f".{name}.tmp-*"):
            pid = path.name.rsplit("-", 1)[1]
            if pid.isdigit() and not process_exists(int(pid)):
                path.unlink(missing_ok=True)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def split_off_val(tokens_path: Path, train_tokens: int, val_path: Path) -> None:
    """Move the stream's tail past `train_tokens` into val_path; what is left is train.bin."""
    itemsize = np.dtype("<u2").itemsize
    with open(tokens_path, "r+b") as tokens, open(val_path, "wb") as val:
        tokens.seek(train_tokens * itemsize)
        shutil.copyfileobj(tokens, val, 16 << 20)
        tokens.truncate(train_tokens * itemsize)
        for file in (tokens, val):
            file.flush()
            os.fsync(file.fileno())


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = BadFlagParser(
        prog="prepare_data.py",
        description="Tokenize text into train.bin, val.bin (uint16) and meta.json for the trainer.")
    parser.add_argument("--input", required=True,
                        help="a UTF-8 text file, a directory of .txt files, or a save_to_disk dataset")
    parser.add_argument("--out", required=True, help="directory for train.bin, val.bin and meta.json")
    parser.add_argument("--tokenizer", help="local directory of a transformers tokenizer "
                        "(save_pretrained); default: UTF-8 bytes, vocab 256")
    parser.add_argument("--text_field", default="text",
                        help="dataset column with the text (default: text)")
    parser.add_argument("--val_fraction", type=float, default=0.1,
                        help="share of the token stream, taken from its end, for val.bin; in (0, 0.5]")
    parser.add_argument("--split", default="train",
                        help="DatasetDict split to read (default: train); a plain Dataset ignores it")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if not 0 < args.val_fraction <= 0.5:
        raise InputError(f"--val_fraction {args.val_fraction} is outside (0, 0.5]; pass e.g. 0.1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {args.out} is a file, not a directory; pass a directory path")


def prepare(args: argparse.Namespace) -> str:
    started = time.monotonic()
    check_args(args)
    # The tokenizer loads before the input is read, so a bad --tokenizer fails in seconds, not
    # after a long encoding.
    tokenizer = make_tokenizer(args.tokenizer)
    pieces = read_pieces(args.input, args.text_field, args.split)  # a missing input fails here
    with staged_outputs(Path(args.out)) as temporary:
        with open(temporary["train.bin"], "wb") as stream:
            encoded = encode_pieces(pieces, tokenizer, stream)
        if encoded.documents == 0:
            raise InputError(f"input {args.input} has no text; pass a non-empty file, directory or column")
        train_tokens, val_tokens = split_sizes(encoded.tokens, args.val_fraction)
        split_off_val(temporary["train.bin"], train_tokens, temporary["val.bin"])
        meta = {
            "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.name,
            "eot_token": tokenizer.eot_token,
            "dtype": "uint16",
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
        }
        write_file(temporary["meta.json"], (json.dumps(meta, indent=2) + "\n").encode())
    return (f"wrote {args.out}: documents {encoded.documents}, tokens {encoded.tokens} "
            f"(train {train_tokens}, val {val_tokens}), tokenizer {tokenizer.name} "
            f"(vocab {tokenizer.vocab_size}), {time.monotonic() - started:.1f} s")


def one_line(text: str) -> str:
    """Library messages span lines; the error report must not."""
    return " ".join(text.split())


def short_reason(error: BaseException, limit: int = 120) -> str:
    # Cut short so the fix that follows a library's reason still fits on a readable line.
    text = one_line(str(error)) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def stay_offline() -> None:
    # Before transformers/datasets are imported (they read these once): never reach the network.
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stay_offline()
    try:
        summary = prepare(args)
    except InputError as error:
        print(f"prepare_data: error: {one_line(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
