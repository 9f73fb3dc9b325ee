#!/usr/bin/env python3
"""Time gemv.py's decode product under several thread shapes, on the Llama-3-8B file's matrix shapes.

    DEV=CUDA python scripts/tinygrad_gemv_shapes.py [--shapes 64,1,1 16,4,2 ...] [--rows 1] [--only gate ...]
        [--reps 20] [--integer]

A shape is ``lanes,groups,per_thread`` (gemv.Shape): ``lanes`` threads share an output's row, ``groups`` such sets
share a block, each thread computes ``per_thread`` outputs from the same loads of x. Each product runs over enough
distinct copies of its weight (over 256 MB together) that none is read from the L2 cache, inside one TinyJit
(a graph of launches), and the time per product is the replay's wall time over the copies; GB/s counts the weight
bytes. The first shape is the reference; every other shape's outputs must equal its own (same sums, other order:
within 1e-5 of the largest magnitude), or the row says so. "gated unit" is the backend's kernel for silu(x G^T) *
(x U^T), gate and up read side by side (its GB/s counts both). ``--only``: the matrices whose names start so.
``--integer``: the Q4_K products take x as 16-bit integers (``intx.py``; x quantized once, outside the timing).
"""

from __future__ import annotations

import argparse
import math
import time

import gguf
import numpy as np
from leat_backend_tinygrad import intx
from leat_backend_tinygrad.gemv import Shape, as_words, gemv
from tinygrad import Device, Tensor, TinyJit

Q = gguf.GGMLQuantizationType
# (name, type, outputs, k) of the 8B file's decode products
MATRICES = [
    ("q/o", Q.Q4_K, 4096, 4096),
    ("k/v", Q.Q4_K, 1024, 4096),
    ("v (Q6_K)", Q.Q6_K, 1024, 4096),
    ("gate/up", Q.Q4_K, 14336, 4096),
    ("gated unit", Q.Q4_K, 14336, 4096),
    ("down", Q.Q4_K, 4096, 14336),
    ("down (Q6_K)", Q.Q6_K, 4096, 14336),
    ("output", Q.Q6_K, 128256, 4096),
]
DEFAULT_SHAPES = ["64,1,1", "64,1,2", "64,1,4", "32,2,2", "32,4,2", "16,4,2", "16,2,4", "16,4,4", "16,8,4", "16,1,8"]


def blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:
        b[..., :4] = np.array([3e-3, 3e-3], np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:
        b[..., -2:] = np.array([3e-3], np.float16).view(np.uint8)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", nargs="*", default=[], help="matrices whose names start with one of these")
    ap.add_argument("--integer", action="store_true", help="Q4_K products of 16-bit integer x (intx.py)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = [Shape(*map(int, s.split(","))) for s in args.shapes]
    print(f"# {Device.DEFAULT}, {args.rows} row(s) of x; us per product (GB/s of weight bytes)")
    print("| matrix | " + " | ".join(args.shapes) + " |")
    print("|---|" + "---:|" * len(shapes))
    for name, qtype, n, k in MATRICES:
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        gated = name == "gated unit"
        host = blocks(qtype, n, k, rng)
        read = host.nbytes * (2 if gated else 1)  # weight bytes a product reads
        copies = max(2 if gated else 1, math.ceil(256e6 / read))
        ws = [Tensor(as_words(host, qtype)).realize()]
        ws += [(ws[0] + 0).realize() for _ in range(copies - 1)]  # distinct buffers, same bytes
        ups = ws[1:] + ws[:1] if gated else [None] * copies  # the gated unit's up: another copy
        x = Tensor(rng.standard_normal((args.rows, k)).astype(np.float32)).realize()
        integer = args.integer and qtype == Q.Q4_K
        inputs = [t.realize() for t in intx.quantize(x).tensors()] if integer else [x]
        cells, ref = [], None
        for shape in shapes:

            def products(*xs, shape=shape, qtype=qtype, ws=ws, ups=ups):
                x = intx.Quantized(*xs) if len(xs) == 3 else xs[0]
                return [gemv(x, w, qtype, shape, up=u) for w, u in zip(ws, ups)]

            step = TinyJit(products)
            for _ in range(3):
                outs = step(*inputs)
            Device[Device.DEFAULT].synchronize()
            got = outs[0].numpy()
            if ref is None:
                ref = got
            t0 = time.perf_counter()
            for _ in range(args.reps):
                step(*inputs)
            Device[Device.DEFAULT].synchronize()
            us = (time.perf_counter() - t0) / args.reps / copies * 1e6
            ok = np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
            cells.append(f"{us:.1f} ({read / us / 1e3:.0f})" + ("" if ok else " WRONG"))
        print(f"| {name} {qtype.name} {n}x{k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
