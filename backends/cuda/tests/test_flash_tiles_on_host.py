"""ops.cu's flash_tiles (a captured graph's flash attention tiles, made on the device from the tokens' slots and
positions) compiled for the host with g++ and run with each CUDA thread a fiber (test_moe_mla_on_host.py's harness),
against the tiles the eager path makes on the host (``CUDABackend._flash_tiles``' rule: each row's tokens cut into
tiles of up to ``tile`` from its first token on): rows of any length, padding tokens between and after them, rows
whose positions do not start at 0, and the spare entries' count 0. Skipped where g++ is missing."""

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("moe_mla_on_host", Path(__file__).parent / "test_moe_mla_on_host.py")
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)

HARNESS = r"""
extern "C" void tiles_of(const int* slots, const int* pos, int* tiles, int n, int tile, int capacity) {
    launch({1, 1, 1}, FLASH_TILES_THREADS, [=] { flash_tiles(slots, pos, tiles, n, tile, capacity); });
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host.host_library(tmp_path_factory, "flash-tiles-host", host._kernel("ops.cu") + HARNESS)


def expected(rows: list[tuple[int, int, int]], tile: int) -> list[tuple[int, int]]:
    """(first token, count) of each tile: rows of (slot, first position, tokens) in token order, slot -1 padding."""
    tiles, first = [], 0
    for slot, _, count in rows:
        if slot >= 0:
            tiles += [(start, min(tile, first + count - start)) for start in range(first, first + count, tile)]
        first += count
    return tiles


@pytest.mark.parametrize("tile", [16, 32, 64])
@pytest.mark.parametrize(
    "rows",
    [
        [(0, 0, 300)],  # one prompt's first chunk, padded below
        [(3, 512, 512)],  # a chunk deep into a prompt: a full bucket
        [(0, 40, 1), (1, 7, 70), (2, 300, 1), (5, 0, 17)],  # decode rows beside chunks
        [(1, 0, 33), (-1, 0, 5), (0, 96, 64)],  # padding between rows
        [(2, 10, 1)] + [(s, 3 * s, 2) for s in range(3, 100)],  # many short rows
    ],
)
def test_flash_tiles_equal_the_eager_paths(kernels, rows, tile):
    slots = np.concatenate([np.full(c, s, np.int32) for s, _, c in rows])
    positions = np.concatenate([np.arange(p, p + c, dtype=np.int32) for _, p, c in rows])
    n = 1 << max(0, (len(slots) - 1).bit_length())  # the graph's bucket: padding (slot -1, position 0) to fill it
    slots = np.concatenate([slots, np.full(n - len(slots), -1, np.int32)])
    positions = np.concatenate([positions, np.zeros(n - len(positions), np.int32)])
    want = expected(rows, tile)
    capacity = min(n, -(-n // tile) + len(rows))  # the backend's bound: a tile a `tile` tokens and one more a row
    assert len(want) <= capacity
    tiles = np.full(2 * capacity, 12345, np.int32)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    kernels.tiles_of(p(slots), p(positions), p(tiles), n, tile, capacity)
    got = tiles.reshape(-1, 2)
    assert [tuple(t) for t in got[: len(want)]] == want
    assert (got[len(want) :] == 0).all()
