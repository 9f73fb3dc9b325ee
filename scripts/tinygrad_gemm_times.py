#!/usr/bin/env python3
"""How fast the tinygrad backend's float16 products are at a prompt chunk's shapes (the 8B file's): x [rows, k] float16
times a float16 weight copy [n, k], summed in float32.

    DEV=CUDA python scripts/tinygrad_gemm_times.py [--rows 512]          # tinygrad's default optimisations
    DEV=CUDA BEAM=2 python scripts/tinygrad_gemm_times.py                # its beam search (slow to compile)
    DEV=CUDA python scripts/tinygrad_gemm_times.py --pinned              # gemm.py's opts per shape
    DEV=CUDA python scripts/tinygrad_gemm_times.py --staged              # gemm.py's staged tiles (the backend's)
    DEV=CUDA python scripts/tinygrad_gemm_times.py --staged --sweep      # and every tile set of SWEEP beside them
    DEV=CUDA python scripts/tinygrad_gemm_times.py --staged --tiles 128,128,32,2,2,auto,2 --only gate/up

Each line times ``--batch`` products of the shape (different weights of it) in one TinyJit, replayed as a graph, 3
times to warm up and ``--reps`` times timed with a device synchronisation at the end: microseconds a product and
TFLOP/s. A batch of products puts one replay's host time (~0.2 ms) over several kernels, as a layer's chunk does.
The staged lines give the largest difference from the pinned kernel's result, as a check.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
# the backend's products of one x as one (TinygradBackend.matmuls): q, k and v side by side; gate and up
SHAPES |= {"qkv": (6144, 4096), "gate+up": (28672, 4096)}
# gemm.Tiles tried by --sweep, as LEAT_TINYGRAD_TILES writes them (gemm.Tiles.parse: pad auto, the tiles' own choice;
# runs 0: the fragments read in PTX's order, 4 bytes at a time, as before the thirty-fourth session)
SWEEP = [
    "128,128,32,2,4,8,2,0",
    "128,64,32,4,2,8,2,0",
    "128,128,32,2,4,auto,2",
    "128,128,32,4,2,auto,2",
    "128,128,32,2,2,auto,2",
    "128,64,32,4,2,auto,2",
    "64,128,32,2,2,auto,2",
    "64,64,32,2,2,auto,2",
    "128,128,64,2,4,auto,1",
    "256,128,32,4,2,auto,1",
    "128,256,32,2,4,auto,1",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="products a timed call")
    ap.add_argument("--pinned", action="store_true", help="gemm.tuned_opts's kernel")
    ap.add_argument("--staged", action="store_true", help="gemm.staged_product with gemm.tiles_for's tiles")
    ap.add_argument("--sweep", action="store_true", help="with --staged: every tile set of SWEEP too")
    ap.add_argument("--only", nargs="*", default=[], help="these products only (names as SHAPES has them)")
    ap.add_argument("--tiles", nargs="*", default=[], help="with --staged: these tiles only, as LEAT_TINYGRAD_TILES")
    args = ap.parse_args()
    from leat_backend_tinygrad import gemm
    from tinygrad import Device, Tensor, TinyJit, dtypes

    def timed(name: str, how: str, product, xs, ws, flops: int, want=None) -> object:
        run = TinyJit(lambda *ts: [product(x, w).realize() for x, w in zip(ts[: len(xs)], ts[len(xs) :])])
        for _ in range(3):
            outs = run(*xs, *ws)
        Device[xs[0].device].synchronize()
        begin = time.perf_counter()
        for _ in range(args.reps):
            outs = run(*xs, *ws)
        Device[xs[0].device].synchronize()
        seconds = (time.perf_counter() - begin) / args.reps / len(xs)
        got = outs[0].numpy()
        check = "" if want is None else f"  max diff {abs(got - want).max():.2e}"
        print(
            f"{name:8} {args.rows} x {xs[0].shape[1]} -> {ws[0].shape[0]}: {seconds * 1e6:9.1f} us"
            f"  {flops / seconds / 1e12:7.1f} TFLOP/s  {how}{check}",
            flush=True,
        )
        return got

    for name, (n, k) in SHAPES.items():
        if args.only and name not in args.only:
            continue
        xs = [Tensor.rand(args.rows, k, dtype=dtypes.float16).realize() for _ in range(args.batch)]
        ws = [Tensor.rand(n, k, dtype=dtypes.float16).realize() for _ in range(args.batch)]
        renderer, flops = Device[xs[0].device].renderer, 2 * args.rows * n * k
        opts = gemm.tuned_opts(renderer, args.rows, n, k) if args.pinned or args.staged else None
        want = timed(
            name,
            "opts pinned" if opts else "opts tinygrad's",
            lambda x, w, opts=opts: gemm.half_product(x, w, opts),
            xs,
            ws,
            flops,
        )
        if not args.staged:
            continue
        chosen = gemm.tiles_for(renderer, args.rows, n, k)
        tried = [chosen] if chosen and not args.tiles else []
        tried += [gemm.Tiles.parse(t) for t in [*args.tiles, *(SWEEP if args.sweep else [])]]
        for tiles in dict.fromkeys(tried):
            if not gemm.fits(tiles, n, k, dtypes.float16):
                continue
            how = ("staged (the backend's) " if tiles == chosen else "staged ") + str(tiles)
            timed(name, how, lambda x, w, tiles=tiles: gemm.staged_product(x, w, tiles), xs, ws, flops, want)


if __name__ == "__main__":
    main()
