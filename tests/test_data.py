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
