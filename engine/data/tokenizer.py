"""Tokenizers for launch/prepare.py: text in, token ids out, and back.

Three kinds, named by one string (`--tokenizer`):

- `bytes` (the default, offline): token = UTF-8 byte, a vocabulary of 256. Its
  end-of-document token (`--append-eos`) is byte 0 (NUL), which text does not hold.
- a path to a Hugging Face `tokenizer.json`, through the `tokenizers` package. Its
  identity is the file's name and the sha256 of its bytes, so a prepared folder
  names exactly the tokenizer it was made with.
- `tiktoken:NAME` (e.g. `tiktoken:cl100k_base`), only where `tiktoken` is importable;
  it is not a dependency of this project.

`train_bpe` trains a small byte-level BPE `tokenizer.json` on text files, for data
that ships no tokenizer of its own (`launch/prepare.py --train-tokenizer`).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np

from common.errors import UserError

BYTE_VOCAB = 256
BYTE_EOS = 0  # NUL: the byte tokenizer's end-of-document token
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
SPECIAL = "<|endoftext|>"  # the one special token of a tokenizer trained by train_bpe


class ByteTokenizer:
    """UTF-8 bytes: lossless for any text, no file, no dependency."""

    kind = "bytes"
    identity = "bytes"
    vocab_size = BYTE_VOCAB
    eos_id: int | None = BYTE_EOS

    def encode(self, text: str) -> np.ndarray:
        # surrogatepass: a lone surrogate from JSON ("\ud800") survives the round trip
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", "surrogatepass")

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def describe(self) -> dict:
        return {"kind": self.kind, "identity": self.identity, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id}


class HFTokenizer:
    """A Hugging Face tokenizer.json, through the `tokenizers` package."""

    kind = "huggingface"

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise UserError(f"tokenizer {str(path)!r} does not exist. Give `bytes`, a Hugging Face "
                            f"tokenizer.json, or train one with `python launch/prepare.py "
                            f"--train-tokenizer TEXT --vocab-size 512 --out tokenizer.json`.")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise UserError(f"reading the tokenizer {str(path)!r} needs the `tokenizers` package, "
                            f"which is not importable ({err}). Install it with "
                            f"`pip install -e .[data]`, or use --tokenizer bytes.") from None
        data = path.read_bytes()
        try:
            self.tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # tokenizers raises its own Exception type
            raise UserError(f"{str(path)!r} is not a Hugging Face tokenizer.json that the `tokenizers` "
                            f"package can read ({str(err).splitlines()[0] if str(err) else err!r}).") from None
        self.path = path
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.identity = f"{path.name} sha256:{self.sha256}"
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.eos_id = next((self.tokenizer.token_to_id(name) for name in EOS_NAMES
                            if self.tokenizer.token_to_id(name) is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips the offsets, which nothing here needs
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [np.asarray(e.ids, dtype=np.int64) for e in batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {"kind": self.kind, "identity": self.identity, "name": self.path.name,
                "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class TiktokenTokenizer:
    """A tiktoken encoding by name, where tiktoken is installed."""

    kind = "tiktoken"

    def __init__(self, name: str):
        try:
            import tiktoken
        except ImportError:
            raise UserError(f"--tokenizer tiktoken:{name} needs the `tiktoken` package, which is not "
                            f"installed (and not a dependency of this project). Install it with "
                            f"`pip install tiktoken`, or use --tokenizer bytes or a tokenizer.json.") from None
        try:
            self.encoding = tiktoken.get_encoding(name)
        except Exception as err:
            raise UserError(f"tiktoken has no encoding {name!r} it can load ({err}).") from None
        self.identity = f"tiktoken:{name}"
        self.vocab_size = self.encoding.n_vocab
        self.eos_id = self.encoding.eot_token

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.encoding.encode_ordinary(text), dtype=np.int64)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {"kind": self.kind, "identity": self.identity, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id}


def load_tokenizer(spec: str):
    """`bytes`, `tiktoken:NAME`, or a path to a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.split(":", 1)[1])
    return HFTokenizer(spec)


def train_bpe(inputs: list[str | Path], vocab_size: int, out: str | Path) -> dict:
    """Train a byte-level BPE tokenizer.json on text files (read by `tokenizers`, line by
    line, never whole); returns a summary. Byte-level, so any text round-trips exactly;
    its one special token, <|endoftext|>, is the end-of-document token."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as err:
        raise UserError(f"training a tokenizer needs the `tokenizers` package, which is not importable "
                        f"({err}). Install it with `pip install -e .[data]`.") from None
    if vocab_size < BYTE_VOCAB + 1:
        raise UserError(f"--vocab-size {vocab_size} is too small for a byte-level BPE: its 256 byte "
                        f"tokens and <|endoftext|> need at least {BYTE_VOCAB + 1}.")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise UserError(f"--train-tokenizer input {str(path)!r} does not exist. Give text files.")
    out = Path(out)
    started = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        tokenizer.train([str(p) for p in paths], trainer)
    except Exception as err:
        raise UserError(f"training a tokenizer on {', '.join(map(str, paths))} failed: {err}. "
                        f"The inputs must be UTF-8 text.") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    tokenizer.save(str(partial))
    os.replace(partial, out)
    return {"out": str(out), "vocab_size": tokenizer.get_vocab_size(), "files": len(paths),
            "bytes": sum(p.stat().st_size for p in paths), "seconds": time.perf_counter() - started}
