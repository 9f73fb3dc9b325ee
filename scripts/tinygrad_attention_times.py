#!/usr/bin/env python3
"""How long the tinygrad backend's decode attention takes a layer at the 8B file's shapes (32 heads, 8 KV heads,
128 entries, float16 paged KV), with the scores and chunks in one kernel or two, and for other chunk sizes.

    DEV=CUDA python scripts/tinygrad_attention_times.py [--rows 1] [--positions 640,4096]

Each line runs ``--layers`` attentions (as many layers, each its own KV storage) under one TinyJit, replayed as a
graph: 3 replays to warm up, ``--reps`` timed with a device synchronisation at the end; microseconds a layer, the
launch gaps between a graph's kernels included (as in a decode step). Every row is at its slot's last position (all
positions attended). The outputs of every configuration are compared with the first's (max abs difference).
"""

from __future__ import annotations

import argparse
import time

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--positions", default="640,4096", help="each slot's capacity (a multiple of 16), comma separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import numpy as np
    from leat_backend_tinygrad import attention
    from tinygrad import Device, Tensor, TinyJit

    configs = [  # (label, fused, the chunks' least size, the chunks halved while fewer than this)
        ("three kernels", False, attention.MIN_CHUNK, attention.CHUNKS),
        ("fused (default)", True, attention.FUSED_MIN_CHUNK, attention.CHUNKS),
        ("fused, chunks of 16+", True, 16, 32),
        ("fused, >= 16 chunks", True, 16, 16),
        ("fused, >= 8 chunks", True, 16, 8),
    ]
    for positions in (int(p) for p in args.positions.split(",")):
        pages = positions // PAGE
        rng = np.random.default_rng(0)
        q = Tensor(rng.standard_normal((args.rows, HEADS, DIM)).astype(np.float32)).realize()
        storage = [
            Tensor(rng.standard_normal((args.rows * positions, KV_HEADS, DIM)).astype(np.float16)).realize()
            for _ in range(2 * args.layers)
        ]
        table = Tensor(rng.permutation(args.rows * pages).reshape(args.rows, pages).astype(np.int32)).realize()
        at = Tensor(np.full(args.rows, positions - 1, np.int32)).realize()
        first = None
        for label, fused, low, chunks in configs:
            attention.MIN_CHUNK = attention.FUSED_MIN_CHUNK = low
            attention.CHUNKS = chunks

            def step(q, table, at, fused=fused, storage=storage):
                outs = [
                    attention.decode_attention(
                        q, storage[2 * i], storage[2 * i + 1], table, at, PAGE, 0.088, fused=fused
                    )
                    for i in range(args.layers)
                ]
                return Tensor.stack(*outs).realize()

            jit = TinyJit(step)
            for _ in range(3):
                out = jit(q, table, at)
            Device[q.device].synchronize()
            begin = time.perf_counter()
            for _ in range(args.reps):
                out = jit(q, table, at)
            Device[q.device].synchronize()
            seconds = (time.perf_counter() - begin) / args.reps / args.layers
            got = out.numpy()
            first = got if first is None else first
            print(
                f"positions {positions:5} rows {args.rows:2} {label:22} {seconds * 1e6:8.2f} us a layer"
                f"  max diff {np.abs(got - first).max():.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
