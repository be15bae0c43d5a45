"""Deterministic token sources and the per-rank slice of each global batch.

Sample i of step s is a pure function of (seed, s, i), whatever the layout: a
data-parallel rank simply builds its own rows. So every mesh sees the same
global batch, TP ranks of one data rank see the same rows, and the position
in the data is just the step number.

Three sources (`data.source`), each with a training and an evaluation split
(`build_source(cfg, model_vocab, split)`):

- `corpus`: a text file read as bytes (token = byte), memory-mapped. Training
  windows start at random offsets; `data.holdout` keeps the last fraction of the
  bytes out of training, and evaluation reads that part in order.
- `tokens`: one or more folders written by launch/prepare.py, memory-mapped
  (engine/data/token_file.py), mixed by `data.weights`. Windows of seq_len + 1
  tokens at stride seq_len; every training window once per epoch, in a seeded
  order (engine/data/sampling.py); `data.holdout` reserves the last windows of
  each folder for evaluation, which reads them in order. docs/data.md.
- `synthetic`: a noisy walk through a permutation of the vocabulary; evaluation
  draws from the same walk with another seed stream.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from engine.data.sampling import MASK64, Mixture, derive_key, mix64, parse_weights, permute
from engine.data.token_file import INDEX, TokenFile, id_outside, read_index
from common.errors import UserError

BYTE_VOCAB = 256
REPO = Path(__file__).resolve().parents[2]
SPLITS = ("train", "eval")
_EVAL_STREAM = 0x5EED_E7A1  # mixed into the synthetic source's sample seeds for evaluation


def _sample_generator(seed: int, step: int, index: int, stream: int = 0) -> torch.Generator:
    value = (seed * 1_000_003 + step) * 1_000_033 + index
    if stream:  # scrambled: torch's CPU generator keeps only a seed's low 32 bits
        value = mix64(value ^ stream)
    return torch.Generator().manual_seed(value & MASK64)  # large seeds wrap; small ones keep their value


def held_out(count: int, holdout: float) -> int:
    """How many of `count` units (bytes or windows) data.holdout keeps: the ceiling of
    the fraction, so any positive holdout keeps at least one."""
    if holdout <= 0:
        return 0
    return math.ceil(Fraction(holdout).limit_denominator(10**9) * count)


def resolve(path: str | Path) -> Path:
    """A path as given, or under the repository when only there (shipped data)."""
    path = Path(path)
    if not path.is_absolute() and not path.exists() and (REPO / path).exists():
        return REPO / path
    return path


def split_paths(text: str, what: str) -> list[Path]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UserError(f"{what} is empty. Give one or more folders written by launch/prepare.py, "
                        f"comma-separated.")
    return [resolve(p) for p in parts]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")


class CorpusSource:
    """Windows of a UTF-8 text read as bytes: token = byte value. The file is memory-mapped,
    never read whole."""

    vocab_size = BYTE_VOCAB

    def __init__(self, path: str | Path, seed: int, holdout: float = 0.0, split: str = "train",
                 global_batch: int = 1, what: str = "data.path"):
        _check_split(split)
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{what} {str(path)!r} does not exist. Point it at a text file, "
                            f"or use --set data.source=synthetic.")
        size = path.stat().st_size
        if size == 0:
            raise UserError(f"{what} {str(path)!r} is empty. Point it at a text file.")
        self.path = path
        self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
        self.seed = seed
        self.split = split
        self.global_batch = global_batch
        self.what = what
        held = held_out(size, holdout)
        if split == "train":
            self.first, self.count = 0, size - held
        else:  # the held-out tail, or with no holdout (eval.path) the whole file
            self.first, self.count = (size - held, held) if held else (0, size)

    def eval_windows(self, length: int) -> int:
        return (self.count - 1) // (length - 1)

    def sample(self, step: int, index: int, length: int) -> torch.Tensor:
        if self.split == "train":
            if self.count <= length:
                raise UserError(f"{self.what} holds {self.count} bytes for training, fewer than one sample "
                                f"of {length}. Use a longer text, a smaller data.holdout or a shorter "
                                f"training.seq_len.")
            generator = _sample_generator(self.seed, step, index)
            start = int(torch.randint(0, self.count - length, (1,), generator=generator))
        else:
            windows = self.eval_windows(length)
            if windows < 1:
                raise UserError(f"the evaluation part of {self.what} holds {self.count} bytes, fewer than one "
                                f"sample of {length}. Use a larger data.holdout, a longer text or a shorter "
                                f"training.seq_len.")
            g = step * self.global_batch + index
            start = self.first + (g % windows) * (length - 1)
        return torch.from_numpy(np.array(self.tokens[start:start + length], dtype=np.int64))


class SyntheticSource:
    """A noisy walk through a fixed permutation of the vocabulary: learnable, endless.
    Evaluation walks the same permutation from samples of another seed stream."""

    def __init__(self, vocab_size: int, seed: int, noise: float = 0.1, split: str = "train"):
        _check_split(split)
        self.vocab_size = vocab_size
        self.seed = seed
        self.noise = noise
        self.stream = 0 if split == "train" else _EVAL_STREAM
        # A list: the walk below is sequential, and list indexing costs a fraction of a
        # tensor's: a row of 8,193 tokens took 51 ms with tensors and 3.9 ms with lists (2-core CPU).
        self.successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed)).tolist()

    def sample(self, step: int, index: int, length: int) -> torch.Tensor:
        generator = _sample_generator(self.seed, step, index, self.stream)
        random_tokens = torch.randint(0, self.vocab_size, (length,), generator=generator).tolist()
        noisy = (torch.rand(length, generator=generator) < self.noise).tolist()
        out = [random_tokens[0]]
        for t in range(1, length):
            out.append(random_tokens[t] if noisy[t] else self.successor[out[-1]])
        return torch.tensor(out, dtype=torch.long)


def _vocab_error(what: str, folder: Path, index: dict, model_vocab: int) -> UserError:
    tokenizer = index["tokenizer"]
    vocab = int(tokenizer["vocab_size"])
    return UserError(
        f"{what} folder {str(folder)!r} was tokenized with {tokenizer.get('identity', '?')} (vocabulary "
        f"{vocab}), larger than the model's vocabulary of {model_vocab}: its token ids would index past "
        f"the embedding. Prepare the data with a tokenizer of at most {model_vocab} tokens (--tokenizer "
        f"bytes has 256), or choose a model whose vocab_size is at least {vocab}.")


def token_parts(folders: list[Path], seq_len: int, holdout: float, split: str, model_vocab: int | None,
                what: str = "data.path") -> list[tuple[Path, int, int]]:
    """(folder, first window, windows) of each folder for `split`, from index.json alone.
    Windows are seq_len + 1 tokens at stride seq_len; data.holdout keeps the last
    ceil(holdout x windows) of each folder for evaluation."""
    _check_split(split)
    parts = []
    for folder in folders:
        index = read_index(folder, what)
        if model_vocab is not None and int(index["tokenizer"]["vocab_size"]) > model_vocab:
            raise _vocab_error(what, folder, index, model_vocab)
        tokens = int(index["tokens"])
        windows = (tokens - 1) // seq_len if tokens > 0 else 0
        if windows < 1:
            raise UserError(f"{what} folder {str(folder)!r} holds {tokens:,} tokens, fewer than one window of "
                            f"training.seq_len + 1 = {seq_len + 1}. Prepare more text into it, or use a "
                            f"shorter training.seq_len.")
        held = held_out(windows, holdout)
        if split == "train":
            if windows - held < 1:
                raise UserError(f"data.holdout={holdout} leaves no training window in {what} folder "
                                f"{str(folder)!r} ({windows} windows of {seq_len + 1} tokens). Use a smaller "
                                f"data.holdout, more data or a shorter training.seq_len.")
            parts.append((folder, 0, windows - held))
        else:
            parts.append((folder, windows - held, held) if held else (folder, 0, windows))
    return parts


class TokenSource:
    """Windows of prepared token folders (launch/prepare.py), memory-mapped, mixed by weight.

    Sample g = step * global_batch + index goes to folder k and is that folder's c-th
    sample (Mixture); epoch, position = divmod(c, windows); for training the window is
    permute(position, windows, key(seed, k, epoch)), for evaluation the position itself.
    """

    def __init__(self, folders: list[str | Path] | str, seed: int, global_batch: int, seq_len: int,
                 weights: str = "", holdout: float = 0.0, split: str = "train",
                 model_vocab: int | None = None, what: str = "data.path"):
        _check_split(split)
        if isinstance(folders, str):
            folders = split_paths(folders, what)
        folders = [Path(f) for f in folders]
        self.parts = token_parts(folders, seq_len, holdout, split, model_vocab, what)
        self.files = [TokenFile(folder, what) for folder, _, _ in self.parts]
        self.mixture = Mixture(parse_weights(weights, len(folders)))
        self.vocab_size = max(f.vocab_size for f in self.files)
        self.model_vocab = model_vocab
        self.what = what
        self.seed = seed
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.shuffle = split == "train"
        self.split = split

    def locate(self, step: int, index: int) -> tuple[int, int]:
        """(folder number, window number within that folder's file) of sample `index` of `step`."""
        folder, count = self.mixture.locate(step * self.global_batch + index)
        _, first, windows = self.parts[folder]
        epoch, position = divmod(count, windows)
        if self.shuffle:
            position = permute(position, windows, derive_key(self.seed, folder, epoch))
        return folder, first + position

    def sample(self, step: int, index: int, length: int) -> torch.Tensor:
        if length != self.seq_len + 1:
            raise ValueError(f"this token source was built for windows of {self.seq_len + 1} tokens "
                             f"(training.seq_len={self.seq_len}), not {length}")
        folder, window = self.locate(step, index)
        start = window * self.seq_len
        ids = self.files[folder].window(start, length)
        # tokens.bin is written by another program: an id past the embedding would fail
        # every rank's forward (a device-side assert on CUDA).
        if self.model_vocab is not None and ids.max() >= self.model_vocab:
            offset = int(np.argmax(ids >= self.model_vocab))
            raise id_outside(self.files[folder].folder, start + offset, int(ids[offset]), self.model_vocab, self.what)
        return torch.from_numpy(ids)


def _no_eval_data(cfg) -> UserError:
    asked = (f"eval.every={cfg.eval.every} asks for evaluation on held-out data" if cfg.eval.every > 0
             else "evaluation needs held-out data")
    return UserError(f"{asked}, but data.holdout is 0 and eval.path is empty. "
                     f"Set --set data.holdout=0.05 to keep the last 5% of data.path out of training, or "
                     f"--set eval.path=... to data of the same kind as data.path "
                     f"(data.source={cfg.data.source}).")


def build_source(cfg, model_vocab: int, split: str = "train"):
    """The source of `split` ("train" or "eval") for this config. Window geometry comes from
    cfg.training; evaluation reads eval.path when set, else data.holdout's part."""
    _check_split(split)
    d, t = cfg.data, cfg.training
    if d.source == "synthetic":
        return SyntheticSource(model_vocab, t.seed, split=split)
    eval_path = cfg.eval.path.strip() if split == "eval" else ""
    if split == "eval" and not eval_path and d.holdout <= 0:
        raise _no_eval_data(cfg)
    what = "eval.path" if eval_path else "data.path"
    holdout = 0.0 if eval_path else d.holdout
    if d.source == "tokens":
        return TokenSource(eval_path or d.path, t.seed, t.global_batch, t.seq_len,
                           weights="" if eval_path else d.weights, holdout=holdout, split=split,
                           model_vocab=model_vocab, what=what)
    source = CorpusSource(resolve(eval_path or d.path), t.seed, holdout, split, t.global_batch, what)
    if source.vocab_size > model_vocab:
        raise UserError(f"the byte-level corpus needs a vocabulary of {source.vocab_size} but the model "
                        f"has {model_vocab}. Use --set data.source=synthetic for this model.")
    return source


def check_data(cfg, model_vocab: int) -> None:
    """Every data problem that can be found before any process group: paths, preparation,
    vocabularies, mixture weights, sizes, holdout. Reads index.json files and stats the
    rest; maps nothing."""
    d, t = cfg.data, cfg.training
    if d.weights.strip() and d.source != "tokens":
        raise UserError(f"data.weights={d.weights!r} mixes prepared token folders, but data.source is "
                        f"{d.source}. Use --set data.source=tokens with several folders in data.path, or "
                        f"leave data.weights empty.")
    eval_path = cfg.eval.path.strip()
    if d.source == "synthetic":
        return
    if cfg.eval.every > 0 and not eval_path and d.holdout <= 0:
        raise _no_eval_data(cfg)
    length = t.seq_len + 1
    if d.source == "tokens":
        folders = split_paths(d.path, "data.path")
        parse_weights(d.weights, len(folders))
        token_parts(folders, t.seq_len, d.holdout, "train", model_vocab)
        if d.holdout > 0:
            token_parts(folders, t.seq_len, d.holdout, "eval", model_vocab)
        if eval_path:
            token_parts(split_paths(eval_path, "eval.path"), t.seq_len, 0.0, "eval", model_vocab, "eval.path")
        return
    if BYTE_VOCAB > model_vocab:
        raise UserError(f"the byte-level corpus needs a vocabulary of {BYTE_VOCAB} but the model has "
                        f"{model_vocab}. Use --set data.source=synthetic for this model, or prepared tokens.")
    checks = [(d.path, d.holdout, "train", "data.path")]
    if d.holdout > 0:
        checks.append((d.path, d.holdout, "eval", "data.path"))
    if eval_path:
        checks.append((eval_path, 0.0, "eval", "eval.path"))
    for path, holdout, split, what in checks:
        path = resolve(path)
        if not path.is_file():
            raise UserError(f"{what} {str(path)!r} does not exist. Point it at a text file, or use "
                            f"--set data.source=synthetic (or tokens, for folders from launch/prepare.py).")
        size = path.stat().st_size
        held = held_out(size, holdout)
        if split == "train" and size - held <= length:
            raise UserError(f"{what} {str(path)!r} holds {size - held:,} bytes for training, fewer than one "
                            f"sample of training.seq_len + 1 = {length}. Use a longer text, a smaller "
                            f"data.holdout or a shorter training.seq_len.")
        count = held or size
        if split == "eval" and (count - 1) // t.seq_len < 1:
            raise UserError(f"the evaluation part of {what} {str(path)!r} holds {count:,} bytes, fewer than "
                            f"one sample of training.seq_len + 1 = {length}. Use a larger data.holdout, a "
                            f"longer text or a shorter training.seq_len.")


def data_fingerprint(cfg) -> str:
    """Names the training data for parity trajectories: the source and a hash of its content."""
    d = cfg.data
    data = d.source
    if d.source == "corpus":
        data += ":" + hashlib.sha256(resolve(d.path).read_bytes()).hexdigest()[:16]
    elif d.source == "tokens":
        hashes = [hashlib.sha256((folder / INDEX).read_bytes()).hexdigest()[:16]
                  for folder in split_paths(d.path, "data.path")]
        data += ":" + ",".join(hashes) + (f":weights={d.weights}" if d.weights.strip() else "")
    if d.holdout > 0 and d.source != "synthetic":
        data += f":holdout={d.holdout}"
    return data


def rows_per_data_rank(global_batch: int, data_size: int) -> int:
    """Each data rank's share of the global batch, which must divide evenly."""
    if global_batch % data_size:
        raise UserError(f"training.global_batch={global_batch} does not divide over {data_size} "
                        f"data-parallel ranks (hsdp x dp). Use a multiple of {data_size}.")
    return global_batch // data_size


def local_batch(source, step: int, global_batch: int, seq_len: int,
                data_rank: int = 0, data_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for this data rank's rows of global batch `step`."""
    rows = rows_per_data_rank(global_batch, data_size)
    first = data_rank * rows
    windows = torch.stack([source.sample(step, i, seq_len + 1) for i in range(first, first + rows)])
    return windows[:, :-1], windows[:, 1:]
