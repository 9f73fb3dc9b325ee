#!/usr/bin/env python3
"""How fast tinygrad's own float16 products are at a prompt chunk's shapes (the 8B file's), as the tinygrad backend
runs its prefill products: x [rows, k] float16 times a float16 weight copy [n, k], summed in float32.

    DEV=CUDA python scripts/tinygrad_gemm_times.py [--rows 512]          # tinygrad's default optimisations
    DEV=CUDA BEAM=2 python scripts/tinygrad_gemm_times.py                # its beam search (slow to compile)

Each product runs under TinyJit (replayed as a graph), 3 times to warm up and ``--reps`` times timed with a device
synchronisation at the end; the line gives microseconds a product and TFLOP/s.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from tinygrad import Device, Tensor, TinyJit, dtypes

    for name, (n, k) in SHAPES.items():
        x = Tensor.rand(args.rows, k, dtype=dtypes.float16).realize()
        w = Tensor.rand(n, k, dtype=dtypes.float16).realize()
        product = TinyJit(lambda x, w: x.matmul(w.T, dtype=dtypes.float32).realize())
        for _ in range(3):
            product(x, w)
        Device[x.device].synchronize()
        begin = time.perf_counter()
        for _ in range(args.reps):
            product(x, w)
        Device[x.device].synchronize()
        seconds = (time.perf_counter() - begin) / args.reps
        flops = 2 * args.rows * n * k
        print(
            f"{name:8} {args.rows} x {k} -> {n}: {seconds * 1e6:9.1f} us  {flops / seconds / 1e12:7.1f} TFLOP/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
