"""Deterministic token sources and the per-rank slice of each global batch.

Sample i of step s is a pure function of (seed, s, i), whatever the layout: a
data-parallel rank simply builds its own rows. So every mesh sees the same
global batch, TP ranks of one data rank see the same rows, and the position
in the data is just the step number.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.errors import UserError

BYTE_VOCAB = 256


def _sample_generator(seed: int, step: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + index)


class CorpusSource:
    """Windows of a UTF-8 text read as bytes: token = byte value."""

    vocab_size = BYTE_VOCAB

    def __init__(self, path: str | Path, seed: int):
        path = Path(path)
        if not path.is_file():
            raise UserError(f"data.path {str(path)!r} does not exist. Point it at a text file, "
                            f"or use --set data.source=synthetic.")
        self.tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        self.seed = seed

    def sample(self, step: int, index: int, length: int) -> torch.Tensor:
        if len(self.tokens) <= length:
            raise UserError(f"data.path holds {len(self.tokens)} bytes, fewer than one sample of "
                            f"{length}. Use a longer text or a shorter training.seq_len.")
        generator = _sample_generator(self.seed, step, index)
        start = int(torch.randint(0, len(self.tokens) - length, (1,), generator=generator))
        return self.tokens[start:start + length]


class SyntheticSource:
    """A noisy walk through a fixed permutation of the vocabulary: learnable, endless."""

    def __init__(self, vocab_size: int, seed: int, noise: float = 0.1):
        self.vocab_size = vocab_size
        self.seed = seed
        self.noise = noise
        self.successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))

    def sample(self, step: int, index: int, length: int) -> torch.Tensor:
        generator = _sample_generator(self.seed, step, index)
        random_tokens = torch.randint(0, self.vocab_size, (length,), generator=generator)
        noisy = torch.rand(length, generator=generator) < self.noise
        out = torch.empty(length, dtype=torch.long)
        out[0] = random_tokens[0]
        for t in range(1, length):
            out[t] = random_tokens[t] if noisy[t] else self.successor[out[t - 1]]
        return out


def build_source(data_cfg, seed: int, model_vocab: int):
    if data_cfg.source == "synthetic":
        return SyntheticSource(model_vocab, seed)
    source = CorpusSource(data_cfg.path, seed)
    if source.vocab_size > model_vocab:
        raise UserError(f"the byte-level corpus needs a vocabulary of {source.vocab_size} but the model "
                        f"has {model_vocab}. Use --set data.source=synthetic for this model.")
    return source


def local_batch(source, step: int, global_batch: int, seq_len: int,
                data_rank: int = 0, data_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for this data rank's rows of global batch `step`."""
    if global_batch % data_size:
        raise UserError(f"training.global_batch={global_batch} does not divide over {data_size} "
                        f"data-parallel ranks (hsdp x dp). Use a multiple of {data_size}.")
    rows = global_batch // data_size
    first = data_rank * rows
    windows = torch.stack([source.sample(step, i, seq_len + 1) for i in range(first, first + rows)])
    return windows[:, :-1], windows[:, 1:]
