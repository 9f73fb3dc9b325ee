#!/usr/bin/env python3
"""How fast tinygrad's own float16 products are at a prompt chunk's shapes (the 8B file's), as the tinygrad backend
runs its prefill products: x [rows, k] float16 times a float16 weight copy [n, k], summed in float32.

    DEV=CUDA python scripts/tinygrad_gemm_times.py [--rows 512]          # tinygrad's default optimisations
    DEV=CUDA BEAM=2 python scripts/tinygrad_gemm_times.py                # its beam search (slow to compile)
    DEV=CUDA python scripts/tinygrad_gemm_times.py --pinned              # the backend's: gemm.py's opts per shape

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
    ap.add_argument("--pinned", action="store_true", help="the products as the backend runs them (gemm.tuned_opts)")
    args = ap.parse_args()
    from leat_backend_tinygrad.gemm import half_product, tuned_opts
    from tinygrad import Device, Tensor, TinyJit, dtypes

    for name, (n, k) in SHAPES.items():
        x = Tensor.rand(args.rows, k, dtype=dtypes.float16).realize()
        w = Tensor.rand(n, k, dtype=dtypes.float16).realize()
        opts = tuned_opts(Device[x.device].renderer, args.rows, n, k) if args.pinned else None
        product = TinyJit(lambda x, w, opts=opts: half_product(x, w, opts).realize())
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
            f"{name:8} {args.rows} x {k} -> {n}: {seconds * 1e6:9.1f} us  {flops / seconds / 1e12:7.1f} TFLOP/s"
            f"  opts {'pinned' if opts else 'tinygrad'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
