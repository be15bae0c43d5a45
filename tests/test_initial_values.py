"""Shard-proportional initialisation (models/initial_values.py, models/materialise.py).

- Any block of a parameter, drawn alone, by one thread or several, is bitwise the same
  block of the whole draw (hypothesis, over shapes, regions and tile sizes); a rank
  draws only the tiles its block touches, counted by the random streams it opens.
- The distributions hold their parameters, and tiles are independent streams.
- Real runs (torchrun, 4 ranks, gloo; tests/init_worker.py): on every layout, the full
  weights gathered from the shards equal the one-process model's bitwise, with uneven
  shapes, tensor parallel's strided shards, tied weights, GPT-2 and the init_value path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from common.errors import UserError
from models import initial_values
from models.contract import check_model_contract
from models.initial_values import Constant, Normal, draw_block, matrix_shape, parameter_key
from tests.distributed import REPO, torchrun


def whole(distribution, key, shape, threads=1):
    rows, cols = matrix_shape(shape)
    return draw_block(distribution, key, shape, (0, rows), (0, cols), threads=threads)


@st.composite
def shapes_and_regions(draw):
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    rows, cols = matrix_shape(shape)
    r0 = draw(st.integers(0, rows - 1))
    c0 = draw(st.integers(0, cols - 1))
    return shape, (r0, draw(st.integers(r0 + 1, rows))), (c0, draw(st.integers(c0 + 1, cols)))


@settings(max_examples=150, deadline=None)
@given(case=shapes_and_regions(), tile_elements=st.sampled_from([1, 7, 64, 1 << 16]),
       tile_columns=st.sampled_from([1, 5, 16, 2048]), std=st.floats(0.001, 3.0), mean=st.sampled_from([0.0, -0.5]),
       threads=st.sampled_from([1, 3]))
def test_a_block_drawn_alone_is_that_block_of_the_whole(case, tile_elements, tile_columns, std, mean, threads):
    """By one thread or several (each a share of the block's tiles), against a
    whole draw by one."""
    shape, (r0, r1), (c0, c1) = case
    distribution = Normal(std, mean)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(initial_values, "TILE_ELEMENTS", tile_elements)
        patch.setattr(initial_values, "TILE_COLUMNS", tile_columns)
        full = whole(distribution, 99, shape)
        block = draw_block(distribution, 99, shape, (r0, r1), (c0, c1), threads=threads)
    assert np.array_equal(block, full[r0:r1, c0:c1])


def test_a_rank_opens_only_the_streams_of_its_tiles(monkeypatch):
    """A (4096 x 4096) matrix in tiles of 32 x 2048: a row-wise eighth opens an eighth of
    the streams, a column-wise half of that eighth a sixteenth."""
    opened = []
    real = np.random.Philox
    monkeypatch.setattr(np.random, "Philox", lambda key: opened.append(key) or real(key=key))
    shape = (4096, 4096)
    whole(Normal(0.02), 1, shape)
    assert len(opened) == 128 * 2
    opened.clear()
    draw_block(Normal(0.02), 1, shape, (512, 1024), (0, 4096))
    assert len(opened) == 16 * 2
    opened.clear()
    draw_block(Normal(0.02), 1, shape, (512, 1024), (2048, 4096))
    assert len(opened) == 16


def test_distributions_and_independent_tiles():
    values = whole(Normal(0.02, 1.5), parameter_key(0, "w"), (1024, 1024))
    assert abs(values.mean() - 1.5) < 1e-3 and abs(values.std() / 0.02 - 1) < 1e-2
    first, second = values[:32], values[32:64]  # two tiles of 32 rows
    assert abs(np.corrcoef(first.ravel(), second.ravel())[0, 1]) < 0.01
    assert np.array_equal(whole(Constant(1.0), 5, (3, 4)), np.ones((3, 4), np.float32))
    assert parameter_key(0, "w") != parameter_key(1, "w") != parameter_key(0, "v")


class BadInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)

    def init_distribution(self, fqn):
        return 0.02


def test_init_distribution_must_name_a_distribution():
    with pytest.raises(UserError, match=r"init_distribution\('embed.weight'\) returned 0.02; it must return one "
                                        r"of Normal, Constant from models.initial_values"):
        check_model_contract(BadInit(), "bad")


@pytest.mark.distributed
@pytest.mark.compat
def test_every_layout_materialises_the_one_process_weights(tmp_path):
    out = tmp_path / "report.json"
    result = torchrun(4, REPO / "tests" / "init_worker.py", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert len(report) == 10
    assert report == {layout: [] for layout in report}, report
