"""Write the CUDA backend's codebooks of the IQ quant types (kernels/iq_grids.cuh) from gguf-py's own tables, the ones
``gguf.quants.dequantize`` decodes with (llama.cpp's iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid, iq3s_grid and
iq1s_grid).

    python3 scripts/gen_iq_grids.py           # rewrite the header
    python3 scripts/gen_iq_grids.py --check   # exit 1 if the header is not what gguf-py's tables give

The sign table ksigns_iq2xs is not written: entry i is i with its parity in bit 7, which the kernels compute (the
script checks that against gguf-py's table).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import quants

HEADER = Path(__file__).resolve().parents[1] / "backends/cuda/src/leat_backend_cuda/kernels/iq_grids.cuh"
PREAMBLE = """\
// llama.cpp's codebooks of the IQ quant types, written by scripts/gen_iq_grids.py from gguf-py's tables: do not edit.
// Entry i of a grid holds the 8 (iq2*, iq1s) or 4 (iq3*) values of codeword i, value j in byte j:
//   iq2xxs_grid, iq2xs_grid, iq2s_grid: 8, 25 or 43;  iq3xxs_grid: 4 .. 62;  iq3s_grid: 1 .. 15;
//   iq1s_grid: value + 1 (-1, 0, 1 as 0, 1, 2), values 0-3 in the low nibbles of bytes 0-3, 4-7 in the high nibbles.
#pragma once
#include "common.cuh"
"""


def grid(cls: type) -> np.ndarray:
    cls.init_grid()
    return np.asarray(cls.grid).reshape(cls.grid_shape).astype(np.int64)


def packed(values: np.ndarray) -> list[int]:
    """Each row of byte values as one little-endian integer, value j in byte j."""
    return [sum(int(v) << (8 * j) for j, v in enumerate(row)) for row in values]


def table(kind: str, name: str, entries: list[int], per_line: int) -> str:
    digits = 16 if kind == "u64" else 8
    lines = [
        "    " + " ".join(f"0x{e:0{digits}x}{'ull' if kind == 'u64' else 'u'}," for e in entries[i : i + per_line])
        for i in range(0, len(entries), per_line)
    ]
    return f"static const __device__ {kind} {name}[{len(entries)}] = {{\n" + "\n".join(lines) + "\n};\n"


def header() -> str:
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8).astype(int)
    parity = np.array([i.bit_count() & 1 for i in range(128)])
    assert (ksigns == np.arange(128) | parity << 7).all(), "ksigns_iq2xs is no longer i | parity << 7"
    iq1 = grid(quants.IQ1_S) + 1
    assert (grid(quants.IQ1_M) + 1 == iq1).all()
    parts = [
        table("u64", "iq2xxs_grid", packed(grid(quants.IQ2_XXS)), 5),
        table("u64", "iq2xs_grid", packed(grid(quants.IQ2_XS)), 5),
        table("u64", "iq2s_grid", packed(grid(quants.IQ2_S)), 5),
        table("u32", "iq3xxs_grid", packed(grid(quants.IQ3_XXS)), 8),
        table("u32", "iq3s_grid", packed(grid(quants.IQ3_S)), 8),
        table("u32", "iq1s_grid", packed(iq1[:, :4] | iq1[:, 4:] << 4), 8),
    ]
    return PREAMBLE + "\n" + "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = header()
    if args.check:
        same = HEADER.exists() and HEADER.read_text() == text
        print(f"{HEADER.name} {'matches' if same else 'differs from'} gguf-py's tables")
        return 0 if same else 1
    HEADER.write_text(text)
    print(f"wrote {HEADER} ({len(text) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
