"""The data stream is a pure function of (seed, step, sample): layouts see the same batch."""

import torch

from engine.data.sources import CorpusSource, SyntheticSource, local_batch
from launch.run import REPO


def test_data_ranks_partition_the_global_batch():
    for source in (CorpusSource(REPO / "data" / "corpus.txt", 3), SyntheticSource(256, 3)):
        whole, whole_targets = local_batch(source, 5, 8, 16)
        for data_size in (2, 4, 8):
            parts = [local_batch(source, 5, 8, 16, r, data_size) for r in range(data_size)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole)
            assert torch.equal(torch.cat([p[1] for p in parts]), whole_targets)
        assert torch.equal(whole[:, 1:], whole_targets[:, :-1])


def test_steps_and_seeds_differ():
    source = SyntheticSource(256, 0)
    assert not torch.equal(local_batch(source, 0, 4, 16)[0], local_batch(source, 1, 4, 16)[0])
    other = SyntheticSource(256, 1)
    assert not torch.equal(local_batch(source, 0, 4, 16)[0], local_batch(other, 0, 4, 16)[0])


def test_corpus_is_memory_mapped_bytes_and_keeps_its_samples():
    """The corpus reads the file through a uint8 memmap (never int64 of the whole text);
    a window is the file's bytes at the sampled offset, as before."""
    import numpy as np

    path = REPO / "data" / "corpus.txt"
    source = CorpusSource(path, 3)
    assert isinstance(source.tokens, np.memmap) and source.tokens.dtype == np.uint8
    raw = path.read_bytes()
    window = source.sample(2, 5, 33)
    assert window.dtype == torch.long and len(window) == 33
    text = bytes(window.tolist())
    assert text in raw


def test_corpus_holdout_splits_the_bytes():
    path = REPO / "data" / "corpus.txt"
    size = path.stat().st_size
    train = CorpusSource(path, 0, holdout=0.25)
    evaluation = CorpusSource(path, 0, holdout=0.25, split="eval", global_batch=4)
    held = size - train.count
    assert held == evaluation.count and evaluation.first == train.count and held >= size // 4
    raw = path.read_bytes()
    for step in range(20):
        for i in range(4):
            window = bytes(train.sample(step, i, 17).tolist())
            assert window in raw[:train.count]  # inside the training part
    # evaluation: the held-out bytes in order, stride seq_len, the same every time
    windows = [evaluation.sample(k, i, 17) for k in range(2) for i in range(4)]
    for n, window in enumerate(windows):
        start = train.count + n * 16
        assert bytes(window.tolist()) == raw[start:start + 17]
    assert all(torch.equal(a, evaluation.sample(k, i, 17))
               for a, (k, i) in zip(windows, [(k, i) for k in range(2) for i in range(4)]))


def test_synthetic_eval_is_another_stream_of_the_same_walk():
    train, evaluation = SyntheticSource(256, 4), SyntheticSource(256, 4, split="eval")
    assert train.successor == evaluation.successor
    assert not torch.equal(train.sample(0, 0, 32), evaluation.sample(0, 0, 32))
    assert torch.equal(evaluation.sample(3, 1, 32), SyntheticSource(256, 4, split="eval").sample(3, 1, 32))


def test_build_source_takes_the_config_and_a_split():
    import pytest

    from common.config import load_config
    from engine.data.sources import build_source
    from common.errors import UserError

    cfg = load_config(None, [f"data.path={REPO / 'data' / 'corpus.txt'}", "training.global_batch=4",
                             "training.seq_len=16"])
    source = build_source(cfg, 256)
    assert isinstance(source, CorpusSource) and source.count == source.tokens.shape[0]
    with pytest.raises(UserError, match="data.holdout"):
        build_source(cfg, 256, split="eval")
    with pytest.raises(UserError, match="vocabulary of 256"):
        build_source(cfg, 128)
    cfg.data.holdout = 0.1
    assert build_source(cfg, 256, split="eval").first > 0
    cfg.data.source = "synthetic"
    assert build_source(cfg, 64, split="eval").vocab_size == 64
