"""Initial values that a rank can draw for its own part of a parameter alone.

A model's `init_distribution(fqn)` names each parameter's distribution (`Normal` or
`Constant`). The parameter, seen as a matrix (dim 0 by the other dims flattened), is
cut into a grid of tiles that depends only on its full shape, and each tile comes
from its own random stream, keyed by the run seed, the parameter's name and the
tile's index. A rank draws only the tiles its shard touches, so its cost follows its
shard, and every layout sees bitwise the same full value.

The streams are numpy's Philox, whose key is 128 bits: torch's CPU generator uses only
32 bits of its seed, and a large model has millions of tiles, so seeds would repeat.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

TILE_ELEMENTS = 1 << 16
TILE_COLUMNS = 2048


@dataclass(frozen=True)
class Normal:
    std: float
    mean: float = 0.0


@dataclass(frozen=True)
class Constant:
    value: float


DISTRIBUTIONS = (Normal, Constant)


def parameter_key(seed: int, fqn: str) -> int:
    """64 bits naming one parameter's values under one seed."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{fqn}".encode(), digest_size=8).digest(), "little")


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A parameter's (rows, columns) in the tile grid: dim 0 by the other dims flattened."""
    rows = shape[0] if shape else 1
    return rows, (int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1)


def tile_shape(rows: int, cols: int) -> tuple[int, int]:
    # Wide rows are cut into column blocks so that a rank holding a slice of the columns
    # (row-wise tensor parallel) does not draw whole rows.
    tile_cols = max(1, min(cols, TILE_COLUMNS))
    return max(1, TILE_ELEMENTS // tile_cols), tile_cols


def draw_block(distribution, key: int, shape: tuple[int, ...], row_range: tuple[int, int],
               col_range: tuple[int, int], out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """The float32 values at rows [r0, r1) and columns [c0, c1) of the parameter's matrix,
    written into `out` (float32, that shape) when given. `threads` (default torch's intra-op
    thread count, which torchrun sets to 1 per rank) draw tiles side by side: each tile has
    its own stream, and numpy fills and scales a tile without holding the GIL."""
    (r0, r1), (c0, c1) = row_range, col_range
    block = np.empty((r1 - r0, c1 - c0), dtype=np.float32) if out is None else out
    if isinstance(distribution, Constant):
        block.fill(distribution.value)
        return block
    rows, cols = matrix_shape(shape)
    tile_rows, tile_cols = tile_shape(rows, cols)
    tiles_per_row = -(-cols // tile_cols)
    std = np.float32(distribution.std)

    def draw_tiles(tiles: list[tuple[int, int]]) -> None:
        scratch = np.empty(tile_rows * tile_cols, dtype=np.float32)
        for i, j in tiles:
            top, bottom = i * tile_rows, min((i + 1) * tile_rows, rows)
            left, right = j * tile_cols, min((j + 1) * tile_cols, cols)
            tile = scratch[:(bottom - top) * (right - left)].reshape(bottom - top, right - left)
            stream = np.random.Generator(np.random.Philox(key=(key << 64) | (i * tiles_per_row + j)))
            stream.standard_normal(tile.shape, dtype=np.float32, out=tile)
            a, b, c, d = max(r0, top), min(r1, bottom), max(c0, left), min(c1, right)
            np.multiply(tile[a - top:b - top, c - left:d - left], std, out=block[a - r0:b - r0, c - c0:d - c0])

    tiles = [(i, j) for i in range(r0 // tile_rows, -(-r1 // tile_rows))
             for j in range(c0 // tile_cols, -(-c1 // tile_cols))]
    workers = min(threads or torch.get_num_threads(), len(tiles))
    if workers <= 1:
        draw_tiles(tiles)
    else:  # a strided share of the tiles each: disjoint parts of `block`
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(draw_tiles, [tiles[k::workers] for k in range(workers)]))
    if distribution.mean:
        block += np.float32(distribution.mean)
    return block
